"""Attention masks from global token positions: causal order, packed documents, and the
blocks of a sharded sequence.

Every mode of context parallelism knows which global positions its queries and its
(gathered or rotating) keys hold (see [Note: sequence layout] in ``load_balance``). The
masks here are built from those positions on the host (numpy): a query at position ``i``
may see a key at position ``j`` when ``j <= i`` (causal) and both lie in the same
document (``cu_seqlens``). This one rule is what makes the offsets of a sequence-sharded
query against gathered or rotating keys, the head-tail layout and packed documents
correct in every mode.

[Note: segments]
Positions come in runs of consecutive values (one run per chunk). A query run against the
key runs it can see is one ``platform.attention`` call; key runs it cannot see at all are
left out of the call, which is where load balancing saves work (the causal upper
triangle is skipped, not computed and masked). A call needs no mask when every pair is
allowed and only ``causal=True`` when query and keys are the same run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform


def document_ids(cu_seqlens: Any, seq_len: int, where: str = "scaled_dot_product_attention") -> np.ndarray:
    """The document index of each of ``seq_len`` global positions (int64 ``[seq_len]``).

    Args:
        cu_seqlens: cumulative document lengths ``[0, l0, l0 + l1, ..., seq_len]`` (a
            sequence of ints, a numpy array or a 1-D integer tensor of any backend).
        where: the caller named in the error message.

    Raises:
        ValueError: not starting at 0, not strictly increasing, or not ending at
            ``seq_len``.
    """
    p = get_platform()
    if p.is_tensor(cu_seqlens):
        cu_seqlens = p.to_numpy(cu_seqlens)
    cu = np.asarray(cu_seqlens).reshape(-1)
    if cu.size < 2 or not np.issubdtype(cu.dtype, np.integer) or cu[0] != 0 or cu[-1] != seq_len \
            or np.any(np.diff(cu) <= 0):
        raise ValueError(f"{where}: cu_seqlens={cu.tolist()} must be integers starting at 0, "
                         f"strictly increasing and ending at the full sequence length {seq_len} (cumulative "
                         "document lengths of the packed sequence; with context parallelism, of the whole "
                         "sequence, not of one rank's shard)")
    return np.searchsorted(cu, np.arange(seq_len), side="right").astype(np.int64) - 1


def segments(positions: np.ndarray) -> list[tuple[int, int]]:
    """Runs of consecutive positions as ``(start index, length)``; see [Note: segments]."""
    breaks = np.nonzero(np.diff(positions) != 1)[0] + 1
    starts = np.concatenate([[0], breaks]).astype(int)
    ends = np.concatenate([breaks, [len(positions)]]).astype(int)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def allowed(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, docs: np.ndarray | None) -> np.ndarray | None:
    """Bool ``[len(q_pos), len(k_pos)]``, True where query may see key; ``None`` when
    every pair is allowed."""
    mask = None
    if causal:
        mask = k_pos[None, :] <= q_pos[:, None]
    if docs is not None:
        same = docs[q_pos][:, None] == docs[k_pos][None, :]
        mask = same if mask is None else mask & same
    if mask is not None and mask.all():
        return None
    return mask


@dataclass(frozen=True)
class BlockCall:
    """One ``platform.attention`` call: query rows ``q_start .. q_start + q_len`` against
    the key runs ``k_runs`` (``(start, length)`` into the key tensor, concatenated in
    order), with ``causal`` or a host ``mask`` ``[q_len, sum of run lengths]``."""

    q_start: int
    q_len: int
    k_runs: tuple[tuple[int, int], ...]
    causal: bool
    mask: np.ndarray | None


def plan_block(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, docs: np.ndarray | None) -> list[BlockCall | None]:
    """One entry per query run of ``q_pos``: the call against the keys at ``k_pos``, or
    ``None`` when that run sees none of them; see [Note: segments]."""
    k_segs = segments(k_pos)
    calls: list[BlockCall | None] = []
    for q_start, q_len in segments(q_pos):
        qp = q_pos[q_start:q_start + q_len]
        runs = []
        for k_start, k_len in k_segs:
            kp = k_pos[k_start:k_start + k_len]
            if causal and kp[0] > qp[-1]:
                continue  # the whole key run lies in this query run's future
            if docs is not None and (docs[kp[0]] > docs[qp[-1]] or docs[kp[-1]] < docs[qp[0]]):
                continue  # no document in common
            runs.append((k_start, k_len))
        if not runs:
            calls.append(None)
            continue
        kp = np.concatenate([k_pos[s:s + n] for s, n in runs])
        mask = allowed(qp, kp, causal, docs)
        if mask is not None and not mask.any():
            calls.append(None)
            continue
        is_causal = False
        if mask is not None and mask.shape[0] == mask.shape[1] and np.array_equal(mask, np.tril(np.ones_like(mask))):
            mask, is_causal = None, True
        calls.append(BlockCall(q_start, q_len, tuple(runs), is_causal, mask))
    return calls


def runs_positions(positions: Sequence[np.ndarray]) -> np.ndarray:
    """The concatenation of several ranks' positions, in the order they are gathered."""
    return np.concatenate(list(positions)).astype(np.int64)
