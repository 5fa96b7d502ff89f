"""Conformance: forward values and gradients of the differentiable collectives against
the analytic answers, through ``platform.vjp`` (the backward both frameworks share).

Each rank feeds its own output gradient ``g_r`` (distinct per rank), so a wrong
reduction in a backward shows up as a wrong value, not just a wrong scale.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from tests.platform_contract._data import all_rank_data, close, rank_data

WORLDS = [1, 2, 4]


def _vjp(p, fn, x_np: np.ndarray, grad_np_of_rank) -> tuple[np.ndarray, np.ndarray]:
    out, backward = p.vjp(fn, [p.from_numpy(x_np)])
    (grad_x,), _ = backward([p.from_numpy(grad_np_of_rank(tuple(out.shape)))])
    return p.to_numpy(out), p.to_numpy(grad_x)


def check_all_gather(dim: int) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    xs = all_rank_data(n, (2, 3, 2))
    out_shape = list(xs[0].shape)
    out_shape[dim] *= n
    gs = [rank_data(s, tuple(out_shape), seed=7) for s in range(n)]
    out, grad = _vjp(p, lambda x: p.differentiable_all_gather(x, dim), xs[r], lambda _: gs[r])
    np.testing.assert_array_equal(out, np.concatenate(xs, axis=dim))
    width = xs[0].shape[dim]
    expected = sum(np.take(g, range(r * width, (r + 1) * width), axis=dim) for g in gs)
    close(grad, expected, "all_gather backward = reduce-scatter of the output gradients")


def check_all_reduce(op: str) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    xs = all_rank_data(n, (3, 4))
    gs = all_rank_data(n, (3, 4), seed=7)
    out, grad = _vjp(p, lambda x: p.differentiable_all_reduce(x, op), xs[r], lambda _: gs[r])
    scale = n if op == "avg" else 1
    close(out, np.sum(xs, axis=0) / scale, "all_reduce forward")
    close(grad, np.sum(gs, axis=0) / scale, "all_reduce backward")


def _ulysses_expected(xs: list[np.ndarray], r: int, n: int, split_dim: int, concat_dim: int) -> np.ndarray:
    width = xs[0].shape[split_dim] // n
    return np.concatenate([np.take(x, range(r * width, (r + 1) * width), axis=split_dim) for x in xs],
                          axis=concat_dim)


def check_all_to_all(split_dim: int, concat_dim: int) -> None:
    """[batch, seq/n, heads, head_dim] <-> [batch, seq, heads/n, head_dim] and variants."""
    p = get_platform()
    n, r = p.world_size(), p.rank()
    shape = [2, 3, 2, 2]
    shape[split_dim] *= n
    xs = all_rank_data(n, tuple(shape))
    out_shape = list(shape)
    out_shape[split_dim] //= n
    out_shape[concat_dim] *= n
    gs = [rank_data(s, tuple(out_shape), seed=7) for s in range(n)]
    out, grad = _vjp(p, lambda x: p.differentiable_all_to_all(x, split_dim, concat_dim), xs[r], lambda _: gs[r])
    np.testing.assert_array_equal(out, _ulysses_expected(xs, r, n, split_dim, concat_dim))
    np.testing.assert_array_equal(grad, _ulysses_expected(gs, r, n, concat_dim, split_dim))


def check_all_to_all_uneven(entry: str) -> None:
    """Token dispatch: uneven rows on dim 0 (zeros included) there and back, through
    ``differentiable_all_to_all`` or the derived ``differentiable_all_to_all_single_async``
    (torch: its functional collective, waited for at first use)."""
    p = get_platform()
    n, r = p.world_size(), p.rank()
    sizes = [[(a + 2 * b) % 3 for b in range(n)] for a in range(n)]
    xs = [rank_data(a, (sum(sizes[a]), 4)) for a in range(n)]
    out_sizes = [sizes[s][r] for s in range(n)]
    gs = [rank_data(a, (sum(sizes[s][a] for s in range(n)), 4), seed=7) for a in range(n)]
    if entry == "async":
        a2a = lambda x: p.differentiable_all_to_all_single_async(x, sizes[r], out_sizes)  # noqa: E731
    else:
        a2a = lambda x: p.differentiable_all_to_all(x, 0, 0, None, sizes[r], out_sizes)  # noqa: E731
    out, grad = _vjp(p, a2a, xs[r], lambda _: gs[r])
    expected = [xs[s][sum(sizes[s][:r]): sum(sizes[s][:r + 1])] for s in range(n)]
    np.testing.assert_array_equal(out, np.concatenate(expected))
    # Rank s's output gradient holds one block per source rank q, in q order.
    back = [gs[s][sum(sizes[q][s] for q in range(r)): sum(sizes[q][s] for q in range(r + 1))] for s in range(n)]
    np.testing.assert_array_equal(grad, np.concatenate(back))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_differentiable_all_gather(run_on_ranks, world_size: int, dim: int) -> None:
    run_on_ranks(check_all_gather, dim, world_size=world_size)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_differentiable_all_reduce(run_on_ranks, world_size: int, op: str) -> None:
    run_on_ranks(check_all_reduce, op, world_size=world_size)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("split_dim,concat_dim", [(2, 1), (1, 2), (0, 3)])
def test_differentiable_all_to_all(run_on_ranks, world_size: int, split_dim: int, concat_dim: int) -> None:
    run_on_ranks(check_all_to_all, split_dim, concat_dim, world_size=world_size)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("entry", ["sync", "async"])
def test_differentiable_all_to_all_uneven(run_on_ranks, world_size: int, entry: str) -> None:
    run_on_ranks(check_all_to_all_uneven, entry, world_size=world_size)


def _launch_seq_to_head(p, x, n: int, split_dim: int):
    """The launch side of an overlapped Ulysses all-to-all (what AsyncContextParallel's
    projection post-hook does): [n, ..., H/n, ...] chunk-major, contiguous, async."""
    shape = list(x.shape)
    blocked = x.reshape(*(shape[:split_dim] + [n, shape[split_dim] // n] + shape[split_dim + 1:]))
    perm = [split_dim] + [i for i in range(blocked.ndim) if i != split_dim]
    return p.all_to_all_single(blocked.permute(*perm).contiguous(), async_op=True)


def check_async_a2a_wait(use_box: bool) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    xs = all_rank_data(n, (2, 3, 2 * n, 2))  # [batch, seq/n, heads, head_dim]
    gs = all_rank_data(n, (2, 3 * n, 2, 2), seed=7)
    box: list | None = [] if use_box else None

    def fn(x):
        work = _launch_seq_to_head(p, x, n, split_dim=2)
        return p.differentiable_async_a2a_wait(x, work, None, None, n, 1, 2, box)

    out, grad = _vjp(p, fn, xs[r], lambda _: gs[r])
    np.testing.assert_array_equal(out, _ulysses_expected(xs, r, n, split_dim=2, concat_dim=1))
    expected_grad = _ulysses_expected(gs, r, n, split_dim=1, concat_dim=2)
    if use_box:
        assert len(box) == 1, f"backward should append one (work, buffer) pair, found {len(box)}"
        np.testing.assert_array_equal(grad, np.zeros_like(xs[r]))
        np.testing.assert_array_equal(p.to_numpy(box[0][0].wait()), expected_grad)
    else:
        np.testing.assert_array_equal(grad, expected_grad)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("use_box", [False, True], ids=["sync_backward", "handle_box"])
def test_differentiable_async_a2a_wait(run_on_ranks, world_size: int, use_box: bool) -> None:
    run_on_ranks(check_async_a2a_wait, use_box, world_size=world_size)


class _RecordingCoordinator:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def forward_hook(self, name: str) -> None:
        self.calls.append(f"F{name}")

    def backward_hook(self, name: str) -> None:
        self.calls.append(f"B{name}")


def check_sync_hook() -> list[str]:
    p = get_platform()
    coord = _RecordingCoordinator()
    x = rank_data(p.rank(), (2, 3))
    g = rank_data(p.rank(), (2, 3), seed=7)

    def fn(t):
        return p.differentiable_sync_hook(p.differentiable_sync_hook(t, "A", coord) * 2.0, "B", coord)

    out, grad = _vjp(p, fn, x, lambda _: g)
    np.testing.assert_array_equal(out, 2 * x)
    np.testing.assert_array_equal(grad, 2 * g)
    return coord.calls


@pytest.mark.parametrize("world_size", [1, 2])
def test_differentiable_sync_hook(run_on_ranks, world_size: int) -> None:
    for calls in run_on_ranks(check_sync_hook, world_size=world_size):
        assert calls == ["FA", "FB", "BB", "BA"]
