"""Attention of a block of queries against blocks of keys, and the log-sum-exp merge of
partial results.

[Note: log-sum-exp merge]
Attention over keys ``K = K1 ∪ K2`` equals ``w1 * out1 + w2 * out2`` with
``w_i = exp(lse_i - lse)`` and ``lse = log(exp(lse1) + exp(lse2))``, where ``out_i`` and
``lse_i`` are the output and log-sum-exp over ``K_i`` alone (the online-softmax identity
of FlashAttention, used by ring attention: Liu et al., "Ring Attention with Blockwise
Transformers", 2023, and torch's ``_templated_ring_attention``). The merge runs in
float32 whatever the input dtype. A query that sees no key of a block has ``lse = -inf``;
it is floored to ``_LSE_FLOOR`` (a finite number far below any real log-sum-exp), so
``-inf - -inf`` never makes a NaN and its weight ``exp(floor - lse)`` is exactly 0 once a
real block has been merged. Autograd differentiates the merge (the maximum used for
stability is detached: the result does not depend on it).
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.context_parallel.masks import BlockCall

#: Far below any reachable log-sum-exp of float32 scores, far above -inf; see
#: [Note: log-sum-exp merge].
_LSE_FLOOR = -1.0e30

#: A partial result: output ``[batch, q_len, heads, head_dim]`` and log-sum-exp
#: ``[batch, heads, q_len]`` float32.
BlockResult = tuple[Any, Any]


def run_call(p: Any, q: Any, k: Any, v: Any, call: BlockCall, scale: float | None) -> BlockResult:
    """``platform.attention`` of query rows ``call.q_start ..`` (dim 1 of BSHD ``q``)
    against the key runs of ``call`` (dim 1 of ``k``/``v``)."""
    q_part = q if call.q_len == q.shape[1] else p.narrow(q, 1, call.q_start, call.q_len)
    if len(call.k_runs) == 1 and call.k_runs[0] == (0, k.shape[1]):
        k_part, v_part = k, v
    else:
        k_part = p.cat([p.narrow(k, 1, s, n) for s, n in call.k_runs], 1)
        v_part = p.cat([p.narrow(v, 1, s, n) for s, n in call.k_runs], 1)
    mask = None if call.mask is None else p.from_numpy(call.mask)
    return p.attention(q_part, k_part, v_part, scale=scale, causal=call.causal, mask=mask)


def floor_lse(p: Any, lse: Any) -> Any:
    """``max(lse, _LSE_FLOOR)`` with the documented methods (no clamp on the list)."""
    floor = p.full(tuple(lse.shape), _LSE_FLOOR, lse.dtype)
    return p.stack([lse, floor], 0).amax(0)


def _weight(x: Any) -> Any:
    """``[batch, heads, q_len]`` -> ``[batch, q_len, heads, 1]`` to scale an output."""
    return x.transpose(1, 2).unsqueeze(-1)


def merge(p: Any, acc: BlockResult | None, new: BlockResult) -> BlockResult:
    """Merge a block's ``(out, lse)`` into the float32 accumulator ``acc`` (``None`` at
    first); see [Note: log-sum-exp merge]."""
    out, lse = new
    out, lse = out.float(), floor_lse(p, lse)
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    top = p.detach(p.stack([acc_lse, lse], 0).amax(0))
    total = (acc_lse - top).exp() + (lse - top).exp()
    merged = total.log() + top
    return acc_out * _weight((acc_lse - merged).exp()) + out * _weight((lse - merged).exp()), merged
