"""Conformance: the plain collectives against numpy, on world 1, 2, 4 and a subgroup.

Every check runs inside the rank processes and raises there; the harness re-raises it
here with the failing rank.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.platform import P2POp, ReduceOp, get_platform
from tests.platform_contract._data import all_rank_data, close, rank_data
from hyper_parallel.core.process_groups import barrier, split_group

WORLDS = [1, 2, 4]

_NUMPY_REDUCE = {
    ReduceOp.SUM: lambda xs: np.sum(xs, axis=0),
    ReduceOp.AVG: lambda xs: np.mean(xs, axis=0),
    ReduceOp.MAX: lambda xs: np.max(xs, axis=0),
    ReduceOp.MIN: lambda xs: np.min(xs, axis=0),
    ReduceOp.PRODUCT: lambda xs: np.prod(xs, axis=0),
}


def _inputs(n: int, shape: tuple[int, ...], op: ReduceOp = ReduceOp.SUM) -> list[np.ndarray]:
    xs = all_rank_data(n, shape)
    # Products of normals under/overflow nothing at these sizes, but keep them near 1.
    return [1.0 + 0.1 * x for x in xs] if op is ReduceOp.PRODUCT else xs


def check_all_reduce(op_value: str, async_op: bool) -> None:
    p = get_platform()
    op = ReduceOp(op_value)
    n, r = p.world_size(), p.rank()
    xs = _inputs(n, (3, 5), op)
    x = p.from_numpy(xs[r])
    work = p.all_reduce(x, op_value, async_op=async_op)
    close(p.to_numpy(work.wait()), _NUMPY_REDUCE[op](xs), f"all_reduce {op_value}")
    assert work.is_completed()
    np.testing.assert_array_equal(p.to_numpy(x), xs[r], err_msg="all_reduce modified its input")


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("op", [op.value for op in ReduceOp])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_reduce(run_on_ranks, world_size: int, op: str, async_op: bool) -> None:
    run_on_ranks(check_all_reduce, op, async_op, world_size=world_size)


def check_all_gather_into_tensor(async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    xs = all_rank_data(n, (2, 3, 2))
    out = p.all_gather_into_tensor(p.from_numpy(xs[r]), async_op=async_op).wait()
    np.testing.assert_array_equal(p.to_numpy(out), np.concatenate(xs, axis=0))
    # out=: the caller's buffer is written and handed back, and can be reused.
    f32 = p.dtype("float32")
    buf = p.zeros((2 * n, 3, 2), f32)
    for scale in (1.0, -2.0):
        got = p.all_gather_into_tensor(p.from_numpy(scale * xs[r]), async_op=async_op, out=buf).wait()
        assert got is buf, "all_gather_into_tensor(out=) must return out itself"
        np.testing.assert_array_equal(p.to_numpy(buf), scale * np.concatenate(xs, axis=0))
    x = p.from_numpy(xs[r])
    for bad, words in ((p.zeros((2 * n + 1, 3, 2), f32), ["out has shape", f"({2 * n}, 3, 2)"]),
                       (p.zeros((2 * n, 3, 2), p.dtype("float16")), ["out has dtype"]),
                       (p.zeros((3, 2 * n, 2), f32).transpose(0, 1), ["not contiguous"])):
        try:
            p.all_gather_into_tensor(x, async_op=async_op, out=bad)
        except ValueError as err:
            assert all(w in str(err) for w in words), str(err)
        else:
            raise AssertionError("all_gather_into_tensor accepted a bad out buffer")


def check_reduce_scatter_tensor(op_value: str, async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    xs = all_rank_data(n, (2 * n, 3))
    out = p.reduce_scatter_tensor(p.from_numpy(xs[r]), op_value, async_op=async_op).wait()
    expected = _NUMPY_REDUCE[ReduceOp(op_value)](xs)[2 * r: 2 * r + 2]
    close(p.to_numpy(out), expected, f"reduce_scatter_tensor {op_value}")


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_gather_into_tensor(run_on_ranks, world_size: int, async_op: bool) -> None:
    run_on_ranks(check_all_gather_into_tensor, async_op, world_size=world_size)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_reduce_scatter_tensor(run_on_ranks, world_size: int, op: str, async_op: bool) -> None:
    run_on_ranks(check_reduce_scatter_tensor, op, async_op, world_size=world_size)


def _uneven_sizes(n: int) -> list[list[int]]:
    """sizes[r][s]: rows rank r sends to rank s; zeros included."""
    return [[(r + 2 * s) % 3 for s in range(n)] for r in range(n)]


def check_all_to_all_single(uneven: bool, async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    if uneven:
        sizes = _uneven_sizes(n)
        xs = [rank_data(i, (sum(sizes[i]), 2, 3)) for i in range(n)]
        in_sizes, out_sizes = sizes[r], [sizes[s][r] for s in range(n)]
    else:
        sizes = [[2] * n for _ in range(n)]
        xs = [rank_data(i, (2 * n, 2, 3)) for i in range(n)]
        in_sizes = out_sizes = None
    pieces = []
    for s in range(n):
        start = sum(sizes[s][:r])
        pieces.append(xs[s][start:start + sizes[s][r]])
    out = p.all_to_all_single(p.from_numpy(xs[r]), out_sizes, in_sizes, async_op=async_op).wait()
    np.testing.assert_array_equal(p.to_numpy(out), np.concatenate(pieces, axis=0))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_to_all_single(run_on_ranks, world_size: int, uneven: bool, async_op: bool) -> None:
    run_on_ranks(check_all_to_all_single, uneven, async_op, world_size=world_size)


def check_broadcast(async_op: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    src = n - 1
    out = p.broadcast(p.from_numpy(rank_data(r, (4, 3))), src, async_op=async_op).wait()
    np.testing.assert_array_equal(p.to_numpy(out), rank_data(src, (4, 3)))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_broadcast(run_on_ranks, world_size: int, async_op: bool) -> None:
    run_on_ranks(check_broadcast, async_op, world_size=world_size)


def check_batch_isend_irecv() -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    f32 = p.dtype("float32")
    right, left = (r + 1) % n, (r - 1) % n
    ops = [
        P2POp("isend", p.from_numpy(rank_data(r, (2, 2), seed=1)), right),
        P2POp("isend", p.from_numpy(rank_data(r, (3,), seed=2)), left),
        P2POp("irecv", p.zeros((2, 2), f32), left),
        P2POp("irecv", p.zeros((3,), f32), right),
    ]
    works = p.batch_isend_irecv(ops)
    results = [w.wait() for w in works]
    assert results[0] is None and results[1] is None
    np.testing.assert_array_equal(p.to_numpy(results[2]), rank_data(left, (2, 2), seed=1))
    np.testing.assert_array_equal(p.to_numpy(results[3]), rank_data(right, (3,), seed=2))


@pytest.mark.parametrize("world_size", [2, 4])
def test_batch_isend_irecv(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_batch_isend_irecv, world_size=world_size)


def check_barrier() -> int:
    p = get_platform()
    assert barrier() is None
    return p.rank()


@pytest.mark.parametrize("world_size", WORLDS)
def test_barrier(run_on_ranks, world_size: int) -> None:
    """core's barrier (an all-reduce read back) returns on every rank of the world."""
    assert run_on_ranks(check_barrier, world_size=world_size) == list(range(world_size))


