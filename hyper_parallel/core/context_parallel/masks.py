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
Positions come in runs of consecutive values (one run per chunk). Each query run, holding
positions ``[a, b)``, is planned against the key runs it can see (``plan_block``), as
calls with a structural ``AttentionMask`` (never a dense mask):

- keys entirely before ``a`` form one call without a causal mask;
- keys from ``a`` on are top-left causal from their first position;
- when those two are one contiguous stretch of positions ending at ``b`` (the usual
  case: a chunk against everything before it and itself), they are one bottom-right
  causal call instead;
- key runs in the query run's future are left out, which is where load balancing saves
  work (the causal upper triangle is skipped, not computed and masked);
- documents become the call's ``cu_seqlens_q`` / ``cu_seqlens_kv``, with the causal form
  aligned per document (a document's query and key pieces start, or end, at the same
  position in each form above).

The calls of one run are merged by log-sum-exp ([Note: log-sum-exp merge]).

[Note: coalesced calls]
Load balancing gives a rank two runs (the head and the tail chunk), and planning each run
on its own makes more, smaller kernel calls than the work needs: a fused kernel's time
per call and its parallelism over rows (threads on CPU, thread blocks on a GPU) are
better spent on one larger call (torch's ring attention makes one call per step). Two
rules join calls across runs (``_coalesce``), never with documents:

- a rank's queries against the same positions, sorted (the ring's first step, where each
  rank attends to its own block): query row ``i`` sees key ``j`` exactly when
  ``j <= i``, so the whole block is one top-left causal call, whatever its runs;
- consecutive runs whose only call is an unmasked one over the same key runs become one
  call over all their rows.

A joined call belongs to the first run it covers and spans the rows of the next ones,
which keep no call of their own; ``blocks.forward_calls`` hands each run its rows of the
result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.platform import AttentionMask, get_platform


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


@dataclass(frozen=True)
class BlockCall:
    """One ``platform.attention`` call: query rows ``q_start .. q_start + q_len`` (of the
    q tensor) against the key runs ``k_runs`` (``(start, length)`` into the key tensor,
    concatenated in order) under a structural ``mask``."""

    q_start: int
    q_len: int
    k_runs: tuple[tuple[int, int], ...]
    mask: AttentionMask


@dataclass(frozen=True)
class RunPlan:
    """The calls of one query run (rows ``start .. start + length``), merged by
    log-sum-exp; no calls when the run sees no key, or when a call of an earlier run
    spans its rows too ([Note: coalesced calls])."""

    start: int
    length: int
    calls: tuple[BlockCall, ...]


def _documents(q_pos: np.ndarray, k_pos: np.ndarray, docs: np.ndarray | None) -> tuple[tuple[int, ...] | None, ...]:
    """``(cu_seqlens_q, cu_seqlens_kv)`` of sorted positions, or ``(None, None)`` when
    every position lies in one document."""
    if docs is None:
        return None, None
    dq, dk = docs[q_pos], docs[k_pos]
    ids = np.union1d(dq, dk)
    if len(ids) == 1:
        return None, None
    count_q = np.searchsorted(dq, ids, side="right")
    count_k = np.searchsorted(dk, ids, side="right")
    return (0, *(int(c) for c in count_q)), (0, *(int(c) for c in count_k))


def _call(q_start: int, q_len: int, runs: list[tuple[int, int, int]], k_pos: np.ndarray, q_first: int,
          causal: str, docs: np.ndarray | None) -> BlockCall:
    """A call of query rows ``q_start ..`` (first position ``q_first``) against ``runs``
    (``(start in the key tensor, length, first position)``, sorted by position)."""
    qp = np.arange(q_first, q_first + q_len)
    kp = np.concatenate([k_pos[s:s + n] for s, n, _ in runs])
    cu_q, cu_k = _documents(qp, kp, docs)
    return BlockCall(q_start, q_len, _adjacent_joined([(s, n) for s, n, _ in runs]), AttentionMask(causal, cu_q, cu_k))


