"""Ops on DTensors under the sharding rules of ``op_rules.py``: every case of
``_op_cases.CASES`` against the same op on the whole tensors in one process (values and
gradients), for input placements swept over Shard/Replicate/Partial on 1-D meshes (world
2 and 4) and a 2x2 mesh, with even, uneven and empty shards; the placements chosen for
the textbook cases; the fallback of an op without a rule.

Float64 data. On torch the tolerance (1e-9) absorbs the different summation orders of
sharded reductions and Partial sums. MindSpore's CPU log_softmax (and cross-entropy) is
approximate even in float64 (~3e-6 absolute against numpy) and its error depends on the
shape it runs on, so a shard and the whole tensor differ by that much: 1e-5 there.

The sweep is sampled (``per_case`` combinations per op), larger on torch: MindSpore's
emulated CPU collectives and PyNative autograd cost ~0.2 s per case per rank.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from hyper_parallel.core.dtensor import functional as F
from hyper_parallel.platform import get_platform
from tests.dtensor._op_cases import CASES, input_values, placement_combos, sample
from tests.dtensor._reference import expected_local, grad_local

TOL = {"rtol": 1e-9, "atol": 1e-9}
MINDSPORE_TOL = {"rtol": 1e-5, "atol": 1e-5}
ON_MINDSPORE = os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore")


def _tensor(p, value: np.ndarray):
    return p.from_numpy(value.reshape(-1)).reshape(value.shape) if value.ndim == 0 else p.from_numpy(value)


def check_rules(mesh_shape: tuple[int, ...], per_case: int, seed: int) -> int:
    """Each case with ``per_case`` placement combinations (all of them when fewer)."""
    p = get_platform()
    tol = MINDSPORE_TOL if p.framework == "mindspore" else TOL
    mesh = init_device_mesh(p.device_type, mesh_shape)
    coordinate = mesh.get_coordinate()
    checked = 0
    for index, case in enumerate(CASES):
        values = input_values(case, seed + index)
        ref_out, ref_backward = p.vjp(case.fn, [_tensor(p, v) for v in values])
        ref = p.to_numpy(ref_out)
        g = np.random.default_rng(seed + 100 + index).standard_normal(ref.shape)
        ref_grads = [None if grad is None else p.to_numpy(grad) for grad in ref_backward([_tensor(p, g)])[0]]
        for combo in sample(placement_combos(case, len(mesh_shape)), per_case, seed + index):
            where = f"{case.name}: inputs {[list(c) for c in combo]} on mesh {mesh_shape}"

            def fn(*locals_, combo=combo, case=case, values=values):
                dts = [DTensor.from_local(t, mesh, pl, shape=v.shape) for t, pl, v in zip(locals_, combo, values)]
                out = case.fn(*dts)
                assert isinstance(out, DTensor) and out.shape == ref.shape, f"{where}: got {out!r}"
                return out.full_tensor()

            locals_ = [_tensor(p, expected_local(v, pl, mesh_shape, coordinate)) for v, pl in zip(values, combo)]
            out, backward = p.vjp(fn, locals_)
            np.testing.assert_allclose(p.to_numpy(out), ref, **tol, err_msg=where)
            grads = backward([_tensor(p, g)])[0]
            for i, (grad, ref_grad, pl) in enumerate(zip(grads, ref_grads, combo)):
                if i in case.ints:
                    continue
                np.testing.assert_allclose(p.to_numpy(grad), grad_local(ref_grad, pl, mesh_shape, coordinate),
                                           **tol, err_msg=f"{where}: gradient of input {i}")
            checked += 1
    return checked


@pytest.mark.parametrize("mesh_shape,per_case", [((2,), (24, 5)), ((4,), (8, 3)), ((2, 2), (12, 3))],
                         ids=["world2", "world4", "mesh2x2"])
def test_rules_against_single_process(run_on_ranks, mesh_shape: tuple[int, ...], per_case: tuple[int, int]) -> None:
    world = int(np.prod(mesh_shape))
    per_case = per_case[1] if ON_MINDSPORE else per_case[0]
    counts = run_on_ranks(check_rules, mesh_shape, per_case, 7, world_size=world, timeout_s=600)
    assert counts[0] > len(CASES) and len(set(counts)) == 1


def check_chosen_placements() -> None:
    """The strategies the textbook cases should pick (world 2), and that they need no
    communication when the inputs already fit."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    rng = np.random.default_rng(0)

    def dt(shape, placement, integer=False):
        value = rng.integers(0, 4, shape).astype(np.int64) if integer else rng.standard_normal(shape)
        return DTensor.from_local(p.from_numpy(expected_local(value, [placement], (2,), mesh.get_coordinate())),
                                  mesh, [placement], shape=shape)

    S0, S1, S2, R, P = Shard(0), Shard(1), Shard(2), Replicate(), Partial("sum")
    expectations = [
        ("matmul Shard(-1) x Shard(0)", lambda: dt((4, 6), S1) @ dt((6, 3), S0), (P,)),
        ("matmul rows", lambda: dt((4, 6), S0) @ dt((6, 3), R), (S0,)),
        ("colwise linear", lambda: F.linear(dt((2, 4, 6), R), dt((8, 6), S0), dt((8,), S0)), (S2,)),
        ("rowwise linear", lambda: F.linear(dt((2, 4, 6), S2), dt((8, 6), S1), dt((8,), R)), (P,)),
        ("sequence-sharded linear", lambda: F.linear(dt((2, 4, 6), S1), dt((8, 6), R)), (S1,)),
        ("sum over a sharded dim", lambda: dt((4, 6), S1).sum(1), (P,)),
        ("mean over a sharded dim", lambda: dt((5, 6), S0).mean(0), (P,)),
        ("sum over another dim", lambda: dt((4, 6), S1).sum(0), (S0,)),
        ("broadcast add", lambda: dt((4, 6), S0) + dt((6,), R), (S0,)),
        ("partial + replicate", lambda: (dt((4, 6), S1) @ dt((6, 3), S0)) + dt((4, 3), R), (P,)),
        ("partial * replicate", lambda: (dt((4, 6), S1) @ dt((6, 3), S0)) * dt((4, 3), R), (P,)),
        ("softmax keeps another shard", lambda: F.softmax(dt((4, 6), S0), -1), (S0,)),
        ("split heads", lambda: dt((3, 4, 10), S2).reshape(3, 4, 2, 5), (S2,)),
        ("merge heads", lambda: dt((3, 4, 2, 5), S2).reshape(3, 4, 10), (S2,)),
        ("transpose moves the shard", lambda: dt((3, 4, 5), S0).transpose(0, 2), (S2,)),
        ("embedding rows", lambda: F.embedding(dt((3, 4), S0, True), dt((4, 6), R)), (S0,)),
        ("embedding columns", lambda: F.embedding(dt((3, 4), R, True), dt((4, 6), S1)), (S2,)),
        ("cross entropy over rows", lambda: F.cross_entropy(dt((6, 5), S0), dt((6,), S0, True)), (P,)),
    ]
    for what, make, placements in expectations:
        out = make()
        assert out.placements == placements, f"{what}: got {list(out.placements)}, expected {list(placements)}"
    # softmax along a sharded dim must make it whole first
    out = F.softmax(dt((4, 6), S1), -1)
    assert out.placements[0] != S1, f"softmax along its sharded dim kept the shard: {out.placements}"


