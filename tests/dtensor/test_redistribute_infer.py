"""``RedistributionOperatorInfer`` (MindSpore's tensor-map planner, which MindFormers' Muon
optimizer runs to gather parameters whole): its operators, executed on every rank's piece
of a numpy tensor in lockstep, turn the pieces of ``in_tensor_map`` into exactly those of
``out_tensor_map`` (``_infer_slice_area_by_rank``), for random device matrices, tensor maps
(several axes on one dim included), uneven sizes and shuffled rank lists; the shapes Muon
relies on; and what is refused. Pure planning: no collective, framework-free.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.dtensor.layout import _infer_slice_area_by_rank
from hyper_parallel.core.dtensor.placement_types import chunk_bounds
from hyper_parallel.core.dtensor.redistribute_infer import RedistributionOperatorInfer


def _piece(full: np.ndarray, dev_mat, tensor_map, index: int) -> np.ndarray:
    return full[tuple(slice(b, e) for b, e in _infer_slice_area_by_rank(dev_mat, tensor_map, index, full.shape))]


def _chunk(x: np.ndarray, dim: int, size: int, index: int) -> np.ndarray:
    start, length = chunk_bounds(x.shape[dim], size, index)
    return np.take(x, range(start, start + length), axis=dim)


def run_ops(full: np.ndarray, dev_mat, in_map, out_map, rank_list) -> dict[int, np.ndarray]:
    """Every rank's piece after running its operators, all ranks in lockstep."""
    pieces = {r: _piece(full, dev_mat, in_map, i) for i, r in enumerate(rank_list)}
    infer = RedistributionOperatorInfer(dev_mat, in_map, out_map)
    ops = {r: infer.infer_ops_list(r, rank_list) for r in rank_list}
    counts = {len(o) for o in ops.values()}
    assert len(counts) == 1, ops  # every rank runs the same sequence of operators
    for step in range(counts.pop()):
        new = {}
        for r in rank_list:
            kind, args = ops[r][step]
            group = args[-1]
            assert r in group and all(ops[g][step][0] == kind and ops[g][step][1][-1] == group for g in group)
            if kind == "all_concat":
                dim, size, _ = args
                assert len(group) == size
                new[r] = np.concatenate([pieces[g] for g in group], axis=dim)
            elif kind == "all_split":
                dim, size, _ = args
                new[r] = _chunk(pieces[r], dim, size, group.index(r))
            else:
                split_dim, concat_dim, size, _ = args
                new[r] = np.concatenate([_chunk(pieces[g], split_dim, size, group.index(r)) for g in group],
                                        axis=concat_dim)
        pieces = new
    return pieces


@st.composite
def cases(draw):
    dev_mat = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))

    def tensor_map():
        owners = [draw(st.integers(-1, len(shape) - 1)) for _ in dev_mat]
        entries = []
        for d in range(len(shape)):
            axes = draw(st.permutations([a for a, o in enumerate(owners) if o == d]))
            values = tuple(len(dev_mat) - 1 - a for a in axes)  # counted from the last axis
            entries.append(-1 if not values else values[0] if len(values) == 1 else values)
        return entries

    ranks = draw(st.permutations([10 + i for i in range(math.prod(dev_mat))]))
    return dev_mat, shape, tensor_map(), tensor_map(), list(ranks)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_operators_turn_pieces_into_the_target_layout(case) -> None:
    dev_mat, shape, in_map, out_map, rank_list = case
    full = np.arange(math.prod(shape)).reshape(shape)
    pieces = run_ops(full, dev_mat, in_map, out_map, rank_list)
    for i, r in enumerate(rank_list):
        np.testing.assert_array_equal(pieces[r], _piece(full, dev_mat, out_map, i),
                                      err_msg=f"rank {r}: {dev_mat} {in_map} -> {out_map}")


def test_muon_full_gather_shapes() -> None:
    """What Muon reads: replicated already -> no operator; one dim split by two axes -> one
    ``all_concat`` over all four ranks (an all-gather); two dims split -> one per dim; an
    axis moving between dims -> one ``all_to_all``."""
    ranks = [4, 5, 6, 7]
    full_map = [-1, -1]
    assert RedistributionOperatorInfer([2, 2], full_map, full_map).infer_ops_list(5, ranks) == []
    assert RedistributionOperatorInfer([2, 2], [(1, 0), -1], full_map).infer_ops_list(6, ranks) == [
        ("all_concat", (0, 4, [4, 5, 6, 7]))]
    assert RedistributionOperatorInfer([2, 2], [1, 0], full_map).infer_ops_list(6, ranks) == [
        ("all_concat", (0, 2, [4, 6])), ("all_concat", (1, 2, [6, 7]))]
    assert RedistributionOperatorInfer([2, 2], [0, -1], [-1, 0]).infer_ops_list(5, ranks) == [
        ("all_to_all", (1, 0, 2, [4, 5]))]
    assert RedistributionOperatorInfer([2, 2], [0, -1], [-1, 0], use_permute=False).infer_ops_list(5, ranks) == [
        ("all_concat", (0, 2, [4, 5])), ("all_split", (1, 2, [4, 5]))]
    assert RedistributionOperatorInfer([2, 2], [0, -1], [0, -1]).InferOpsList(5, ranks) == []


def test_refusals() -> None:
    with pytest.raises(ValueError, match="splits two dims .* by the same mesh axis"):
        RedistributionOperatorInfer([2, 2], [0, 0], [-1, -1])
    with pytest.raises(ValueError, match="differ in length"):
        RedistributionOperatorInfer([2, 2], [0, -1], [-1])
    with pytest.raises(ValueError, match="is not -1 or a mesh axis"):
        RedistributionOperatorInfer([2, 2], [2, -1], [-1, -1])
    infer = RedistributionOperatorInfer([2, 2], [1, 0], [-1, -1])
    with pytest.raises(ValueError, match="rank 9 is not in rank_list"):
        infer.infer_ops_list(9, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="rank_list has 3 ranks but dev_mat"):
        infer.infer_ops_list(0, [0, 1, 2])
