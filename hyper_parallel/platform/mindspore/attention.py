"""Fused attention kernels on MindSpore (see [Note: attention kernels] in
``hyper_parallel.platform.contract.attention``).

- mindspore-cpu: MindSpore 2.10 registers no ``FlashAttentionScore`` on CPU, so this
  module runs FlashAttention-2 itself, in tiles ([Note: MindSpore CPU attention tiles]),
  a small call as one graph ([Note: MindSpore CPU attention in one graph]).
- mindspore-ascend: the ``FlashAttentionScore`` primitive and ``FlashAttentionScoreGrad``
  ([Note: Ascend FlashAttentionScore]).

Packed documents (on Ascend: those not taken in one TND call, see
[Note: Ascend FlashAttentionScore]; and bottom-right causal with more queries than keys)
run on the pieces of ``hyper_parallel.platform.attention_pieces``.

[Note: MindSpore CPU attention tiles]
The forward is FlashAttention-2's (Dao, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", 2023, Algorithm 1): for each tile of queries, loop
over the tiles of keys keeping the running row maximum ``m``, row sum ``l`` and
unnormalized output ``acc``; each new tile rescales them by ``exp(m_old - m_new)``. The
backward is its Algorithm 2 with the loops swapped (queries outer, so that ``dq`` of a
tile is finished at once and ``dk``/``dv`` are kept per key tile, ``O(seq x head_dim)``):
it recomputes ``P = exp(s - lse)`` per tile, ``delta = rowsum(dout * out)`` once.
Memory is ``O(q_tile x k_tile)`` per kv head for the scores, never ``[Sq, Sk]``.

- Tiles: ``Q_TILE`` = 1024 queries by ``K_TILE`` = 1024 keys. PyNative costs ~0.05 ms
  per operation on CPU (measured), far below a tile's matmuls, so tiles are sized for
  memory (one float32 score tile is ``batch x heads x 4 MiB``; about five are live in the
  backward) and speed. Forward + backward at ``[1, 4096, 8, 64]`` float32 causal on 2
  cores: 1.5 s with 1024 x 1024 tiles, 1.8 s with 1024 x 512, 2.0 s with 512 x 512,
  1.6 s with 2048 x 1024 (twice the memory); the dense implementation this replaced took
  5.0 s and 10.9 GiB of peak RSS, these ~0.3 GiB.
- No score-sized operation broadcasts: a ``[rows, 1]`` statistic broadcast over a
  ``[rows, keys]`` tile (``s - m``, ``dp - delta``, a ``[rows, keys]`` mask over the
  heads) took ~7 ms a tile against ~0.5 ms for a same-shape operation (measured). So
  ``s - m`` is one matmul ``[q, -m] @ [k, 1]^T``, ``dout v^T - delta`` is
  ``[dout, -delta] @ [v, 1]^T``, ``P @ [v, 1]`` gives ``P v`` and the row sum together,
  and the causal bias is built at the tile's full shape. The forward thus computes
  ``q k^T`` twice per tile (once for the maximum, once shifted), cheaper than the
  broadcast it replaces.
- Causal: tiles wholly in the future are skipped; tiles wholly in the past take no mask;
  diagonal-crossing tiles add a host-built (numpy) bias of ``-1e30`` on masked pairs.
  Key tile 0 always holds a key every computed row sees (rows that see no key at all,
  ``i + offset < 0``, are not computed), so the running maximum is finite from the first
  tile and no ``-inf - -inf`` arises; a masked pair's ``exp(-1e30 - m)`` is exactly 0.
- Grouped-query attention without repeating K/V: the queries of the ``group`` heads that
  share a kv head are stacked as rows, ``[batch, kv_heads, seq * group, head_dim]``
  (row ``i * group + g``), so one batched matmul per kv head serves the whole group and
  ``dk``/``dv`` come out summed over it.
- Precision: float32 for float32/bfloat16/float16 inputs (MindSpore CPU MatMul has no
  bfloat16 kernel), float64 end to end for float64 inputs (MatMul, Exp, ReduceMax and
  Log all have float64 CPU kernels). ``q`` is multiplied by ``scale`` once, so
  ``s = (q * scale) k^T`` and ``dk = dS^T (q * scale)``.
- Only operations with CPU kernels (see [Note: MindSpore CPU kernels] in ``ops.py``);
  ``BatchMatMul`` (with ``transpose_a``/``transpose_b`` rather than a transpose) on
  contiguous tiles, several times faster than ``mint.matmul`` here (measured), and
  ``mint.max`` rather than ``mint.amax`` for the row maximum (3x, measured).

[Note: MindSpore CPU attention in one graph]
PyNative dispatches each operation on its own, and the tile code above is about 60 of
them forward and backward, most on small tensors for a short sequence. So a call of plain
tensors that fits one tile (no row before ``first``, ``q_seq <= q_tile``, ``kv_seq <=
k_tile``) and whose score matrix has at most ``ONE_GRAPH_MAX_SCORES`` elements (``batch x
heads x q_seq x kv_seq``) runs as one ``mindspore.jit`` graph each way
(``attention_graph.py``): the same math in the same grouped row layout, ``s - m`` by
broadcasting (about 1 ms a tile inside a graph) and the causal mask as a ``[rows, keys]``
``where``. At the ``small`` job's shapes (``[8, 128, 8, 16]`` queries, 4 kv heads, causal;
medians of alternating runs on the 2-core host) forward + backward took 86 ms as PyNative
operations and 30 ms as the two graphs, and the job's ``--compile`` step went from
1.33-1.38 to 0.93-1.04 of the plain whole-step ``jit`` (``benchmarks/plain_mindspore.py``).
MindSpore keeps each compiled graph (one per shape) with its intermediate buffers, about
14 score-sized ones: +170 MiB resident at those shapes, +1 GiB for one ``[1, 1024, 8, 64]``
call, against transient buffers in PyNative (measured). Hence the cap (16 MiB of float32
scores); above it the operations are large enough that PyNative's per-operation cost is
small beside them (``[1, 4096, 8, 64]``: 2.3 s tile by tile, 1.8-2.0 s with each tile
step a graph, at 2.3 GiB against 0.8 GiB peak RSS).

[Note: Ascend FlashAttentionScore]
``FlashAttentionScore(head_num, scale_value, pre_tokens, next_tokens, inner_precise,
input_layout, sparse_mode)(q, k, v, real_shift, drop_mask, padding_mask, attn_mask, ...)``
returns ``(softmax_max, softmax_sum, softmax_out, attention_out)`` with the statistics
``[B, N, S, 8]`` float32 (8 equal copies); ``lse = softmax_max + log(softmax_sum)``.
``FlashAttentionScoreGrad(...)(q, k, v, dy, pse_shift, drop_mask, padding_mask,
atten_mask, softmax_max, softmax_sum, softmax_in, attention_in, ...)`` returns
``(dq, dk, dv, dpse)``; it is given ``softmax_max = lse`` and ``softmax_sum = 1``, which
are the global statistics (``exp(s - lse) / 1`` is the global softmax), as MindSpeed's
ring attention passes its merged max/sum. Layout BSND (our BSHD), GQA native. Masks:
``sparse_mode`` 0 without a mask; 2 (leftUpCausal) and 3 (rightDownCausal) with the
compressed ``2048 x 2048`` upper-triangular mask (1 = discard) those modes require.
Causal packed documents run as one call in layout TND (``actual_seq_qlen`` /
``actual_seq_kvlen``, ``sparse_mode`` 3, ``packed_documents.tnd_call``; statistics per
[Note: TND softmax statistics]); non-causal documents, which MindSpore's TND does not
take, run as pieces.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.platform.attention_pieces import LSE_FLOOR, plan_pieces, run_backward, run_forward
from hyper_parallel.platform.contract.attention import FULL, AttentionMask
from hyper_parallel.platform.packed_documents import TndCall, packed_rows, tnd_call
from hyper_parallel.platform.contract.validation import check_attention_backward, check_attention_inputs

#: Queries per tile on CPU (rows per kv head are ``Q_TILE * group``); see
#: [Note: MindSpore CPU attention tiles].
Q_TILE = 1024
#: Keys per tile on CPU.
K_TILE = 1024
#: Score elements (``batch x heads x q_seq x kv_seq``) up to which a one-tile call runs as
#: one graph ([Note: MindSpore CPU attention in one graph]): 16 MiB of float32 scores.
ONE_GRAPH_MAX_SCORES = 1 << 22
#: Additive score bias of a masked pair inside a diagonal tile: ``exp(-1e30 - m)`` is 0 in
#: float32 and float64, and it stays finite (no ``inf - inf``).
_MASKED = -1.0e30

#: FlashAttentionScore's dtypes and head sizes (its docstring in mindspore 2.10:
#: "D -- Head size. The value ranges is a multiple of 16, with the max value of 512";
#: "N1 -- Num heads of query. Value range 1 to 256").
_ASCEND_DTYPES = ("float16", "bfloat16")
_ASCEND_MAX_HEAD_DIM = 512
_ASCEND_MAX_HEADS = 256
#: Edge of the compressed causal mask of sparse modes 2 and 3.
_ASCEND_MASK_EDGE = 2048
#: ``pre_tokens``/``next_tokens`` meaning "unbounded" (the forward's default; the grad's
#: default is 65536, which would cut sparse mode 0 at 64k tokens, so it is passed).
_ASCEND_ALL_TOKENS = 2147483647
#: softmax_max handed to the Ascend grad for a row that sees no key: ``exp(s - 1e30)`` is
#: 0 for every score, so the row's gradients vanish; finite, as the kernel's handling of
#: ``inf`` is not documented.
_ASCEND_NO_KEY_MAX = 1.0e30


# -- validation ---------------------------------------------------------------------------


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in x.shape)


def check_inputs(p: Any, q: Any, k: Any, v: Any, mask: AttentionMask) -> None:
    """Raise unless ``q``/``k``/``v``/``mask`` fit ``Platform.attention``
    (``validation.check_attention_inputs``); before any compute."""
    names = [p._dtype_name(x.dtype) for x in (q, k, v)]
    kernel = "FlashAttentionScore" if p.device_type == "ascend" else "the tiled CPU kernel"
    supported = _ASCEND_DTYPES if p.device_type == "ascend" else ("float64", "float32", "bfloat16", "float16")
    check_attention_inputs(q, k, v, mask, names, supported, backend=p.name, kernel=kernel)


def _scale(q: Any, scale: float | None) -> float:
    return float(q.shape[3]) ** -0.5 if scale is None else float(scale)


# -- CPU: tiled FlashAttention-2 ------------------------------------------------------------


def _offset(causal: str, q_seq: int, kv_seq: int) -> int | None:
    """Query ``i`` sees key ``j`` iff ``j <= i + offset``; ``None`` when every pair is allowed."""
    if causal == "none":
        return None
    return 0 if causal == "top_left" else kv_seq - q_seq


def _plan_tiles(q_seq: int, kv_seq: int, offset: int | None, q_tile: int,
                k_tile: int) -> tuple[int, list[tuple[int, int, list[tuple[int, bool]]]]]:
    """``(first_row, [(q_start, q_len, [(key tile index, needs mask), ...]), ...])``.

    Rows before ``first_row`` see no key (``i + offset < 0``) and are not computed. Key
    tiles are the fixed grid ``[t * k_tile, (t + 1) * k_tile)``; a tile wholly in the
    future of a query tile is left out, one wholly in its past needs no mask."""
    first = 0 if offset is None else min(max(0, -offset), q_seq)
    if kv_seq == 0:
        first = q_seq
    tiles = []
    for i0 in range(first, q_seq, q_tile):
        i1 = min(i0 + q_tile, q_seq)
        keys = []
        for t, j0 in enumerate(range(0, kv_seq, k_tile)):
            j1 = min(j0 + k_tile, kv_seq)
            if offset is not None and j0 > i1 - 1 + offset:
                break  # this tile and every later one are in the future of every row
            keys.append((t, offset is not None and j1 - 1 > i0 + offset))
        tiles.append((i0, i1 - i0, keys))
    return first, tiles


class _CpuTiles:
    """One call's tensors cut into tiles, in the grouped row layout of
    [Note: MindSpore CPU attention tiles]; ``compute`` is float32 or float64.

    Every tile tensor is made contiguous once: BatchMatMul on a strided view was 3x
    slower (measured)."""

    def __init__(self, p: Any, q: Any, k: Any, v: Any, scale: float, offset: int | None, q_tile: int,
                 k_tile: int) -> None:
        ms = p._ms
        self.ms, self.mint, self.ops = ms, p._mint, p._ops
        self.batch, self.q_seq, self.heads, self.dim = _shape(q)
        self.kv_seq, self.kv_heads = int(k.shape[1]), int(k.shape[2])
        self.group = self.heads // self.kv_heads
        self.compute = ms.float64 if q.dtype == ms.float64 else ms.float32
        self.offset, self.q_tile, self.k_tile = offset, q_tile, k_tile
        self.first, self.tiles = _plan_tiles(self.q_seq, self.kv_seq, offset, q_tile, k_tile)
        self.matmul = self.ops.BatchMatMul()  # a @ b; 4x faster than mint.matmul here (measured)
        self.matmul_t = self.ops.BatchMatMul(transpose_b=True)  # a @ b^T
        self.t_matmul = self.ops.BatchMatMul(transpose_a=True)  # a^T @ b
        self._bias: dict[tuple[int, int, int], Any] = {}
        if not self.tiles:
            return
        # A Python float multiplies as a float32 scalar (1e-8 off in float64), so scale is a
        # 0-d tensor of the compute dtype.
        self.scale = ms.Tensor(scale, dtype=self.compute)
        self.q = self.rows(q) * self.scale  # [B, Hkv, Sq * group, D], pre-scaled
        sizes = [min(k_tile, self.kv_seq - j0) for j0 in range(0, self.kv_seq, k_tile)]
        k_rows, v_rows = self.kv_rows(k), self.kv_rows(v)  # [B, Hkv, Sk, D]
        self.k = [t.contiguous() for t in self.mint.split(k_rows, sizes, 2)]
        self.v = [t.contiguous() for t in self.mint.split(v_rows, sizes, 2)]
        # K and V with a column of ones, [B, Hkv, Sk, D + 1]: [q, -m] @ [k, 1]^T is s - m and
        # P @ [v, 1] is (P v, rowsum P) in one matmul. Broadcasting a [rows, 1] statistic
        # over a [rows, keys] tile was the slowest operation here (~7 ms a tile against
        # ~1 ms for a same-shape one, measured), so no score-sized operation broadcasts.
        self.k1 = [self.with_column(t, 1.0) for t in self.k]
        self.v1 = [self.with_column(t, 1.0) for t in self.v]

    def with_column(self, x: Any, column: Any) -> Any:
        """``[..., D]`` -> ``[..., D + 1]``, the last column ``column`` (a float or a
        ``[..., 1]`` tensor)."""
        if isinstance(column, float):
            column = self.ops.full(_shape(x)[:-1] + (1,), column, dtype=self.compute)
        return self.mint.cat([x, column], -1)

    def rows(self, x: Any) -> Any:
        """``[B, S, H, D]`` -> ``[B, Hkv, S * group, D]`` in the compute dtype (row ``i * group + g``)."""
        b, s, _, d = _shape(x)
        x = x.astype(self.compute) if x.dtype != self.compute else x
        return x.reshape(b, s, self.kv_heads, self.group, d).permute(0, 2, 1, 3, 4).reshape(
            b, self.kv_heads, s * self.group, d)

    def unrows(self, x: Any, dtype: Any) -> Any:
        """Inverse of ``rows``: ``[B, Hkv, S * group, D]`` -> ``[B, S, H, D]`` in ``dtype``."""
        b, _, r, d = _shape(x)
        s = r // self.group
        x = x.reshape(b, self.kv_heads, s, self.group, d).permute(0, 2, 1, 3, 4).reshape(b, s, self.heads, d)
        return x.astype(dtype) if x.dtype != dtype else x

    def kv_rows(self, x: Any) -> Any:
        """``[B, Sk, Hkv, D]`` -> ``[B, Hkv, Sk, D]`` in the compute dtype."""
        x = x.astype(self.compute) if x.dtype != self.compute else x
        return x.permute(0, 2, 1, 3)

    def lse_rows(self, lse: Any) -> Any:
        """``[B, H, Sq]`` -> ``[B, Hkv, Sq * group, 1]``."""
        b = self.batch
        lse = lse.astype(self.compute) if lse.dtype != self.compute else lse
        return lse.reshape(b, self.kv_heads, self.group, self.q_seq).permute(0, 1, 3, 2).reshape(
            b, self.kv_heads, self.q_seq * self.group, 1)

    def lse_unrows(self, x: Any) -> Any:
        """Inverse of ``lse_rows``."""
        b = self.batch
        return x.reshape(b, self.kv_heads, self.q_seq, self.group).permute(0, 1, 3, 2).reshape(
            b, self.heads, self.q_seq)

    def row_tile(self, x: Any, q_start: int, q_len: int) -> Any:
        """Rows of queries ``q_start .. q_start + q_len`` of a ``rows`` tensor, contiguous."""
        return self.mint.narrow(x, 2, q_start * self.group, q_len * self.group).contiguous()

    def masked(self, s: Any, q_start: int, q_len: int, t: int, masked: bool) -> Any:
        """``s`` (a ``[B, Hkv, q_len * group, k_len]`` tile of scores) with ``-1e30`` added
        on the pairs in the causal future, when the tile crosses the diagonal."""
        if not masked:
            return s
        assert self.offset is not None
        k_len = int(self.k[t].shape[2])
        key = (q_start + self.offset - t * self.k_tile, q_len, k_len)  # the diagonal's place in the tile
        bias = self._bias.get(key)
        if bias is None:
            allowed = np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + key[0]
            host = np.repeat(np.where(allowed, 0.0, _MASKED), self.group, axis=0)
            host = np.broadcast_to(host, _shape(s))  # same shape as s: see k1/v1 on broadcasting
            dtype = np.float64 if self.compute == self.ms.float64 else np.float32
            bias = self.ms.Tensor(np.ascontiguousarray(host, dtype=dtype))
            if len(self._bias) > 4:  # a q tile meets at most two diagonal places; keep a few
                self._bias.clear()
            self._bias[key] = bias
        return s + bias

    def assemble_rows(self, parts: list[Any], width: int, fill: float) -> Any:
        """Row tiles (``[B, Hkv, rows, width]``) after ``first * group`` rows of ``fill``."""
        if self.first:
            lead = self.ops.full((self.batch, self.kv_heads, self.first * self.group, width), fill,
                                 dtype=self.compute)
            parts = [lead] + parts
        return parts[0] if len(parts) == 1 else self.mint.cat(parts, 2)


def _one_graph(p: Any, q: Any, k: Any, tensors: tuple[Any, ...], offset: int | None, q_tile: int,
               k_tile: int) -> bool:
    """Whether the call on ``tensors`` (``q`` and ``k`` among them) runs as one graph
    ([Note: MindSpore CPU attention in one graph]): plain tensors only (a graph sees a
    DTensor's local tensor, while its ``shape`` is the global one, which the operations of
    the tile path dispatch on)."""
    if not all(type(x) is p._ms.Tensor for x in tensors):
        return False
    b, q_seq, heads, _ = _shape(q)
    kv_seq = int(k.shape[1])
    fits = 0 < q_seq <= q_tile and 0 < kv_seq <= k_tile and (offset is None or offset >= 0)
    return fits and b * heads * q_seq * kv_seq <= ONE_GRAPH_MAX_SCORES


def _one_graph_inputs(p: Any, tensors: tuple[Any, ...], q: Any, k: Any, scale: float,
                      offset: int | None) -> tuple[Any, ...]:
    """``tensors`` in the compute dtype, then the causal mask ``[q_seq * group, kv_seq]``
    bool (None when every pair is seen) and ``scale`` as a 0-d tensor of the compute dtype
    (a Python float multiplies as float32, 1e-8 off in float64)."""
    ms = p._ms
    compute = ms.float64 if q.dtype == ms.float64 else ms.float32
    q_seq, heads, kv_seq, kv_heads = int(q.shape[1]), int(q.shape[2]), int(k.shape[1]), int(k.shape[2])
    mask = None
    if offset is not None and kv_seq - 1 > offset:  # some pair lies in the causal future
        allowed = np.arange(kv_seq)[None, :] <= np.arange(q_seq)[:, None] + offset
        mask = ms.Tensor(np.repeat(allowed, heads // kv_heads, axis=0))
    cast = tuple(x.astype(compute) if x.dtype != compute else x for x in tensors)
    return (*cast, mask, ms.Tensor(scale, dtype=compute))


def _cast_like(x: Any, like: Any) -> Any:
    return x.astype(like.dtype) if x.dtype != like.dtype else x


def _cpu_forward(p: Any, q: Any, k: Any, v: Any, scale: float, offset: int | None, q_tile: int,
                 k_tile: int) -> tuple[Any, Any]:
    """Tiled online-softmax forward; see [Note: MindSpore CPU attention tiles]."""
    if _one_graph(p, q, k, (q, k, v), offset, q_tile, k_tile):
        from hyper_parallel.platform.mindspore import attention_graph

        out, lse = attention_graph.forward(*_one_graph_inputs(p, (q, k, v), q, k, scale, offset))
        return _cast_like(out, q), lse
    c = _CpuTiles(p, q, k, v, scale, offset, q_tile, k_tile)
    mint = c.mint
    if not c.tiles:  # no query sees a key (or a side is empty)
        b, sq, h, d = c.batch, c.q_seq, c.heads, c.dim
        return (mint.zeros((b, sq, h, d), dtype=q.dtype),
                c.ops.full((b, h, sq), float("-inf"), dtype=c.compute))
    outs, lses = [], []
    for q_start, q_len, keys in c.tiles:
        q_rows = c.row_tile(c.q, q_start, q_len)
        m = acc = None  # running row maximum [.., rows, 1]; [P v, rowsum P] [.., rows, D + 1]
        for t, masked in keys:
            s = c.masked(c.matmul_t(q_rows, c.k[t]), q_start, q_len, t, masked)
            tile_max = mint.max(s, dim=-1, keepdim=True)[0]  # mint.max: 3x faster than amax (measured)
            m_new = tile_max if m is None else mint.maximum(m, tile_max)
            # s - m_new as one matmul, [q, -m] @ [k, 1]^T, instead of a broadcast subtraction.
            shifted = c.matmul_t(c.with_column(q_rows, -m_new), c.k1[t])
            pv = c.matmul(mint.exp(c.masked(shifted, q_start, q_len, t, masked)), c.v1[t])
            # Key tile 0 is first and every computed row sees one of its keys, so m is finite.
            acc = pv if acc is None else acc * mint.exp(m - m_new) + pv
            m = m_new
        total = mint.narrow(acc, 3, c.dim, 1)
        outs.append(mint.narrow(acc, 3, 0, c.dim) / total)
        lses.append(m + mint.log(total))
    out = c.unrows(c.assemble_rows(outs, c.dim, 0.0), q.dtype)
    lse = c.lse_unrows(c.assemble_rows(lses, 1, float("-inf")))
    return out, lse


def _cpu_backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
                  offset: int | None, q_tile: int, k_tile: int) -> tuple[Any, Any, Any]:
    """Recomputing tiled backward (FlashAttention-2, Algorithm 2); ``out``/``lse`` may be
    those of a larger key set, see [Note: attention kernels]."""
    if _one_graph(p, q, k, (dout, q, k, v, out, lse), offset, q_tile, k_tile):
        from hyper_parallel.platform.mindspore import attention_graph

        grads = attention_graph.backward(*_one_graph_inputs(p, (dout, q, k, v, out, lse), q, k, scale, offset))
        return tuple(_cast_like(g, x) for g, x in zip(grads, (q, k, v)))  # type: ignore[return-value]
    c = _CpuTiles(p, q, k, v, scale, offset, q_tile, k_tile)
    mint = c.mint
    if not c.tiles:
        return (mint.zeros(_shape(q), dtype=q.dtype), mint.zeros(_shape(k), dtype=k.dtype),
                mint.zeros(_shape(v), dtype=v.dtype))
    do = c.rows(dout)
    delta = (do * c.rows(out)).sum(dim=-1, keepdim=True)  # [B, Hkv, Sq * group, 1]
    lse_r = c.lse_rows(lse)
    # A row that sees no key (lse -inf, or floored at -1e30 by a merge) gets lse 1e30:
    # P = exp(s - 1e30) = 0, so its gradients are 0 instead of exp(-inf + inf) = NaN. Finite,
    # because it goes through a matmul below, where inf * 0 in a padded block would be NaN.
    lse_r = mint.where(lse_r <= LSE_FLOOR, -LSE_FLOOR, lse_r)
    # [q * scale, -lse] @ [k, 1]^T = s - lse and [dout, -delta] @ [v, 1]^T = dout v^T - delta:
    # the broadcast subtractions folded into the matmuls (see _CpuTiles).
    q_lse = c.with_column(c.q, -lse_r)
    do_delta = c.with_column(do, -delta)
    dks: list[Any] = [None] * len(c.k)
    dvs: list[Any] = [None] * len(c.k)
    dqs = []
    for q_start, q_len, keys in c.tiles:
        q_rows, q_lse_rows = c.row_tile(c.q, q_start, q_len), c.row_tile(q_lse, q_start, q_len)
        do_rows, do_delta_rows = c.row_tile(do, q_start, q_len), c.row_tile(do_delta, q_start, q_len)
        dq = None
        for t, masked in keys:
            probs = mint.exp(c.masked(c.matmul_t(q_lse_rows, c.k1[t]), q_start, q_len, t, masked))
            dv = c.t_matmul(probs, do_rows)  # P^T dout, summed over the group's rows
            dvs[t] = dv if dvs[t] is None else dvs[t] + dv
            ds = probs * c.matmul_t(do_delta_rows, c.v1[t])  # P * (dout v^T - delta)
            dq_t = c.matmul(ds, c.k[t])
            dq = dq_t if dq is None else dq + dq_t
            dk = c.t_matmul(ds, q_rows)  # dS^T (q * scale)
            dks[t] = dk if dks[t] is None else dks[t] + dk
        dqs.append(dq * c.scale)
    dq = c.unrows(c.assemble_rows(dqs, c.dim, 0.0), q.dtype)

    def keys_back(parts: list[Any], like: Any) -> Any:
        full = [x if x is not None else mint.zeros(_shape(c.k[t]), dtype=c.compute) for t, x in enumerate(parts)]
        x = (full[0] if len(full) == 1 else mint.cat(full, 2)).permute(0, 2, 1, 3)
        return x.astype(like.dtype) if x.dtype != like.dtype else x

    return dq, keys_back(dks, k), keys_back(dvs, v)


def _cpu_attention(p: Any, q: Any, k: Any, v: Any, scale: float, mask: AttentionMask, q_tile: int,
                   k_tile: int) -> tuple[Any, Any]:
    q_seq, kv_seq = int(q.shape[1]), int(k.shape[1])
    if not mask.documents:
        return _cpu_forward(p, q, k, v, scale, _offset(mask.causal, q_seq, kv_seq), q_tile, k_tile)
    groups = plan_pieces(q_seq, kv_seq, mask, any_shape_top_left=True)

    def kernel(q_: Any, k_: Any, v_: Any, causal: bool) -> tuple[Any, Any]:
        return _cpu_forward(p, q_, k_, v_, scale, 0 if causal else None, q_tile, k_tile)

    return run_forward(p, kernel, q, k, v, groups)


def _cpu_attention_backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
                            mask: AttentionMask, q_tile: int, k_tile: int) -> tuple[Any, Any, Any]:
    q_seq, kv_seq = int(q.shape[1]), int(k.shape[1])
    if not mask.documents:
        return _cpu_backward(p, dout, q, k, v, out, lse, scale, _offset(mask.causal, q_seq, kv_seq), q_tile,
                             k_tile)
    groups = plan_pieces(q_seq, kv_seq, mask, any_shape_top_left=True)

    def kernel(do_: Any, q_: Any, k_: Any, v_: Any, o_: Any, lse_: Any, causal: bool) -> tuple[Any, Any, Any]:
        return _cpu_backward(p, do_, q_, k_, v_, o_, lse_, scale, 0 if causal else None, q_tile, k_tile)

    return run_backward(p, kernel, dout, q, k, v, out, lse, groups)


# -- Ascend: FlashAttentionScore --------------------------------------------------------------


def _check_ascend(p: Any, q: Any) -> None:
    """Raise ValueError for the head sizes FlashAttentionScore does not take (its dtypes:
    ``check_inputs``)."""
    heads, dim = int(q.shape[2]), int(q.shape[3])
    if dim % 16 or not 16 <= dim <= _ASCEND_MAX_HEAD_DIM:
        raise ValueError(f"attention: mindspore-ascend runs the FlashAttentionScore kernel, which takes head_dim "
                         f"a multiple of 16 up to {_ASCEND_MAX_HEAD_DIM}; q has head_dim {dim}. Pad head_dim")
    if heads > _ASCEND_MAX_HEADS:
        raise ValueError(f"attention: mindspore-ascend runs the FlashAttentionScore kernel, which takes at most "
                         f"{_ASCEND_MAX_HEADS} query heads; q has {heads}. Split the heads across calls")


def _ascend_mode(p: Any, causal: bool | str) -> tuple[int, Any]:
    """``(sparse_mode, attn_mask)``: 0 and no mask, or 2 (leftUpCausal, ``causal`` True or
    ``"top_left"``) / 3 (rightDownCausal, ``"bottom_right"``) with the compressed mask."""
    if causal in (False, "none"):
        return 0, None
    upper = np.triu(np.ones((_ASCEND_MASK_EDGE, _ASCEND_MASK_EDGE), dtype=np.uint8), 1)  # 1 = discard
    return (3 if causal == "bottom_right" else 2), p._ms.Tensor(upper)


def _ascend_forward(p: Any, q: Any, k: Any, v: Any, scale: float, causal: bool | str) -> tuple[Any, Any]:
    """One FlashAttentionScore call, BSND; ``lse = softmax_max + log(softmax_sum)``."""
    from mindspore.ops.auto_generate.gen_ops_prim import FlashAttentionScore

    mode, attn_mask = _ascend_mode(p, causal)
    kernel = FlashAttentionScore(head_num=int(q.shape[2]), scale_value=scale, pre_tokens=_ASCEND_ALL_TOKENS,
                                 next_tokens=_ASCEND_ALL_TOKENS, input_layout="BSND", sparse_mode=mode)
    softmax_max, softmax_sum, _, out = kernel(q, k, v, None, None, None, attn_mask)
    lse = (softmax_max + p._mint.log(softmax_sum))[..., 0]  # [B, N, S, 8] -> [B, N, S], float32
    return out, lse


def _ascend_backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
                     causal: bool | str) -> tuple[Any, Any, Any]:
    """FlashAttentionScoreGrad with ``softmax_max = lse``, ``softmax_sum = 1``; see
    [Note: Ascend FlashAttentionScore]."""
    from mindspore.ops.auto_generate.gen_ops_prim import FlashAttentionScoreGrad

    ms, mint = p._ms, p._mint
    mode, attn_mask = _ascend_mode(p, causal)
    lse = lse.astype(ms.float32)
    lse = mint.where(lse <= LSE_FLOOR, _ASCEND_NO_KEY_MAX, lse)  # rows that see no key: P = 0
    softmax_max = lse.unsqueeze(-1).broadcast_to(_shape(lse) + (8,)).contiguous()
    softmax_sum = mint.ones(_shape(lse) + (8,), dtype=ms.float32)
    kernel = FlashAttentionScoreGrad(head_num=int(q.shape[2]), scale_value=scale, pre_tokens=_ASCEND_ALL_TOKENS,
                                     next_tokens=_ASCEND_ALL_TOKENS, inner_precise=0, input_layout="BSND",
                                     sparse_mode=mode)
    dq, dk, dv, _ = kernel(q, k, v, dout, None, None, None, attn_mask, softmax_max, softmax_sum, None, out)
    return dq, dk, dv


def _ascend_tnd(q: Any, k: Any, mask: AttentionMask) -> TndCall | None:
    """The one TND call for causal packed documents, or None. MindSpore's TND layout takes
    a causal mask only (its docstring: "Attn mask must be a lower trianglar matrix, so
    sparse_mode should be 2 or 3", "Next_tokens is 0"): non-causal documents run as pieces."""
    if mask.causal == "none":
        return None
    b, sq, h, _ = _shape(q)
    return tnd_call(mask, b, sq, int(k.shape[1]), h)


def _ascend_tnd_forward(p: Any, q: Any, k: Any, v: Any, scale: float, call: TndCall) -> tuple[Any, Any]:
    """Causal packed documents in one FlashAttentionScore call, layout TND, ``sparse_mode``
    3 (bottom-right causal per sequence); the statistics read back token-major
    ([Note: TND softmax statistics]). ``(out [B, Sq, N, D], lse [B, N, Sq] float32)``."""
    from mindspore.ops.auto_generate.gen_ops_prim import FlashAttentionScore

    b, sq, h, d = _shape(q)
    _, attn_mask = _ascend_mode(p, "bottom_right")
    kernel = FlashAttentionScore(head_num=h, scale_value=scale, pre_tokens=_ASCEND_ALL_TOKENS, next_tokens=0,
                                 input_layout="TND", sparse_mode=3)
    softmax_max, softmax_sum, _, out = kernel(packed_rows(q), packed_rows(k), packed_rows(v), None, None, None,
                                              attn_mask, None, list(call.actual_seq_qlen),
                                              list(call.actual_seq_kvlen))
    stat = softmax_max.reshape(-1, 8)[:, 0] + p._mint.log(softmax_sum.reshape(-1, 8)[:, 0])
    lse = p._ops.gather(stat, p._ms.Tensor(call.to_tokens), 0).reshape(b, sq, h)
    return out.reshape(b, sq, h, d), p._mint.transpose(lse, 1, 2).contiguous()


def _ascend_tnd_backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
                         call: TndCall) -> tuple[Any, Any, Any]:
    """FlashAttentionScoreGrad of ``_ascend_tnd_forward``'s call with ``softmax_max = lse``,
    ``softmax_sum = 1`` in the kernel's statistics layout."""
    from mindspore.ops.auto_generate.gen_ops_prim import FlashAttentionScoreGrad

    ms = p._ms
    h = _shape(q)[2]
    _, attn_mask = _ascend_mode(p, "bottom_right")
    tokens = p._mint.transpose(lse.astype(ms.float32), 1, 2).reshape(-1)  # [T * N], token-major
    softmax_max = p._ops.gather(tokens, ms.Tensor(call.to_kernel), 0).reshape(-1, h, 1)
    softmax_max = softmax_max.broadcast_to(_shape(softmax_max)[:2] + (8,)).contiguous()
    softmax_sum = p._mint.ones(_shape(softmax_max), dtype=ms.float32)
    kernel = FlashAttentionScoreGrad(head_num=h, scale_value=scale, pre_tokens=_ASCEND_ALL_TOKENS, next_tokens=0,
                                     inner_precise=0, input_layout="TND", sparse_mode=3)
    dq, dk, dv, _ = kernel(packed_rows(q), packed_rows(k), packed_rows(v), packed_rows(dout), None, None, None,
                           attn_mask, softmax_max, softmax_sum, None, packed_rows(out), None,
                           list(call.actual_seq_qlen), list(call.actual_seq_kvlen))
    return dq.reshape(_shape(q)), dk.reshape(_shape(k)), dv.reshape(_shape(v))


