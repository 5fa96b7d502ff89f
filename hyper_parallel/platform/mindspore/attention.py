"""Local attention on MindSpore, returning the output and its log-sum-exp.

Layout is BSHD (``[batch, seq, heads, head_dim]``). The plain path computes everything in
float32 (MindSpore's CPU MatMul has no bfloat16 kernel, and the contract asks for
float32 softmax statistics) and casts the output to ``q``'s dtype.

[Note: fully-masked rows]
A query that sees no key has output 0 and log-sum-exp -inf, with no NaN in forward or
backward: the row maximum and the row sum are replaced by 0 and 1 there (so no
``-inf - -inf`` and no ``log(0)``), and ``where`` sends gradients only to the branch it
selected. The row maximum is a constant for autograd: the output and the log-sum-exp
do not depend on it, so its gradient would only cancel.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def check_shapes(q: Any, k: Any, v: Any, mask: Any, bool_dtype: Any) -> None:
    """Raise ValueError unless q/k/v/mask fit the contract of ``Platform.attention``."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention: q, k, v must be 4-D [batch, seq, heads, head_dim], got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"attention: q has {heads} heads, not a multiple of k/v's {kv_heads} heads; "
                         "grouped-query attention needs heads divisible by kv_heads")
    if mask is None:
        return
    if mask.dtype != bool_dtype:
        raise ValueError(f"attention: mask has dtype {mask.dtype}; it must be bool (True where attention is allowed)")
    target = (q.shape[0], heads, q.shape[1], k.shape[1])
    shape = tuple(mask.shape)
    if len(shape) > 4 or any(m not in (1, t) for m, t in zip(reversed(shape), reversed(target))):
        raise ValueError(f"attention: mask shape {shape} does not broadcast to [batch, heads, q_seq, kv_seq] = "
                         f"{list(target)}")


def allowed_mask(ms: Any, mint: Any, q_seq: int, kv_seq: int, causal: bool, mask: Any) -> Any:
    """The bool mask of allowed (query, key) pairs, or None when every pair is allowed."""
    allowed = mask
    if causal:
        # Built on the host: mint.tril has no CPU kernel in MindSpore 2.10.
        lower = ms.Tensor(np.tril(np.ones((q_seq, kv_seq), dtype=np.bool_)))
        allowed = lower if mask is None else mint.logical_and(lower, mask)
    return allowed


def _heads_first(ms: Any, x: Any, group: int) -> Any:
    """``[B, S, Hkv, D]`` -> float32 ``[B, Hkv * group, S, D]``, each kv head repeated
    ``group`` times in place (query head ``h`` uses kv head ``h // group``)."""
    x = x.astype(ms.float32).permute(0, 2, 1, 3)
    if group == 1:
        return x
    batch, kv_heads, seq, dim = x.shape
    return x.unsqueeze(2).broadcast_to((batch, kv_heads, group, seq, dim)).reshape(batch, kv_heads * group, seq, dim)


def _softmax_stats(ms: Any, mint: Any, scores: Any, allowed: Any) -> tuple[Any, Any, Any]:
    """``(exp(scores - max), safe row sum, lse [B, H, Sq])`` of float32 scores, masked;
    see [Note: fully-masked rows]."""
    if allowed is None:
        row_max = ms.ops.stop_gradient(mint.amax(scores, dim=-1, keepdim=True))
        weights = mint.exp(scores - row_max)
        row_sum = weights.sum(dim=-1, keepdim=True)
        return weights, row_sum, (mint.log(row_sum) + row_max).squeeze(-1)
    scores = mint.where(allowed, scores, float("-inf"))
    sees_any = allowed.any(-1, keepdim=True)
    row_max = ms.ops.stop_gradient(mint.where(sees_any, mint.amax(scores, dim=-1, keepdim=True), 0.0))
    weights = mint.exp(scores - row_max)
    row_sum = mint.where(sees_any, weights.sum(dim=-1, keepdim=True), 1.0)
    lse = mint.where(sees_any, mint.log(row_sum) + row_max, float("-inf"))
    return weights, row_sum, lse.squeeze(-1)


def attention(ms: Any, mint: Any, q: Any, k: Any, v: Any, *, scale: float | None, causal: bool, mask: Any,
              fused: bool) -> tuple[Any, Any]:
    """``(out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] float32)``; see
    ``Platform.attention``. With ``fused`` (Ascend) and a float16/bfloat16 ``q`` the output
    comes from ``ops.flash_attention_score``, the log-sum-exp from the plain path."""
    check_shapes(q, k, v, mask, ms.bool_)
    batch, q_seq, heads, dim = q.shape
    kv_seq, group = k.shape[1], heads // k.shape[2]
    scale = dim ** -0.5 if scale is None else float(scale)
    allowed = allowed_mask(ms, mint, q_seq, kv_seq, causal, mask)
    qf = q.astype(ms.float32).permute(0, 2, 1, 3)
    kf = _heads_first(ms, k, group)
    scores = mint.matmul(qf, kf.transpose(2, 3)) * scale  # [B, H, Sq, Sk]
    weights, row_sum, lse = _softmax_stats(ms, mint, scores, allowed)
    if fused and q.dtype in (ms.float16, ms.bfloat16):
        return _flash_out(ms, mint, q, k, v, heads, scale, allowed), lse
    out = mint.matmul(weights / row_sum, _heads_first(ms, v, group))  # [B, H, Sq, D]
    return out.permute(0, 2, 1, 3).contiguous().astype(q.dtype), lse


def _flash_out(ms: Any, mint: Any, q: Any, k: Any, v: Any, heads: int, scale: float, allowed: Any) -> Any:
    """Attention output from ``ops.flash_attention_score`` (Ascend; BSND layout, GQA
    native). Its mask marks *discarded* pairs and must be ``[Sq, Sk]`` or
    ``[B, H|1, Sq, Sk]``; rows that see no key are set to 0 explicitly."""
    batch, q_seq, _, _ = q.shape
    kv_seq = k.shape[1]
    discard = None
    if allowed is not None:
        if allowed.ndim != 2:
            allowed = allowed.broadcast_to((batch, heads, q_seq, kv_seq))
        discard = mint.logical_not(allowed).astype(ms.uint8)
    out = ms.ops.flash_attention_score(q, k, v, heads, attn_mask=discard, scalar_value=scale,
                                       input_layout="BSND", sparse_mode=0)
    if allowed is None:
        return out
    sees_any = allowed.broadcast_to((batch, heads, q_seq, kv_seq)).any(-1)  # [B, H, Sq]
    return mint.where(sees_any.permute(0, 2, 1).unsqueeze(-1), out, 0.0)