def _adjacent_joined(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Key runs (in the order the call concatenates them) with runs that follow each other
    in the key tensor joined: the same keys in the same order, read as one slice instead of
    concatenated (a load-balanced block's head and tail chunk against a query in both's
    future are one ``[0, kv_seq)`` read, not a copy of the block)."""
    joined: list[tuple[int, int]] = []
    for start, length in runs:
        if joined and joined[-1][0] + joined[-1][1] == start:
            joined[-1] = (joined[-1][0], joined[-1][1] + length)
        else:
            joined.append((start, length))
    return tuple(joined)


def plan_block(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, docs: np.ndarray | None) -> list[RunPlan]:
    """One ``RunPlan`` per query run of ``q_pos`` against the keys at ``k_pos``; see
    [Note: segments]."""
    plans: list[RunPlan] = []
    for q_start, q_len in segments(q_pos):
        a, b = int(q_pos[q_start]), int(q_pos[q_start]) + q_len  # the run holds positions [a, b)
        past: list[tuple[int, int, int]] = []  # (start in k, length, first position), all before a
        current: list[tuple[int, int, int]] = []  # parts starting at or after a
        for k_start, k_len in segments(k_pos):
            c = int(k_pos[k_start])
            end = min(c + k_len, b) if causal else c + k_len
            if end <= c:
                continue  # the whole key run lies in this query run's future
            if docs is not None and (docs[c] > docs[b - 1] or docs[end - 1] < docs[a]):
                continue  # no document in common
            if not causal or end <= a:
                past.append((k_start, end - c, c))
                continue
            if c < a:
                past.append((k_start, a - c, c))
                k_start, c = k_start + a - c, a
            current.append((k_start, end - c, c))
        past.sort(key=lambda r: r[2])
        current.sort(key=lambda r: r[2])
        calls: list[BlockCall] = []
        contiguous = all(x[2] + x[1] == y[2] for x, y in zip(past + current, (past + current)[1:]))
        if len(current) == 1 and current[0][2] == a and current[0][2] + current[0][1] == b and contiguous:
            # keys [c0, b) for queries [a, b): one bottom-right causal call (square when c0 == a)
            calls.append(_call(q_start, q_len, past + current, k_pos, a, "bottom_right", docs))
        else:
            if past:
                calls.append(_call(q_start, q_len, past, k_pos, a, "none", docs))
            for k_start, k_len, c in current:  # queries from position c on, keys [c, c + k_len): top-left
                calls.append(_call(q_start + c - a, b - c, [(k_start, k_len, c)], k_pos, c, "top_left", docs))
        if docs is not None:
            calls = [call for call in calls if _sees_any(call)]
        plans.append(RunPlan(q_start, q_len, tuple(calls)))
    return _coalesce(plans, q_pos, k_pos, causal, docs)


def _lone_unmasked(run: RunPlan) -> bool:
    """The run's only call covers its rows without a mask."""
    return len(run.calls) == 1 and run.calls[0].mask == AttentionMask() and \
        (run.calls[0].q_start, run.calls[0].q_len) == (run.start, run.length)


def _coalesce(plans: list[RunPlan], q_pos: np.ndarray, k_pos: np.ndarray, causal: bool,
              docs: np.ndarray | None) -> list[RunPlan]:
    """``plans`` with calls joined across runs; see [Note: coalesced calls]."""
    if docs is not None or len(plans) < 2:
        return plans
    n = len(q_pos)
    if causal and len(k_pos) == n and np.array_equal(q_pos, k_pos) and bool(np.all(np.diff(q_pos) > 0)):
        whole = BlockCall(0, n, ((0, n),), AttentionMask("top_left"))
        return [RunPlan(plans[0].start, plans[0].length, (whole,))] + [RunPlan(r.start, r.length, ())
                                                                        for r in plans[1:]]
    joined: list[RunPlan] = []
    i = 0
    while i < len(plans):
        run, j = plans[i], i + 1
        if _lone_unmasked(run):
            keys = run.calls[0].k_runs
            while j < len(plans) and _lone_unmasked(plans[j]) and plans[j].calls[0].k_runs == keys:
                j += 1
        if j - i == 1:
            joined.append(run)
        else:
            rows = sum(r.length for r in plans[i:j])
            joined.append(RunPlan(run.start, run.length, (BlockCall(run.start, rows, run.calls[0].k_runs,
                                                                    AttentionMask()),)))
            joined += [RunPlan(r.start, r.length, ()) for r in plans[i + 1:j]]
        i = j
    return joined


def _sees_any(call: BlockCall) -> bool:
    """False when no query document of ``call`` has keys (documents that only one side
    holds)."""
    cu_q, cu_k = call.mask.cu_seqlens_q, call.mask.cu_seqlens_kv
    if cu_q is None or cu_k is None:
        return True
    return any(cu_q[d + 1] > cu_q[d] and cu_k[d + 1] > cu_k[d] for d in range(len(cu_q) - 1))