def _ascend_groups(q_seq: int, kv_seq: int, mask: AttentionMask) -> list | None:
    """The attention_pieces plan when the kernel cannot take ``mask`` in one call (packed
    documents; bottom-right causal with more queries than keys, whose first rows see no
    key), else None."""
    if mask.documents or (mask.causal == "bottom_right" and q_seq > kv_seq):
        return plan_pieces(q_seq, kv_seq, mask, any_shape_top_left=True)
    return None


def _ascend_attention(p: Any, q: Any, k: Any, v: Any, scale: float, mask: AttentionMask) -> tuple[Any, Any]:
    _check_ascend(p, q)
    if (tnd := _ascend_tnd(q, k, mask)) is not None:
        return _ascend_tnd_forward(p, q, k, v, scale, tnd)
    groups = _ascend_groups(int(q.shape[1]), int(k.shape[1]), mask)
    if groups is None:
        return _ascend_forward(p, q, k, v, scale, mask.causal)
    return run_forward(p, lambda q_, k_, v_, causal: _ascend_forward(p, q_, k_, v_, scale, causal), q, k, v,
                       groups)


def _ascend_attention_backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
                               mask: AttentionMask) -> tuple[Any, Any, Any]:
    _check_ascend(p, q)
    if (tnd := _ascend_tnd(q, k, mask)) is not None:
        return _ascend_tnd_backward(p, dout, q, k, v, out, lse, scale, tnd)
    groups = _ascend_groups(int(q.shape[1]), int(k.shape[1]), mask)
    if groups is None:
        return _ascend_backward(p, dout, q, k, v, out, lse, scale, mask.causal)

    def kernel(do_: Any, q_: Any, k_: Any, v_: Any, o_: Any, lse_: Any, causal: bool) -> tuple[Any, Any, Any]:
        return _ascend_backward(p, do_, q_, k_, v_, o_, lse_, scale, causal)

    return run_backward(p, kernel, dout, q, k, v, out, lse, groups)


