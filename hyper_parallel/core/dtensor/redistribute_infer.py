"""``RedistributionOperatorInfer``: the collectives that take a tensor from one tensor map to
another on a device matrix, in MindSpore's terms ([Note: tensor maps] in ``layout``).

MindFormers' Muon optimizer asks it for the operators that gather a sharded parameter whole
(``out_tensor_map`` all ``-1``) and runs them itself: one ``all_concat`` becomes an
all-gather over its group, several become point-to-point gathers. The operators, per rank:

- ``("all_concat", (dim, size, group))``: gather the pieces of ``group`` (global ranks, in
  order) and concatenate them along ``dim``;
- ``("all_split", (dim, size, group))``: keep chunk ``group.index(rank)`` of ``size`` along
  ``dim`` (no communication);
- ``("all_to_all", (split_dim, concat_dim, size, group))``: cut along ``split_dim`` into
  ``size`` chunks, send chunk ``j`` to ``group[j]``, concatenate what arrives along
  ``concat_dim`` in group order.

Chunks follow ``placement_types.chunk_bounds`` (uneven sizes included), as
``_infer_slice_area_by_rank`` does. The plan is this project's own (the same moves as
``redistribute.py`` plans on placements): mesh axes leave a dim innermost first and join
it innermost last, an axis that leaves one dim for another moves with one all-to-all
(``use_permute``), and consecutive concatenations of one dim are one operator over their
joint group (a dim split by two axes is gathered by one all-gather of both). Planning is
local arithmetic: no collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.layout import MapEntry, _coordinate, _entry_axes

Op = tuple[str, tuple[Any, ...]]


def _check_map(name: str, tensor_map: Sequence[MapEntry], mesh_ndim: int) -> list[tuple[int, ...]]:
    """Each dim's mesh axes (counted from the first, outermost first)."""
    axes = []
    try:
        for entry in tensor_map:
            axes.append(tuple(_entry_axes(entry, mesh_ndim)))
    except ValueError as e:
        raise ValueError(f"RedistributionOperatorInfer: {name}={list(tensor_map)}: {e}") from None
    used = [a for dim_axes in axes for a in dim_axes]
    if len(used) != len(set(used)):
        raise ValueError(f"RedistributionOperatorInfer: {name}={list(tensor_map)} splits two dims (or one twice) by "
                         "the same mesh axis; each axis splits at most one dim once")
    return axes