def check_groups() -> dict:
    """World 4: subgroup [1, 2]; a split into {0, 3} and {1, 2}; collectives on each."""
    p = get_platform()
    r = p.rank()
    assert p.world_size() == 4 and p.group_ranks() == [0, 1, 2, 3]
    sub = p.create_group([2, 1])
    assert p.create_group([1, 2]) is sub, "create_group must cache by sorted rank tuple"
    split = split_group([[0, 3], [1, 2]])
    expected_part = [0, 3] if r in (0, 3) else [1, 2]
    assert p.group_ranks(split) == expected_part
    assert p.rank(split) == expected_part.index(r) and p.world_size(split) == 2
    result: dict = {}
    if r in (1, 2):
        assert p.group_ranks(sub) == [1, 2] and p.rank(sub) == r - 1 and p.world_size(sub) == 2
        xs = {g: rank_data(g, (2, 3)) for g in (1, 2)}
        x = p.from_numpy(xs[r])
        close(p.to_numpy(p.all_reduce(x, group=sub).wait()), xs[1] + xs[2], "subgroup all_reduce")
        gathered = p.all_gather_into_tensor(x, group=sub, async_op=True).wait()
        np.testing.assert_array_equal(p.to_numpy(gathered), np.concatenate([xs[1], xs[2]]))
        a2a = p.all_to_all_single(p.from_numpy(rank_data(r, (4, 3))), group=sub).wait()
        np.testing.assert_array_equal(
            p.to_numpy(a2a), np.concatenate([rank_data(1, (4, 3))[2 * (r - 1): 2 * r],
                                             rank_data(2, (4, 3))[2 * (r - 1): 2 * r]]))
        rs = p.reduce_scatter_tensor(p.from_numpy(rank_data(r, (4, 3))), group=sub).wait()
        close(p.to_numpy(rs), (rank_data(1, (4, 3)) + rank_data(2, (4, 3)))[2 * (r - 1): 2 * r], "subgroup rs")
        bc = p.broadcast(x, 1, group=sub).wait()  # group rank 1 is global rank 2
        np.testing.assert_array_equal(p.to_numpy(bc), xs[2])
        peer = 1 - p.rank(sub)
        works = p.batch_isend_irecv([P2POp("isend", x, peer, sub), P2POp("irecv", p.zeros((2, 3), x.dtype), peer, sub)])
        np.testing.assert_array_equal(p.to_numpy(works[1].wait()), xs[3 - r])
        barrier(sub)
        result["sub"] = True
    total = p.all_reduce(p.from_numpy(np.array([float(r)], np.float32)), group=split).wait()
    result["split_sum"] = float(p.to_numpy(total)[0])
    return result


