"""Contract: what a log-sum-exp is for. ``attention`` returns, beside its output, the
log-sum-exp of each query's scores (``[batch, heads, q_seq]``); two results over disjoint
key sets merge into the result over their union. Core's context parallelism merges the
blocks of a ring this way, and a backend whose kernel lacks a mask form merges its
pieces the same way ([Note: attention pieces] in ``platform/attention_pieces``), so the
rule is stated once, here, with the contract it follows from.

[Note: log-sum-exp merge]
Attention over keys ``K = K1 ∪ K2`` equals ``w1 * out1 + w2 * out2`` with
``w_i = exp(lse_i - lse)`` and ``lse = log(exp(lse1) + exp(lse2))``, where ``out_i`` and
``lse_i`` are the output and log-sum-exp over ``K_i`` alone (the online-softmax identity
of FlashAttention, used by ring attention: Liu et al., "Ring Attention with Blockwise
Transformers", 2023, and torch's ``_templated_ring_attention``). The merge runs in
``max(float32, dtype)`` whatever the input dtype. A query that sees no key of a block has
``lse = -inf``; it is floored to ``LSE_FLOOR`` (a finite number far below any real
log-sum-exp), so ``-inf - -inf`` never makes a NaN and its weight ``exp(floor - lse)``
is exactly 0 once a real block has been merged.
"""

from __future__ import annotations

from typing import Any

#: Far below any reachable log-sum-exp, far above -inf; see [Note: log-sum-exp merge].
LSE_FLOOR = -1.0e30


def stat_dtype(p: Any, dtype: Any) -> Any:
    """``max(float32, dtype)``: the dtype of softmax statistics and merges (``p`` the
    platform)."""
    return dtype if dtype == p.dtype("float64") else p.dtype("float32")


def floor_lse(p: Any, lse: Any) -> Any:
    """``max(lse, LSE_FLOOR)`` elementwise with the documented tensor methods."""
    floor = p.full(tuple(lse.shape), LSE_FLOOR, lse.dtype)
    return p.cat([lse.unsqueeze(0), floor.unsqueeze(0)], 0).amax(0)


def _weight(x: Any) -> Any:
    """``[batch, heads, q_len]`` -> ``[batch, q_len, heads, 1]`` to scale an output."""
    return x.transpose(1, 2).unsqueeze(-1)


def merge(p: Any, acc: tuple[Any, Any] | None, new: tuple[Any, Any]) -> tuple[Any, Any]:
    """Merge a partial ``(out [batch, q, heads, dim], lse [batch, heads, q])`` into the
    accumulator ``acc`` (``None`` at first), in ``max(float32, dtype)``; see
    [Note: log-sum-exp merge]. Differentiable (the stabilizing maximum is detached)."""
    out, lse = new
    dtype = stat_dtype(p, out.dtype)
    out, lse = p.to_dtype(out, dtype), floor_lse(p, p.to_dtype(lse, dtype))
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    top = p.detach(p.cat([acc_lse.unsqueeze(0), lse.unsqueeze(0)], 0).amax(0))
    merged = ((acc_lse - top).exp() + (lse - top).exp()).log() + top
    return acc_out * _weight((acc_lse - merged).exp()) + out * _weight((lse - merged).exp()), merged