class RedistributionOperatorInfer:
    """The operators that move a tensor from ``in_tensor_map`` to ``out_tensor_map``.

    Args:
        dev_mat: the device matrix (mesh shape), e.g. ``[dp, tp]``.
        in_tensor_map, out_tensor_map: one entry per tensor dim: ``-1``, a mesh axis
            counted from the last, or a tuple of them (outermost first).
        use_permute: move an axis between dims with one ``all_to_all`` (else a concat and
            a split).

    Raises:
        ValueError: maps of different lengths, an entry naming no mesh axis, or a mesh axis
            used twice in one map.
    """

    def __init__(self, dev_mat: Sequence[int], in_tensor_map: Sequence[MapEntry],
                 out_tensor_map: Sequence[MapEntry], use_permute: bool = True) -> None:
        self.dev_mat = tuple(int(d) for d in dev_mat)
        if not self.dev_mat or any(d < 1 for d in self.dev_mat):
            raise ValueError(f"RedistributionOperatorInfer: dev_mat={list(dev_mat)} must be positive mesh extents")
        if len(in_tensor_map) != len(out_tensor_map):
            raise ValueError(f"RedistributionOperatorInfer: in_tensor_map={list(in_tensor_map)} and out_tensor_map="
                             f"{list(out_tensor_map)} differ in length; give one entry per tensor dim in both")
        self._in = _check_map("in_tensor_map", in_tensor_map, len(self.dev_mat))
        self._out = _check_map("out_tensor_map", out_tensor_map, len(self.dev_mat))
        self.use_permute = use_permute

    def plan(self) -> list[tuple[str, int, int | None, tuple[int, ...]]]:
        """The moves, rank-independent: ``(kind, dim, other_dim, mesh axes)`` with kind
        ``"concat"`` / ``"split"`` (``other_dim`` None) or ``"all_to_all"`` (split
        ``dim``, concatenate ``other_dim``)."""
        cur = [list(axes) for axes in self._in]
        out = self._out
        moves: list[tuple[str, int, int | None, tuple[int, ...]]] = []

        def keeps(d: int) -> int:
            """How many of dim ``d``'s current axes are a prefix of its target."""
            n = 0
            while n < len(cur[d]) and n < len(out[d]) and cur[d][n] == out[d][n]:
                n += 1
            return n

        def holder(axis: int) -> int | None:
            return next((d for d, axes in enumerate(cur) if axis in axes), None)

        while [tuple(c) for c in cur] != list(out):
            progressed = False
            # joins: the next target axis of a dim whose current axes are its target's prefix
            for d in range(len(cur)):
                if keeps(d) != len(cur[d]) or len(cur[d]) == len(out[d]):
                    continue
                axis = out[d][len(cur[d])]
                src = holder(axis)
                if src is None:
                    moves.append(("split", d, None, (axis,)))
                elif self.use_permute and cur[src][-1] == axis and keeps(src) < len(cur[src]):
                    moves.append(("all_to_all", d, src, (axis,)))
                    cur[src].pop()
                else:
                    continue
                cur[d].append(axis)
                progressed = True
            if progressed:
                continue
            # leaves: the innermost axis of a dim beyond the prefix it keeps
            for d in range(len(cur)):
                if keeps(d) < len(cur[d]):
                    moves.append(("concat", d, None, (cur[d].pop(),)))
                    progressed = True
                    break
            if not progressed:  # unreachable for valid maps: every step shortens the distance
                raise RuntimeError(f"RedistributionOperatorInfer: no move from {cur} to {out}")
        return _merge(moves)

    def infer_ops_list(self, rank: int, rank_list: Sequence[int]) -> list[Op]:
        """The operators rank ``rank`` runs, with global-rank groups.

        Args:
            rank: a global rank in ``rank_list``.
            rank_list: the device matrix's global ranks in row-major order.

        Returns:
            ``[("all_concat" | "all_split", (dim, size, group)) | ("all_to_all",
            (split_dim, concat_dim, size, group)), ...]``; empty when the maps agree.
            Operators over one rank are left out.

        Raises:
            ValueError: ``rank_list`` does not fill the device matrix, or ``rank`` is not in it.
        """
        ranks = [int(r) for r in rank_list]
        if len(ranks) != math.prod(self.dev_mat):
            raise ValueError(f"RedistributionOperatorInfer.infer_ops_list: rank_list has {len(ranks)} ranks but "
                             f"dev_mat={list(self.dev_mat)} has {math.prod(self.dev_mat)}")
        if int(rank) not in ranks:
            raise ValueError(f"RedistributionOperatorInfer.infer_ops_list: rank {rank} is not in rank_list {ranks}")
        coordinate = _coordinate(self.dev_mat, ranks.index(int(rank)))
        ops: list[Op] = []
        for kind, dim, other, axes in self.plan():
            size = math.prod(self.dev_mat[a] for a in axes)
            if size == 1:
                continue
            group = _group(self.dev_mat, ranks, coordinate, axes)
            if kind == "all_to_all":
                ops.append(("all_to_all", (dim, other, size, group)))
            else:
                ops.append((f"all_{kind}", (dim, size, group)))
        return ops

    # MindSpore's spelling of the same method
    InferOpsList = infer_ops_list


def _merge(moves: list[tuple[str, int, int | None, tuple[int, ...]]]) -> list[tuple[str, int, int | None,
                                                                                         tuple[int, ...]]]:
    """Consecutive concats of one dim (innermost axis first) as one concat over their axes,
    outermost first: the pieces of the joint group in order are the dim's. (Splits stay
    one per axis: with uneven sizes a chunk of a chunk is not a chunk of the product.)"""
    merged: list[tuple[str, int, int | None, tuple[int, ...]]] = []
    for kind, dim, other, axes in moves:
        if merged and kind == "concat" and merged[-1][0] == kind and merged[-1][1] == dim:
            merged[-1] = (kind, dim, None, axes + merged[-1][3])
            continue
        merged.append((kind, dim, other, axes))
    return merged


def _group(dev_mat: Sequence[int], ranks: Sequence[int], coordinate: Sequence[int], axes: Sequence[int]) -> list[int]:
    """The global ranks that differ from ``coordinate`` only on ``axes``, row-major over
    ``axes`` in the order given (outermost first)."""
    group = []
    for index in range(math.prod(dev_mat[a] for a in axes)):
        point = list(coordinate)
        for a in reversed(axes):
            point[a] = index % dev_mat[a]
            index //= dev_mat[a]
        flat = 0
        for extent, c in zip(dev_mat, point):
            flat = flat * extent + c
        group.append(ranks[flat])
    return group
