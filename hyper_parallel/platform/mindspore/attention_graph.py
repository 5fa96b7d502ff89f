"""The MindSpore CPU attention of a small call as one ``mindspore.jit`` graph each way
([Note: MindSpore CPU attention in one graph] in ``attention.py``).

Imported by ``attention.py`` when such a call first runs (this module imports MindSpore).
Tensors are in the compute dtype (float32 or float64). Inside, queries are in the grouped
row layout ``[batch, kv_heads, seq_q * group, head_dim]`` (row ``i * group + g``) of
[Note: MindSpore CPU attention tiles], keys and values ``[batch, kv_heads, seq_k,
head_dim]``. ``mask``: ``[seq_q * group, seq_k]`` bool, True where a query sees a key;
``None`` when every pair is seen. A masked score is set to ``-1e30``: ``exp(-1e30 - m)``
is exactly 0, and no ``inf - inf`` arises. Graphs are compiled for each new shape and
kept by MindSpore with their intermediate buffers.
"""

from __future__ import annotations

from typing import Any

import mindspore
from mindspore import mint, ops

from hyper_parallel.platform.contract.attention_merge import LSE_FLOOR

#: Score of a masked pair.
_MASKED = -1.0e30

_matmul = ops.BatchMatMul()  # a @ b
_matmul_t = ops.BatchMatMul(transpose_b=True)  # a @ b^T
_t_matmul = ops.BatchMatMul(transpose_a=True)  # a^T @ b


def _rows(x: Any, kv_heads: int) -> Any:
    """``[B, S, H, D]`` -> ``[B, Hkv, S * group, D]``."""
    b, s, h, d = x.shape
    return x.reshape(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 1, 3, 4).reshape(
        b, kv_heads, s * (h // kv_heads), d)


def _unrows(x: Any, heads: int) -> Any:
    """``[B, Hkv, S * group, D]`` -> ``[B, S, H, D]``."""
    b, kv_heads, r, d = x.shape
    group = heads // kv_heads
    return x.reshape(b, kv_heads, r // group, group, d).permute(0, 2, 1, 3, 4).reshape(b, r // group, heads, d)


def _scores(q: Any, k: Any, mask: Any) -> Any:
    """``q k^T`` ``[B, Hkv, rows, keys]``, ``-1e30`` where ``mask`` is False."""
    s = _matmul_t(q, k)
    if mask is not None:
        s = mint.where(mask, s, _MASKED)
    return s


@mindspore.jit
def forward(q: Any, k: Any, v: Any, mask: Any, scale: Any) -> tuple[Any, Any]:
    """``q`` ``[B, Sq, H, D]``, ``k``/``v`` ``[B, Sk, Hkv, D]``, ``scale`` a 0-d tensor ->
    ``(out [B, Sq, H, D], lse [B, H, Sq])``: ``P = exp(s - m)`` with ``m`` the row maximum
    (finite: every row sees a key), ``out = P v / rowsum(P)``, ``lse = m + log rowsum(P)``."""
    b, sq, heads, _ = q.shape
    kv_heads = k.shape[2]
    s = _scores(_rows(q, kv_heads) * scale, k.permute(0, 2, 1, 3), mask)
    m = mint.max(s, dim=-1, keepdim=True)[0]
    p = mint.exp(s - m)
    total = mint.sum(p, -1, keepdim=True)
    out = _unrows(_matmul(p, v.permute(0, 2, 1, 3)) / total, heads)
    lse = (m + mint.log(total)).reshape(b, kv_heads, sq, heads // kv_heads).permute(0, 1, 3, 2)
    return out, lse.reshape(b, heads, sq)


@mindspore.jit
def backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any, scale: Any) -> tuple[Any, Any, Any]:
    """The backward of ``forward`` (FlashAttention-2's, recomputing ``P = exp(s - lse)``):
    ``dS = P * (dout v^T - delta)``, ``delta = rowsum(dout * out)``; ``dq = dS k * scale``,
    ``dk = dS^T (q * scale)``, ``dv = P^T dout``, shaped like ``q``, ``k``, ``v``. ``out``/``lse``
    may be those of a larger key set ([Note: attention kernels]); a row that sees no key
    (``lse`` at or below ``LSE_FLOOR``) takes ``lse = 1e30``, so its ``P`` is 0."""
    b, sq, heads, _ = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    k_rows, q_rows, do = k.permute(0, 2, 1, 3), _rows(q, kv_heads) * scale, _rows(dout, kv_heads)
    delta = mint.sum(do * _rows(out, kv_heads), -1, keepdim=True)
    lse = lse.reshape(b, kv_heads, group, sq).permute(0, 1, 3, 2).reshape(b, kv_heads, sq * group, 1)
    lse = mint.where(lse <= LSE_FLOOR, -LSE_FLOOR, lse)
    p = mint.exp(_scores(q_rows, k_rows, mask) - lse)
    ds = p * (_matmul_t(do, v.permute(0, 2, 1, 3)) - delta)
    dq = _unrows(_matmul(ds, k_rows) * scale, heads)
    return dq, _t_matmul(ds, q_rows).permute(0, 2, 1, 3), _t_matmul(p, do).permute(0, 2, 1, 3)
