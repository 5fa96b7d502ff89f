"""Attention under any ``AttentionMask`` from a kernel that takes only two forms: every
key, or top-left causal. Written once, against the contract, for every backend whose
kernel lacks a mask form natively (see [Note: attention kernels]).

[Note: attention pieces]
A mask form is cut into *pieces*, each a block of consecutive queries against a block
of consecutive keys that the kernel takes as it is: all pairs allowed, or top-left causal
(``j <= i``; square unless the kernel takes any shape). Pieces of different query rows
are independent; pieces that share query rows are merged by log-sum-exp
([Note: log-sum-exp merge] in ``platform/contract/attention_merge``):

- bottom-right causal with ``kv_seq >= q_seq`` is keys ``[0, kv_seq - q_seq)`` in full
  plus the last ``q_seq`` keys top-left causal (two pieces, merged); with
  ``kv_seq < q_seq`` the first ``q_seq - kv_seq`` queries see nothing and the rest are
  square top-left causal against every key (torch's ring attention splits its
  load-balanced blocks the same way);
- top-left causal with ``kv_seq > q_seq`` never reaches keys past ``q_seq``; with
  ``kv_seq < q_seq`` the queries past ``kv_seq`` see every key;
- packed documents are one such block per document (query document ``d`` against key
  document ``d``); a document with no keys leaves its queries at output 0,
  log-sum-exp ``-inf``.

The backward runs the kernel's backward on every piece with the merged output and
log-sum-exp of its rows: each piece's ``dq`` is its share (summed), each piece's
``dk``/``dv`` its keys' share (summed where pieces share keys). No piece is ever empty
(torch's CPU kernel divides by zero on zero keys), and every query row of a piece sees at
least one of its keys: a row that sees no key is in no piece (its gradients are the zeros
the assembly fills), so the log-sum-exp a kernel's backward reads is finite on every row
it computes and the kernels are called without masking ``-inf`` rows. Nothing here holds more than one
piece's kernel workspace: no score matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyper_parallel.platform.contract.attention import AttentionMask
# re-exported: the backends' kernels merge their own pieces with them
from hyper_parallel.platform.contract.attention_merge import LSE_FLOOR, floor_lse, merge, stat_dtype

__all__ = ["LSE_FLOOR", "Group", "Piece", "floor_lse", "is_whole", "merge", "plan_pieces", "run_backward", "run_forward",
           "stat_dtype", "sum_by_range"]


#: ``kernel(q, k, v, causal) -> (out, lse)`` on BSHD pieces; ``causal`` is top-left.
ForwardKernel = Callable[[Any, Any, Any, bool], tuple[Any, Any]]
#: ``kernel(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)``.
BackwardKernel = Callable[[Any, Any, Any, Any, Any, Any, bool], tuple[Any, Any, Any]]


@dataclass(frozen=True)
class Piece:
    """Keys ``k_start .. k_start + k_len`` for the query rows of its ``Group``; ``causal``
    is top-left causal relative to the group's first row and ``k_start``."""

    k_start: int
    k_len: int
    causal: bool


@dataclass(frozen=True)
class Group:
    """Query rows ``q_start .. q_start + q_len`` and the pieces they attend to (merged)."""

    q_start: int
    q_len: int
    pieces: tuple[Piece, ...]


def _segment(q0: int, lq: int, k0: int, lk: int, causal: str, any_shape_top_left: bool) -> list[Group]:
    """The groups of one (query block, key block) pair under ``causal``."""
    if lq == 0 or lk == 0:
        return []
    if causal == "none":
        return [Group(q0, lq, (Piece(k0, lk, False),))]
    if causal == "bottom_right" and lk >= lq:
        head = (Piece(k0, lk - lq, False),) if lk > lq else ()
        return [Group(q0, lq, head + (Piece(k0 + lk - lq, lq, True),))]
    if causal == "bottom_right":  # lk < lq: the first lq - lk queries see no key
        return [Group(q0 + lq - lk, lk, (Piece(k0, lk, True),))]
    if any_shape_top_left or lq == lk:
        return [Group(q0, lq, (Piece(k0, lk, True),))]
    if lk > lq:  # top-left: keys past lq are in every query's future
        return [Group(q0, lq, (Piece(k0, lq, True),))]
    return [Group(q0, lk, (Piece(k0, lk, True),)), Group(q0 + lk, lq - lk, (Piece(k0, lk, False),))]


def plan_pieces(q_seq: int, kv_seq: int, mask: AttentionMask, *, any_shape_top_left: bool = False) -> list[Group]:
    """The groups of [Note: attention pieces], sorted by ``q_start``, disjoint in rows.

    Args:
        q_seq, kv_seq: the call's query and key lengths.
        mask: the call's mask (checked against the lengths).
        any_shape_top_left: the kernel's causal mode is top-left for any
            ``q_seq``/``kv_seq`` (torch's CPU kernel); otherwise causal pieces are square.

    Raises:
        ValueError: the mask's document lists do not end at ``q_seq`` / ``kv_seq``.
    """
    mask.check(q_seq, kv_seq)
    if mask.cu_seqlens_q is None or mask.cu_seqlens_kv is None:
        return _segment(0, q_seq, 0, kv_seq, mask.causal, any_shape_top_left)
    groups: list[Group] = []
    cq, ck = mask.cu_seqlens_q, mask.cu_seqlens_kv
    for d in range(len(cq) - 1):
        groups += _segment(cq[d], cq[d + 1] - cq[d], ck[d], ck[d + 1] - ck[d], mask.causal, any_shape_top_left)
    return groups


