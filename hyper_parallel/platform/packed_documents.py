"""Packed documents in one variable-length kernel call: which mask a call of that kind
takes, the document offsets of every batch row packed one after another, and the layout
of the softmax statistics Ascend's fused attention returns in its ``TND`` layout.
Written once for the kernels that take packed documents natively: FlashAttention-2's
varlen path on CUDA, ``npu_fusion_attention`` on torch-npu and ``FlashAttentionScore``
on mindspore-ascend (see [Note: attention kernels]).

[Note: packed rows]
A call's ``[batch, seq, heads, head_dim]`` tensor is packed as ``[batch * seq, heads,
head_dim]`` (a reshape: batch rows one after another), and the documents of every row
become sequences of one variable-length call: ``batch * docs`` sequences whose offsets
are the row's ``cu_seqlens`` shifted by ``row * seq``. One call per kernel launch,
whatever the number of documents.

[Note: TND softmax statistics]
``npu_fusion_attention`` / ``FlashAttentionScore`` with ``input_layout="TND"`` return
``softmax_max`` / ``softmax_sum`` allocated ``[T, heads, 8]`` float32 (8 equal copies), but
their memory is laid out per sequence and head-major: sequence ``i`` (first token ``c_i``,
``s_i`` tokens) occupies the ``s_i * heads`` rows from ``c_i * heads``, ordered
``[heads, s_i]``. The grad kernel reads them back in that layout. Sources: the CANN
kernel's offset ``(s1SizeAcc * n2G + n2oIdx * gSize * s1Size + goIdx * s1Size + ...) * 8``
(ops-transformer ``flash_attention_score_s1s2_bn2gs1.h``, ``s1SizeAcc`` the sequence's
first token, ``s1Size`` its length) and MindSpeed's ``flatten_softmax`` (ring attention
``utils.py``), which views each sequence's block as ``[heads, s_i, 8]``. The contract's
log-sum-exp is token-major; ``tnd_statistics_order`` gives the permutation both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.platform.contract.attention import AttentionMask

#: Most sequences one TND call takes: MindSpore's FlashAttentionScore docstring ("size of
#: list is batch. batch is less than or equal to 1024"); torch_npu's varlen limit is 1K too.
TND_MAX_SEQUENCES = 1024


def document_lengths(mask: AttentionMask) -> list[tuple[int, int]]:
    """``(q_len, kv_len)`` of each document of ``mask`` (which has documents)."""
    cq, ck = mask.cu_seqlens_q, mask.cu_seqlens_kv
    assert cq is not None and ck is not None
    return [(b - a, d - c) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]


def one_call_takes(mask: AttentionMask) -> bool:
    """True when ``mask``'s packed documents run as one variable-length call whose causal
    form is bottom-right per document (flash's and ``sparse_mode`` 3's): every document
    has queries and keys, and per document bottom-right causal has at least as many keys as
    queries, top-left causal exactly as many (where the two alignments agree). Otherwise
    some query sees no key, or the kernels' alignment differs: the call runs as pieces."""
    if not mask.documents:
        return False
    lengths = document_lengths(mask)
    if any(lq == 0 or lk == 0 for lq, lk in lengths):
        return False
    if mask.causal == "bottom_right":
        return all(lk >= lq for lq, lk in lengths)
    if mask.causal == "top_left":
        return all(lk == lq for lq, lk in lengths)
    return True


def packed_rows(x: Any) -> Any:
    """``[batch, seq, heads, dim]`` -> ``[batch * seq, heads, dim]``, batch rows one after
    another ([Note: packed rows]; a view where the framework can make one). Any framework
    tensor with ``shape`` and ``reshape``."""
    b, s, h, d = (int(n) for n in x.shape)
    return x.reshape(b * s, h, d)


def row_offsets(cu: tuple[int, ...], batch: int, seq: int) -> np.ndarray:
    """The document offsets of ``batch`` rows of ``seq`` tokens packed one after another
    ([Note: packed rows]): ``[batch * docs + 1]`` int64 from 0 to ``batch * seq``."""
    base = np.asarray(cu[:-1], dtype=np.int64)
    rows = (base[None, :] + seq * np.arange(batch, dtype=np.int64)[:, None]).reshape(-1)
    return np.concatenate([rows, [batch * seq]]).astype(np.int64)


@dataclass(frozen=True)
class TndCall:
    """The arguments of one TND call of Ascend's fused attention for packed documents.

    ``actual_seq_qlen`` / ``actual_seq_kvlen``: the cumulative end offsets of the sequences
    (no leading 0, last = total tokens), as both kernels take them. ``to_tokens``: int64
    ``[T * heads]``, element ``t * heads + n`` is where token ``t``'s head ``n`` sits in the
    kernel's statistics ([Note: TND softmax statistics]); ``to_kernel`` the inverse
    permutation (kernel position -> token-major position). Both gather."""

    actual_seq_qlen: tuple[int, ...]
    actual_seq_kvlen: tuple[int, ...]
    to_tokens: np.ndarray
    to_kernel: np.ndarray


def tnd_call(mask: AttentionMask, batch: int, q_seq: int, kv_seq: int, heads: int) -> TndCall | None:
    """The TND call for ``mask``'s documents over ``batch`` rows, or None when it must run
    as pieces (``one_call_takes`` fails, or more than ``TND_MAX_SEQUENCES`` sequences)."""
    if not one_call_takes(mask):
        return None
    assert mask.cu_seqlens_q is not None and mask.cu_seqlens_kv is not None
    ends_q = row_offsets(mask.cu_seqlens_q, batch, q_seq)
    ends_k = row_offsets(mask.cu_seqlens_kv, batch, kv_seq)
    if len(ends_q) - 1 > TND_MAX_SEQUENCES:
        return None
    to_tokens = tnd_statistics_order(ends_q, heads)
    to_kernel = np.empty_like(to_tokens)
    to_kernel[to_tokens] = np.arange(len(to_tokens), dtype=np.int64)
    return TndCall(tuple(int(x) for x in ends_q[1:]), tuple(int(x) for x in ends_k[1:]), to_tokens, to_kernel)


def tnd_statistics_order(offsets: np.ndarray, heads: int) -> np.ndarray:
    """For sequences at ``offsets`` (``[sequences + 1]``, from 0 to ``T``), int64 ``[T * heads]``:
    element ``t * heads + n`` is the row of the kernel's per-sequence head-major statistics
    holding token ``t``, head ``n`` ([Note: TND softmax statistics])."""
    starts, lengths = offsets[:-1], np.diff(offsets)
    seq_of = np.repeat(np.arange(len(lengths)), lengths)  # [T]
    t = np.arange(int(offsets[-1]), dtype=np.int64)
    start, length = starts[seq_of], lengths[seq_of]
    n = np.arange(heads, dtype=np.int64)
    return (start[:, None] * heads + n[None, :] * length[:, None] + (t - start)[:, None]).reshape(-1)
