"""Single-process numpy reference for DTensor tests: what each mesh coordinate holds for
given placements, computed from the global tensor with chunk semantics."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from hyper_parallel.core.dtensor import Partial, Placement, Replicate, Shard


def chunk(size: int, num: int, index: int) -> tuple[int, int]:
    """torch.chunk bounds, written again on purpose: the reference must not share the
    implementation it checks (``placement_types.chunk_bounds``)."""
    step = -(-size // num)
    start = min(index * step, size)
    return start, min(step, size - start)


def _term(partial: Partial, value: np.ndarray, num: int, index: int) -> np.ndarray:
    """Rank-dependent terms that reduce back to ``value`` (so a reduction bug shows)."""
    if partial.reduce_op == "sum":
        return value * ((index + 1) / (num * (num + 1) / 2))
    if partial.reduce_op == "avg":
        return value * ((index + 1) * num / (num * (num + 1) / 2))
    if partial.reduce_op == "max":
        return value - 3.0 * index
    return value + 3.0 * index


def _pieces(value: np.ndarray, placements: Sequence[Placement], mesh_shape: Sequence[int],
            coordinate: Sequence[int], on_partial) -> np.ndarray:
    local = value
    for axis, placement in enumerate(placements):
        num, index = mesh_shape[axis], coordinate[axis]
        if isinstance(placement, Shard):
            start, length = chunk(local.shape[placement.dim], num, index)
            local = np.take(local, range(start, start + length), axis=placement.dim)
        elif isinstance(placement, Partial):
            local = on_partial(placement, local, num, index)
    return np.ascontiguousarray(local, dtype=value.dtype)


def expected_local(value: np.ndarray, placements: Sequence[Placement], mesh_shape: Sequence[int],
                   coordinate: Sequence[int]) -> np.ndarray:
    """The local piece at ``coordinate``: outer axes shard first; Partial axes hold terms."""
    return _pieces(value, placements, mesh_shape, coordinate, _term)


def grad_local(grad: np.ndarray, placements: Sequence[Placement], mesh_shape: Sequence[int],
               coordinate: Sequence[int]) -> np.ndarray:
    """The local gradient of a DTensor with ``placements`` whose global gradient is
    ``grad``: Partial('sum') terms each get the whole gradient, Partial('avg') 1/n of it."""
    return _pieces(grad, placements, mesh_shape, coordinate,
                   lambda partial, local, num, index: local / num if partial.reduce_op == "avg" else local)


def placement_lists(ndim_mesh: int, ops: Sequence[Placement]) -> list[tuple[Placement, ...]]:
    """Every placement list over ``ops`` for a mesh of ``ndim_mesh`` axes, with at most
    one kind of Partial (mixed reductions over different axes do not commute)."""
    lists = []
    for combo in itertools.product(ops, repeat=ndim_mesh):
        partial_ops = {p.reduce_op for p in combo if isinstance(p, Partial)}
        if len(partial_ops) <= 1:
            lists.append(tuple(combo))
    return lists


S0, S1, R = Shard(0), Shard(1), Replicate()
PSUM, PAVG, PMAX, PMIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")