def is_whole(groups: list[Group], q_seq: int, kv_seq: int) -> bool:
    """True when the plan is a single kernel call on the unsliced tensors."""
    return (len(groups) == 1 and len(groups[0].pieces) == 1 and groups[0].q_len == q_seq
            and groups[0].pieces[0].k_len == kv_seq)


def _assemble(p: Any, parts: list[tuple[int, Any]], length: int, dim: int, like: tuple[int, ...], dtype: Any,
              fill: float) -> Any:
    """Tensors placed at their start along ``dim`` of a ``like``-shaped tensor of
    ``length`` there, gaps filled with ``fill``; ``parts`` sorted and disjoint."""
    pieces, at = [], 0
    for start, part in parts:
        if start > at:
            pieces.append(p.full(like[:dim] + (start - at,) + like[dim + 1:], fill, dtype))
        pieces.append(part)
        at = start + int(part.shape[dim])
    if at < length:
        pieces.append(p.full(like[:dim] + (length - at,) + like[dim + 1:], fill, dtype))
    return pieces[0] if len(pieces) == 1 else p.cat(pieces, dim)


def run_forward(p: Any, kernel: ForwardKernel, q: Any, k: Any, v: Any, groups: list[Group]) -> tuple[Any, Any]:
    """``(out, lse)`` of the planned groups; see ``Platform.attention`` for shapes."""
    b, sq, h, d = (int(n) for n in q.shape)
    if is_whole(groups, sq, int(k.shape[1])):
        return kernel(q, k, v, groups[0].pieces[0].causal)
    outs, lses = [], []
    lse_dtype = stat_dtype(p, q.dtype)
    for group in groups:
        q_part = p.narrow(q, 1, group.q_start, group.q_len)
        acc = None
        for piece in group.pieces:
            result = kernel(q_part, p.narrow(k, 1, piece.k_start, piece.k_len),
                            p.narrow(v, 1, piece.k_start, piece.k_len), piece.causal)
            acc = result if len(group.pieces) == 1 else merge(p, acc, result)
        assert acc is not None
        outs.append((group.q_start, p.to_dtype(acc[0], q.dtype)))
        lses.append((group.q_start, p.to_dtype(acc[1], lse_dtype)))
    out = _assemble(p, outs, sq, 1, (b, sq, h, d), q.dtype, 0.0)
    lse = _assemble(p, lses, sq, 2, (b, h, sq), lse_dtype, float("-inf"))
    return out, lse


def sum_by_range(p: Any, parts: dict[tuple[int, int], Any], length: int, like: tuple[int, ...], dtype: Any) -> Any:
    """Tensors of ranges along dim 1 (``(start, length) -> [batch, length, ...]``) summed
    into one ``like``-shaped tensor of ``length`` there (zeros where no range lies): one
    concatenation when the ranges are disjoint, padded sums where they overlap."""
    ranges = sorted(parts)
    if all(a[0] + a[1] <= b[0] for a, b in zip(ranges, ranges[1:])):
        return _assemble(p, [(r[0], p.to_dtype(parts[r], dtype)) for r in ranges], length, 1, like, dtype, 0.0)
    total = None
    for (start, n), part in sorted(parts.items()):
        padded = p.pad(p.to_dtype(part, dtype), 1, start, length - start - n)
        total = padded if total is None else total + padded
    return total


def run_backward(p: Any, kernel: BackwardKernel, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                 groups: list[Group]) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of the planned groups; see ``Platform.attention_backward``."""
    b, sq, h, d = (int(n) for n in q.shape)
    sk, kh = int(k.shape[1]), int(k.shape[2])
    if is_whole(groups, sq, sk):
        return kernel(dout, q, k, v, out, lse, groups[0].pieces[0].causal)
    acc_dtype = stat_dtype(p, q.dtype)
    dqs: list[tuple[int, Any]] = []
    dks: dict[tuple[int, int], Any] = {}
    dvs: dict[tuple[int, int], Any] = {}
    for group in groups:
        rows = (group.q_start, group.q_len)
        q_part, do_part, o_part = (p.narrow(x, 1, *rows) for x in (q, dout, out))
        lse_part = p.narrow(lse, 2, *rows)
        dq_group = None
        for piece in group.pieces:
            keys = (piece.k_start, piece.k_len)
            dq, dk, dv = kernel(do_part, q_part, p.narrow(k, 1, *keys), p.narrow(v, 1, *keys), o_part, lse_part,
                                piece.causal)
            dq = p.to_dtype(dq, acc_dtype)
            dq_group = dq if dq_group is None else dq_group + dq
            dk, dv = p.to_dtype(dk, acc_dtype), p.to_dtype(dv, acc_dtype)
            dks[keys] = dk if keys not in dks else dks[keys] + dk
            dvs[keys] = dv if keys not in dvs else dvs[keys] + dv
        dqs.append((group.q_start, p.to_dtype(dq_group, q.dtype)))
    dq = _assemble(p, dqs, sq, 1, (b, sq, h, d), q.dtype, 0.0)
    like = (b, sk, kh, d)
    return dq, sum_by_range(p, dks, sk, like, k.dtype), sum_by_range(p, dvs, sk, like, v.dtype)