def test_chosen_placements(run_on_ranks) -> None:
    run_on_ranks(check_chosen_placements, world_size=2)


def _diff_rows(t):
    return t[1:] - t[:-1]


def check_fallback() -> None:
    """An op without a rule: Replicate result, right values and gradients, one warning
    naming the op however often it runs."""
    p = get_platform()
    n = p.world_size()
    mesh = init_device_mesh(p.device_type, (n,))
    value = np.random.default_rng(2).standard_normal((7, 3))
    g = np.random.default_rng(3).standard_normal((6, 3))
    local = p.from_numpy(expected_local(value, [Shard(0)], (n,), mesh.get_coordinate()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")

        def fn(t):
            dt = DTensor.from_local(t, mesh, [Shard(0)], shape=(7, 3))
            first = F.call("diff_rows", _diff_rows, dt)
            second = F.call("diff_rows", _diff_rows, dt)
            assert first.placements == (Replicate(),) and first.shape == (6, 3), repr(first)
            return (first + second).to_local()

        out, backward = p.vjp(fn, [local])
    messages = [str(w.message) for w in caught if "diff_rows" in str(w.message)]
    assert len(messages) == 1, f"expected one warning naming the op, got {messages}"
    assert "no sharding rule" in messages[0] and "Replicate" in messages[0], messages[0]
    np.testing.assert_allclose(p.to_numpy(out), 2 * np.diff(value, axis=0), **TOL)
    (grad,), _ = backward([p.from_numpy(g)])
    full_grad = np.zeros_like(value)
    full_grad[1:] += 2 * g
    full_grad[:-1] -= 2 * g
    np.testing.assert_allclose(p.to_numpy(grad), grad_local(full_grad, [Shard(0)], (n,), mesh.get_coordinate()),
                               **TOL, err_msg="gradient through the fallback")


def check_replicated_operands(mesh_shape: tuple[int, ...]) -> None:
    """[Note: framework tensors among replicated DTensors]: a framework tensor among
    DTensors replicated on every axis is a replicated DTensor of that mesh (MindFormers'
    loss times its plain input mask): values, placements and the DTensor's gradient equal
    one process, broadcasting both ways, through operators and the explicit calls. Among
    a sharded or a Partial DTensor, and as the tensor an in-place op writes, it is refused."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, mesh_shape)
    replicate = [Replicate()] * len(mesh_shape)
    rng = np.random.default_rng(5)
    loss, mask, row = rng.standard_normal((2, 3)), rng.standard_normal((2, 3)), rng.standard_normal(3)
    g = rng.standard_normal((2, 3))

    def fn(t):
        x = DTensor.from_local(t, mesh, replicate)
        out = x * p.from_numpy(mask) + F.add(p.from_numpy(row), x) - x / p.from_numpy(mask + 4.0)
        assert out.placements == tuple(replicate) and tuple(out.shape) == (2, 3), repr(out)
        return out.to_local()

    out, backward = p.vjp(fn, [p.from_numpy(loss)])
    np.testing.assert_allclose(p.to_numpy(out), loss * mask + row + loss - loss / (mask + 4.0), **TOL)
    (grad,), _ = backward([p.from_numpy(g)])
    np.testing.assert_allclose(p.to_numpy(grad), g * (mask + 1.0 - 1.0 / (mask + 4.0)), **TOL)
    # the DTensor broadcast to the framework tensor's larger shape
    scalar_row = DTensor.from_local(p.from_numpy(row), mesh, replicate)
    wide = scalar_row * p.from_numpy(mask)
    assert tuple(wide.shape) == (2, 3) and wide.placements == tuple(replicate), repr(wide)
    np.testing.assert_allclose(p.to_numpy(wide.to_local()), row * mask, **TOL)

    mixed_error = RuntimeError if p.framework == "torch" else TypeError
    sharded = DTensor.from_local(p.from_numpy(loss), mesh, [Shard(0)] + replicate[1:], shape=(2 * mesh_shape[0], 3))
    partial = DTensor.from_local(p.from_numpy(loss), mesh, [Partial("sum")] + replicate[1:])
    plain = p.from_numpy(mask)
    for call, error in ((lambda: sharded * plain, mixed_error), (lambda: F.add(sharded, plain), TypeError),
                        (lambda: partial * plain, mixed_error), (lambda: F.add(partial, plain), TypeError)):
        try:
            call()
        except error as err:
            assert "not every DTensor is Replicate on every mesh axis" in str(err), str(err)
        else:
            raise AssertionError(f"no {error.__name__} for a framework tensor among a sharded or Partial DTensor")
    # the framework tensor an in-place op would write stays refused, among replicated DTensors too
    replicated = DTensor.from_local(p.from_numpy(loss), mesh, replicate)
    target = p.from_numpy(mask.copy())
    try:
        target.mul_(replicated)
    except (RuntimeError, TypeError) as err:
        # MindSpore dispatches an in-place method on its first input, a plain tensor with
        # no DTensor hook: MindSpore's own error ("Cannot found __fallback__ attr") there
        assert ("mix DTensors" if p.framework == "torch" else "__fallback__") in str(err), str(err)
    else:
        raise AssertionError("no error for an in-place op writing a framework tensor with a DTensor operand")
    np.testing.assert_array_equal(p.to_numpy(target), mask, err_msg="the refused in-place op wrote the tensor")


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["1d", "2x2"])
def test_replicated_operands(run_on_ranks, mesh_shape: tuple[int, ...]) -> None:
    run_on_ranks(check_replicated_operands, mesh_shape, world_size=int(np.prod(mesh_shape)))


def check_bad_input() -> None:
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    x = DTensor.from_local(p.from_numpy(np.ones((2, 3))), mesh, [Shard(0)])
    plain = p.from_numpy(np.ones((4, 3)))
    # On torch a DTensor's operators and methods are torch's (intercepted below
    # autograd), and a TypeError inside a binary operator becomes Python's generic
    # "unsupported operand"; mixing raises RuntimeError there, as torch's DTensor does.
    mixed_error = RuntimeError if p.framework == "torch" else TypeError
    checks = [
        (lambda: x + plain, mixed_error, "DTensor.from_local(t, mesh"),
        (lambda: F.add(x, plain), TypeError, "DTensor.from_local(t, mesh"),
        (lambda: F.softmax(x, 2), ValueError, "dim=2 is out of range"),
        (lambda: F.reshape(x, 5, -1), ValueError, "does not fit 12 elements"),
        (lambda: F.cross_entropy(x, x, "avg"), ValueError, "reduction='avg'"),
        (lambda: F.permute(x, 0, 0), ValueError, "not a permutation"),
    ]
    for call, error, text in checks:
        try:
            call()
        except error as err:
            assert text in str(err), f"{text!r} not in {err}"
        else:
            raise AssertionError(f"no {error.__name__} for {text!r}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_fallback(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_fallback, world_size=world_size)


def test_bad_input(run_on_ranks) -> None:
    run_on_ranks(check_bad_input, world_size=2)