def test_subgroups_inside_world_4(run_on_ranks) -> None:
    results = run_on_ranks(check_groups, world_size=4)
    assert [res["split_sum"] for res in results] == [3.0, 3.0, 3.0, 3.0]
    assert [res.get("sub", False) for res in results] == [False, True, True, False]


def check_empty_tensors() -> None:
    """Zero-size tensors (an empty shard of an uneven split) go through every collective."""
    p = get_platform()
    n = p.world_size()
    f32 = p.dtype("float32")
    empty = p.zeros((0, 3), f32)
    for op in ("sum", "avg", "max"):
        assert tuple(p.all_reduce(empty, op).wait().shape) == (0, 3)
    assert tuple(p.all_gather_into_tensor(empty, async_op=True).wait().shape) == (0, 3)
    assert tuple(p.all_gather_into_tensor(empty, out=p.zeros((0, 3), f32)).wait().shape) == (0, 3)
    assert tuple(p.reduce_scatter_tensor(empty).wait().shape) == (0, 3)
    assert tuple(p.all_to_all_single(empty).wait().shape) == (0, 3)
    assert tuple(p.all_to_all_single(empty, [0] * n, [0] * n).wait().shape) == (0, 3)
    assert tuple(p.broadcast(empty, 0).wait().shape) == (0, 3)
    assert tuple(p.differentiable_all_gather(p.zeros((2, 0), f32), dim=1).shape) == (2, 0)
    total = p.all_reduce(p.from_numpy(np.ones(1, np.float32))).wait()
    assert float(p.to_numpy(total)[0]) == n


@pytest.mark.parametrize("world_size", WORLDS)
def test_empty_tensors(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_empty_tensors, world_size=world_size)