# -- entry points -----------------------------------------------------------------------------


def check(p: Any, q: Any, k: Any, v: Any, mask: AttentionMask) -> None:
    """Raise what ``attention`` would raise for these inputs (``Platform.check_attention``)."""
    check_inputs(p, q, k, v, mask)
    if p.device_type == "ascend":
        _check_ascend(p, q)


def attention(p: Any, q: Any, k: Any, v: Any, *, scale: float | None = None, mask: AttentionMask = FULL,
              q_tile: int = Q_TILE, k_tile: int = K_TILE) -> tuple[Any, Any]:
    """``(out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] float32, float64 for float64)``
    on the platform ``p`` (a ``MindSporePlatform``); see ``Platform.attention``.

    CPU: the tiled kernel of [Note: MindSpore CPU attention tiles] (``q_tile``/``k_tile``
    override the tile sizes; tests use small ones). Ascend: FlashAttentionScore.
    Not recorded by autograd (the result is stop_gradient'ed).
    """
    check_inputs(p, q, k, v, mask)
    _check_tiles(q_tile, k_tile)
    scale = _scale(q, scale)
    if p.device_type == "ascend":
        out, lse = _ascend_attention(p, q, k, v, scale, mask)
    else:
        out, lse = _cpu_attention(p, q, k, v, scale, mask, q_tile, k_tile)
    return p._ops.stop_gradient(out), p._ops.stop_gradient(lse)


def attention_backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *,
                       scale: float | None = None, mask: AttentionMask = FULL, q_tile: int = Q_TILE,
                       k_tile: int = K_TILE) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` typed and shaped like ``q``, ``k``, ``v``; see
    ``Platform.attention_backward`` (``out``/``lse`` may cover more keys than ``k``).
    CPU: the recomputing tiled backward; Ascend: FlashAttentionScoreGrad."""
    check_inputs(p, q, k, v, mask)
    check_attention_backward(dout, q, out, lse)
    _check_tiles(q_tile, k_tile)
    scale = _scale(q, scale)
    if p.device_type == "ascend":
        grads = _ascend_attention_backward(p, dout, q, k, v, out, lse, scale, mask)
    else:
        grads = _cpu_attention_backward(p, dout, q, k, v, out, lse, scale, mask, q_tile, k_tile)
    return tuple(p._ops.stop_gradient(g) for g in grads)  # type: ignore[return-value]


def _check_tiles(q_tile: int, k_tile: int) -> None:
    if int(q_tile) < 1 or int(k_tile) < 1:
        raise ValueError(f"attention: q_tile={q_tile}, k_tile={k_tile} must be >= 1 (queries and keys per tile)")
