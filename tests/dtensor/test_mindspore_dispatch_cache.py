"""The MindSpore DTensor's dispatch cache ([Note: MindSpore dispatch cache] in
``platform/mindspore/dtensor.py``): a call whose key (the primitive, each DTensor's spec and
dtype, the other arguments) was seen runs from the cache, so each test calls an op on one
key twice (the second call from the cache), then changes one part of the key (placements,
global shape, a dim, a number, a dtype) and checks every result against numpy on the whole
tensors: a key that missed a part would hand a later call the earlier call's plan.

2 ranks, float32 values from a seeded generator; the comparisons are exact where the op
is element-wise on each rank's piece, else to 1e-6 (sums in another order across ranks).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="the MindSpore DTensor class's __fallback__ cache")

TOL = {"rtol": 1e-6, "atol": 1e-6}


def _setup() -> tuple:
    import hyper_parallel as hp

    p = hp.get_platform()
    mesh = hp.init_device_mesh(p.device_type, (p.world_size(),))
    rng = np.random.default_rng(0)

    def dist(value: np.ndarray, placement: object) -> object:
        return hp.distribute_tensor(p.from_numpy(value), mesh, [placement], src_data_rank=None)

    return hp, p, mesh, rng, dist


def check_key_parts() -> None:
    from mindspore import mint

    hp, p, mesh, rng, dist = _setup()
    F = mint.nn.functional
    a, b = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((4, 6)).astype(np.float32)
    tall = rng.standard_normal((8, 6)).astype(np.float32)

    def full(x: object) -> np.ndarray:
        return p.to_numpy(x.full_tensor())

    # placements: the same add on Shard(0) + Shard(0), then Shard(0) + Replicate
    # (which must redistribute), then Shard(1) + Shard(1)
    for _ in range(2):
        out = dist(a, hp.Shard(0)) + dist(b, hp.Shard(0))
        assert out.placements == (hp.Shard(0),)
        np.testing.assert_array_equal(full(out), a + b)
    out = dist(a, hp.Shard(0)) + dist(b, hp.Replicate())
    np.testing.assert_array_equal(full(out), a + b)
    out = dist(a, hp.Shard(1)) + dist(b, hp.Shard(1))
    assert out.placements == (hp.Shard(1),)
    np.testing.assert_array_equal(full(out), a + b)

    # global shapes: the same reshape arguments on [4, 6] and [8, 6] give other local
    # shapes (the cached call passes this rank's)
    for value in (a, a, tall, tall):
        out = dist(value, hp.Shard(0)).reshape(-1, 3)
        assert out.shape == (value.size // 3, 3)
        np.testing.assert_array_equal(full(out), value.reshape(-1, 3))
    for value in (a, a, a.T.copy()):
        out = F.softmax(dist(value, hp.Shard(0)), dim=-1)
        expected = np.exp(value - value.max(-1, keepdims=True))
        np.testing.assert_allclose(full(out), expected / expected.sum(-1, keepdims=True), **TOL)

    # a dim: the same sum over dim 0 (Partial) and dim 1 (stays Shard(0))
    for dim in (0, 0, 1, 1):
        out = dist(a, hp.Shard(0)).sum(dim)
        np.testing.assert_allclose(full(out), a.sum(dim), **TOL)
    for dims in ((0, 1), (1, 0), (1, 0)):
        out = dist(a, hp.Shard(0)).permute(*dims)
        np.testing.assert_array_equal(full(out), a.transpose(dims))

    # numbers: their value and their type are part of the key
    for scalar in (1, 1, 2, 2.5, 2.5):
        out = dist(a, hp.Shard(0)) * scalar
        np.testing.assert_array_equal(full(out), a * np.float32(scalar))

    # dtype: the same op on int32 and float32 pieces keeps each one's dtype
    ints = np.arange(24, dtype=np.int32).reshape(4, 6)
    for value in (ints, ints, a, a):
        out = dist(value, hp.Shard(0)) + dist(value, hp.Shard(0))
        assert p.to_numpy(out.to_local()).dtype == value.dtype
        np.testing.assert_array_equal(full(out), value + value)

    # a refused call is not cached: the second one is refused too
    for _ in range(2):
        with pytest.raises(ValueError, match="add"):
            _ = dist(a, hp.Shard(0)) + dist(tall, hp.Shard(0))

    # in place: the written DTensor comes back, holding the source's piece (copy_: on
    # MindSpore 2.10 CPU, Tensor.add_ and mul_ leave even a plain tensor unchanged)
    target = dist(np.zeros_like(a), hp.Shard(0))
    for value in (a, b, a):
        assert target.copy_(dist(value, hp.Shard(0))) is target
        np.testing.assert_array_equal(full(target), value)


def check_gradient_layout_cached() -> None:
    """``F.linear(x Replicate, w Shard(0))`` is ``Shard(-1)``: x's gradient is summed over
    the ranks (the Megatron "f" operator, [Note: gradients of ops on DTensors]); the cached
    call must keep it, so each of three calls gives the whole gradient."""
    import mindspore as ms
    from mindspore import mint

    hp, p, mesh, rng, dist = _setup()
    x_full = rng.standard_normal((4, 6)).astype(np.float32)
    w_full = rng.standard_normal((8, 6)).astype(np.float32)
    x, w = dist(x_full, hp.Replicate()), dist(w_full, hp.Shard(0))

    def loss(x_: object) -> object:
        return mint.nn.functional.linear(x_, w).full_tensor().sum()

    # first at top level, where MindSpore records nothing and the cached call leaves the
    # sum out: the calls under ms.grad of the same key must still put it in
    for _ in range(2):
        out = mint.nn.functional.linear(x, w)
        assert out.placements == (hp.Shard(1),)
        np.testing.assert_allclose(p.to_numpy(out.full_tensor()), x_full @ w_full.T, **TOL)
    for _ in range(3):
        grad = ms.grad(loss, grad_position=0)(x)
        np.testing.assert_allclose(p.to_numpy(grad), np.ones((4, 8), np.float32) @ w_full, **TOL)

    # the dtype is part of the key: an integer input has no gradient, so the same
    # broadcast multiply on int32 pieces first must not leave a float call without the sum
    row, table = rng.standard_normal(6).astype(np.float32), rng.standard_normal((4, 6)).astype(np.float32)
    _ = dist(np.arange(6, dtype=np.int32), hp.Replicate()) * dist(np.ones((4, 6), np.int32), hp.Shard(0))
    table_d = dist(table, hp.Shard(0))
    for _ in range(2):
        grad = ms.grad(lambda r: (r * table_d).full_tensor().sum(), grad_position=0)(dist(row, hp.Replicate()))
        np.testing.assert_allclose(p.to_numpy(grad), table.sum(0), **TOL)


def check_recorded_and_plain() -> None:
    """A cached call records its rule as the planned one does ([Note: recorded rules]);
    ops on framework tensors never reach the DTensor class."""
    from hyper_parallel.core.op_entry import recorded_rules

    hp, p, mesh, rng, dist = _setup()
    a = rng.standard_normal((4, 6)).astype(np.float32)
    x = dist(a, hp.Shard(0))
    plain = p.from_numpy(a)
    with recorded_rules() as seen:
        for _ in range(3):
            _ = x + x
    assert seen == ["add"] * 3
    with recorded_rules() as seen:  # the class's own reshape records as __fallback__ does
        for _ in range(3):
            _ = x.reshape(4, 2, 3)
            _ = x.view((4, 2, 3))
    assert seen == ["view"] * 6
    with recorded_rules() as seen:
        _ = plain + plain
        _ = plain.sum(0)
    assert seen == []


def check_methods_cached() -> None:
    """The Tensor methods the class defines ([Note: MindSpore Tensor methods on DTensors])
    run a call whose key the cache holds without MindSpore's ``__fallback__``, with the
    values and placements of the planned call; a call with another key (placements,
    global shape, numbers, a shape form) goes through ``__fallback__``."""
    hp, p, mesh, rng, dist = _setup()
    # shapes no other check here uses: the worker pool (and the cache) outlive one check
    a, b = rng.standard_normal((6, 12)).astype(np.float32), rng.standard_normal((6, 12)).astype(np.float32)
    tall = rng.standard_normal((12, 12)).astype(np.float32)
    cls = type(dist(a, hp.Shard(0)))
    handed: list[str] = []
    original = cls.__fallback__

    def counting(self: object, op: object, args: object = (), kwargs: object = None) -> object:
        handed.append(getattr(op, "name", "?"))
        return original(self, op, args, kwargs)

    def full(x: object) -> np.ndarray:
        return p.to_numpy(x.full_tensor())

    elementwise = [(a, b, hp.Shard(0)), (a, b, hp.Shard(0)), (tall, tall, hp.Shard(0)), (a, b, hp.Shard(1)),
                   (a, b, hp.Shard(1))]
    shapes = [(a, a, hp.Shard(0)), (a, a, hp.Shard(0)), (tall, tall, hp.Shard(0)), (tall, tall, hp.Shard(0)),
              (a, a, hp.Replicate()), (a, a, hp.Replicate())]
    cases = [  # (the method call, its value on numpy arrays, the layouts to call it on, in order)
        (lambda x, y: x + y, lambda u, v: u + v, elementwise), (lambda x, y: x - y, lambda u, v: u - v, elementwise),
        (lambda x, y: x * y, lambda u, v: u * v, elementwise), (lambda x, y: x / y, lambda u, v: u / v, elementwise),
        (lambda x, y: x + 2.0, lambda u, v: u + np.float32(2.0), elementwise),
        (lambda x, y: x * 3, lambda u, v: u * 3, elementwise), (lambda x, y: x - 1, lambda u, v: u - 1, elementwise),
        (lambda x, y: x / 2.0, lambda u, v: u / np.float32(2.0), elementwise),
        # reshapes that split the unsharded dim only (core plans them without communication):
        # the forms MindSpore hands over: the shape spread, a tuple, Tensor.view, a list
        (lambda x, y: x.reshape(x.shape[0], -1, 3), lambda u, v: u.reshape(u.shape[0], -1, 3), shapes),
        (lambda x, y: x.reshape((x.shape[0], 4, 3)), lambda u, v: u.reshape(u.shape[0], 4, 3), shapes),
        (lambda x, y: x.view(x.shape[0], 2, -1), lambda u, v: u.reshape(u.shape[0], 2, -1), shapes),
        (lambda x, y: x.reshape([x.shape[0], 6, 2]), lambda u, v: u.reshape(u.shape[0], 6, 2), shapes),
    ]

    cls.__fallback__ = counting
    try:
        for index, (call, expected, layouts) in enumerate(cases):
            planned: dict[tuple, tuple] = {}  # key -> the planned call's placements
            for left, right, placement in layouts:
                key = (index, left.shape, placement)
                x, y = dist(left, placement), dist(right, placement)
                handed.clear()
                out = call(x, y)
                want = expected(left, right)
                assert out.shape == want.shape
                np.testing.assert_allclose(full(out), want, **TOL)
                if key in planned:  # held: no __fallback__, the planned call's placements
                    assert handed == [], (index, handed)
                    assert out.placements == planned[key]
                else:
                    assert handed, (index, "a new key went around __fallback__")
                    planned[key] = out.placements
        x, y = dist(a, hp.Shard(0)), dist(b, hp.Replicate())
        for _ in range(2):  # needs communication: never run from the cache
            handed.clear()
            np.testing.assert_allclose(full(x + y), a + b, **TOL)
            assert handed, "a call that redistributes went around __fallback__"
    finally:
        cls.__fallback__ = original


@pytest.mark.parametrize("check", [check_key_parts, check_gradient_layout_cached, check_recorded_and_plain,
                                   check_methods_cached],
                         ids=lambda f: f.__name__)
def test_dispatch_cache(run_on_ranks, check) -> None:
    run_on_ranks(check, world_size=2, timeout_s=300)
