"""Random ops on DTensors ([Note: random ops on DTensors] in core/dtensor/philox.py): after
the same seed, a sharded tensor's values equal, bit for bit, what one device draws for
the whole tensor (the same calls on a plain tensor), whatever the placements: Shard(0),
Shard(-1), uneven shards (7x5 over 4 ranks leaves one a short piece, 3 rows over 4 one
empty), a 2x2 mesh (nested shards included), Replicate. Both frameworks compare against
the same numpy values (``philox.draw`` of the whole tensor), so passing on each backend
means the frameworks agree bitwise. Exact equality throughout: the values are computed
once by numpy and copied, never recomputed by a framework kernel (dropout's product is
elementwise, the same kernel on a piece as on the whole)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from hyper_parallel.core import op_entry
from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh, philox
from hyper_parallel.core.dtensor import random as dt_random
from hyper_parallel.core.dtensor.dtensor_spec import local_shape
from hyper_parallel.platform import get_platform

SEED = 1234
#: (name, apply to a tensor, (kind, params) of the numpy reference)
OPS = {
    "normal_": (lambda t: dt_random.normal_(t, 0.5, 0.02), ("normal", {"mean": 0.5, "std": 0.02})),
    "uniform_": (lambda t: dt_random.uniform_(t, -0.1, 0.3), ("uniform", {"low": -0.1, "high": 0.3})),
    "trunc_normal_": (lambda t: dt_random.trunc_normal_(t, 0.0, 1.0, -2.0, 2.0),
                      ("trunc_normal", {"mean": 0.0, "std": 1.0, "a": -2.0, "b": 2.0})),
    "bernoulli_": (lambda t: dt_random.bernoulli_(t, 0.3), ("bernoulli", {"p": 0.3})),
}


def _expected(shape: tuple[int, ...], ops: list[str]) -> list[np.ndarray]:
    """The whole tensor's values after each op in turn, from numpy alone."""
    state, out = philox.RngState(SEED), []
    for name in ops:
        kind, params = OPS[name][1]
        out.append(philox.draw(kind, params, state, shape, (0,) * len(shape), shape, np.dtype(np.float32)))
        state = state.advanced(kind, int(np.prod(shape)))
    return out


def check_layouts(mesh_shape: tuple[int, ...], shape: tuple[int, ...], placements: list[list]) -> int:
    """Each op of OPS in turn on a DTensor of each placements (one stream, so later ops
    enter it where the earlier left it), against numpy and a plain tensor."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, mesh_shape)
    names = list(OPS)
    expected = _expected(shape, names)
    # the one-device reference: the same calls on a plain tensor
    dt_random.manual_seed(SEED)
    plain = p.from_numpy(np.zeros(shape, np.float32))
    for name, want in zip(names, expected):
        OPS[name][0](plain)
        np.testing.assert_array_equal(p.to_numpy(plain), want, err_msg=f"{name} on a plain tensor")
    checked = 0
    for pls in placements:
        dt_random.manual_seed(SEED)
        x = DTensor.from_local(p.zeros(_local_shape(shape, pls, mesh), p.dtype("float32")), mesh, pls, shape=shape)
        for name, want in zip(names, expected):
            out = OPS[name][0](x)
            assert out is x and x.placements == tuple(_normalized(pls, shape)), f"{name}: placements {x.placements}"
            np.testing.assert_array_equal(p.to_numpy(x.full_tensor()), want, err_msg=f"{name} on {pls}, {shape}")
            checked += 1
    return checked


def _normalized(placements: list, shape: tuple[int, ...]) -> list:
    return [Shard(pl.dim % len(shape)) if isinstance(pl, Shard) else pl for pl in placements]


def _local_shape(shape: tuple[int, ...], placements: list, mesh) -> tuple[int, ...]:
    return local_shape(shape, _normalized(placements, shape), mesh.shape, mesh.get_coordinate())


ONE_D = [[Shard(0)], [Shard(-1)], [Replicate()]]
TWO_D = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)], [Replicate(), Shard(-1)],
         [Replicate(), Replicate()]]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("shape", [(8, 6), (7, 5), (3, 2, 5)], ids=["even", "uneven", "3d-empty-piece"])
def test_one_d_mesh(run_on_ranks, world_size: int, shape: tuple[int, ...]) -> None:
    counts = run_on_ranks(check_layouts, (world_size,), shape, ONE_D, world_size=world_size)
    assert counts == [len(ONE_D) * len(OPS)] * world_size


@pytest.mark.parametrize("shape", [(8, 6), (7, 5)], ids=["even", "uneven"])
def test_two_d_mesh(run_on_ranks, shape: tuple[int, int]) -> None:
    counts = run_on_ranks(check_layouts, (2, 2), shape, TWO_D, world_size=4)
    assert counts == [len(TWO_D) * len(OPS)] * 4


def check_dropout(mesh_shape: tuple[int, ...], shape: tuple[int, ...], placements: list[list]) -> int:
    """dropout of a sharded activation equals dropout of the whole one, and its gradient
    is the mask times the scale."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, mesh_shape)
    value = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    dt_random.manual_seed(SEED)
    want = p.to_numpy(dt_random.dropout(p.from_numpy(value), 0.25))
    kept = int((want != 0).sum())
    assert 0 < kept < want.size, "the test's p should both keep and drop some"
    checked = 0
    for pls in placements:
        dt_random.manual_seed(SEED)
        x = DTensor.from_local(p.from_numpy(value), mesh, [Replicate()] * len(mesh_shape)).redistribute(mesh, pls)
        out = dt_random.dropout(x, 0.25)
        assert out.placements == tuple(_normalized(pls, shape)), f"dropout on {pls}: placements {out.placements}"
        np.testing.assert_array_equal(p.to_numpy(out.full_tensor()), want, err_msg=f"dropout on {pls}")
        assert dt_random.dropout(x, 0.25, training=False) is x
        checked += 1
    return checked


def test_dropout(run_on_ranks) -> None:
    assert run_on_ranks(check_dropout, (2,), (7, 5), ONE_D, world_size=2) == [3, 3]
    assert run_on_ranks(check_dropout, (2, 2), (7, 6), TWO_D, world_size=4) == [5] * 4


def _catch(fn, failures: list) -> None:
    try:
        fn()
    except RuntimeError as err:
        failures.append(err)


def check_refusals() -> list[str]:
    """Partial, no seed, missing arguments from a backend, bad values: clear errors,
    raised on every rank before any collective."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    messages = []
    x = DTensor.from_local(p.zeros((3, 4), p.dtype("float32")), mesh, [Shard(0)], shape=(6, 4))
    # a thread starts without a seed (the stream's state is per thread)
    failures: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(lambda: dt_random.normal_(x), failures))
    thread.start()
    thread.join()
    assert len(failures) == 1 and "manual_seed" in str(failures[0]), failures
    dt_random.manual_seed(SEED)
    partial = DTensor.from_local(p.zeros((6, 4), p.dtype("float32")), mesh, [Partial("sum")])
    with pytest.raises(ValueError, match="Partial") as err:
        dt_random.normal_(partial)
    messages.append(str(err.value))
    # the backend's route without the op's arguments (what torch's interception hands
    # today for aten.normal_): the error names the explicit function
    with pytest.raises(RuntimeError, match=r"random\.normal_") as err:
        op_entry.dispatch_op("normal", [x], lambda local: local, {}, inplace=0)
    messages.append(str(err.value))
    with pytest.raises(ValueError, match="std"):
        dt_random.normal_(x, std=0.0)
    with pytest.raises(ValueError, match="p="):
        dt_random.dropout(x, 1.0)
    with pytest.raises(ValueError, match="seed"):
        dt_random.manual_seed(-1)
    return messages


def test_refusals(run_on_ranks) -> None:
    run_on_ranks(check_refusals, world_size=2)


def check_backend_route() -> int:
    """The entry a backend calls with the op's arguments (``op_entry.dispatch_op``, below
    autograd; ``dispatch_explicit``, above it) gives the explicit function's values."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    shape = (7, 5)
    (want,) = _expected(shape, ["normal_"])
    for entry in (op_entry.dispatch_op, op_entry.dispatch_explicit):
        dt_random.manual_seed(SEED)
        x = DTensor.from_local(p.zeros(_local_shape(shape, [Shard(1)], mesh), p.dtype("float32")), mesh, [Shard(1)],
                               shape=shape)
        with op_entry.recorded_rules() as seen:
            assert entry("normal", [x], lambda local: local, {"mean": 0.5, "std": 0.02}, inplace=0) is x
        assert seen == ["normal"]
        np.testing.assert_array_equal(p.to_numpy(x.full_tensor()), want)
    return 2


def test_backend_route(run_on_ranks) -> None:
    assert run_on_ranks(check_backend_route, world_size=2) == [2, 2]


def test_stream_entered_at_any_offset() -> None:
    """Any box of the index space equals the same box of the whole draw (no ranks: the
    generator alone), across chunk boundaries of the stream (offsets not multiples of 4)."""
    state = philox.RngState(7, 12)
    shape = (5, 7, 3)
    for kind, params in (("normal", {"mean": 0.0, "std": 1.0}), ("uniform", {"low": 0.0, "high": 1.0})):
        whole = philox.draw(kind, params, state, shape, (0, 0, 0), shape, np.dtype(np.float64))
        for offsets, lengths in (((1, 2, 1), (3, 4, 2)), ((4, 0, 0), (1, 7, 3)), ((0, 6, 2), (5, 1, 1))):
            piece = philox.draw(kind, params, state, shape, offsets, lengths, np.dtype(np.float64))
            box = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
            np.testing.assert_array_equal(piece, whole[box])


def _refused(call: object, text: str) -> bool:
    """Whether ``call()`` raises a RuntimeError containing ``text``."""
    try:
        call()  # type: ignore[operator]
    except RuntimeError as err:
        return text in str(err)
    return False


def _as_on_replicate(call: object, make: object, shard: object) -> bool:
    """``call`` on a DTensor of ``shard`` keeps the placement and gives, whole, what the
    same call on a ``Replicate`` one gives (after the same seed), not a constant."""
    got = []
    for placement in (shard, Replicate()):
        dt_random.manual_seed(SEED)
        y = call(make(placement))  # type: ignore[operator]
        assert tuple(y.placements) == (placement,), y.placements
        got.append(np.asarray(get_platform().to_numpy(y.full_tensor())))
    return bool(np.array_equal(got[0], got[1])) and len(np.unique(got[0])) > 1


def check_torch_init() -> dict[str, bool]:
    """``torch.nn.init`` on a ``Shard(0)`` DTensor parameter (uneven: 7 rows over 2 ranks)
    against the same call on a ``Replicate`` one (the whole tensor on each rank); likewise
    ``rand_like``, ``randn_like`` and ``F.dropout``; other draws refused."""
    import torch

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    out = {}
    for fn, kwargs in ((torch.nn.init.normal_, {"mean": 0.1, "std": 0.02}), (torch.nn.init.uniform_, {"a": -1, "b": 1}),
                       (torch.nn.init.trunc_normal_, {"std": 0.02})):
        dt_random.manual_seed(SEED)
        w = torch.nn.Parameter(DTensor.from_local(torch.zeros(_local_shape((7, 5), [Shard(0)], mesh)), mesh,
                                                  [Shard(0)], shape=(7, 5)))
        fn(w, **kwargs)
        dt_random.manual_seed(SEED)
        whole = DTensor.from_local(torch.zeros(7, 5), mesh, [Replicate()])
        fn(whole, **kwargs)
        out[fn.__name__] = bool(torch.equal(w.detach().full_tensor(), whole.full_tensor()))
    # the out-of-place draws and torch's dropout (bernoulli_ inside) on Shard(1), uneven
    # (5 columns over 2 ranks), against the same call on the whole tensor
    def make(placement: object) -> DTensor:
        return DTensor.from_local(torch.ones(_local_shape((7, 5), [placement], mesh)), mesh, [placement],
                                  shape=(7, 5))

    for name, fn in (("rand_like", torch.rand_like), ("randn_like", torch.randn_like),
                     ("F.dropout", lambda t: torch.nn.functional.dropout(t, 0.3, True))):
        out[name] = _as_on_replicate(fn, make, Shard(1))
    # a draw without a layout-invariant rule is refused, never drawn from each rank's generator
    out["poisson refused"] = _refused(lambda: torch.poisson(make(Shard(0))), "draws from torch's generator")
    return out


@pytest.mark.skipif(not os.environ.get("HYPER_PARALLEL_PLATFORM", "torch").startswith("torch"),
                    reason="torch.nn.init is torch's")
def test_torch_nn_init_on_dtensors(run_on_ranks) -> None:
    results = run_on_ranks(check_torch_init, world_size=2)
    assert all(all(r.values()) for r in results), results


def test_chunked_draw_equals_one_call(monkeypatch) -> None:
    """A run longer than the generator's chunk is drawn in several calls, each entering the
    stream at its own position: the same values as one call."""
    state = philox.RngState(3, 4)
    shape = (4, 9)
    whole = philox.draw("normal", {"mean": 0.0, "std": 1.0}, state, shape, (0, 0), shape, np.dtype(np.float64))
    monkeypatch.setattr(philox, "_CHUNK", 5)
    chunked = philox.draw("normal", {"mean": 0.0, "std": 1.0}, state, shape, (1, 0), (3, 9), np.dtype(np.float64))
    np.testing.assert_array_equal(chunked, whole[1:])


def check_mindspore_draws() -> dict[str, bool]:
    """MindSpore's own random calls on DTensors (``Shard(1)``, 5 columns over 2 ranks:
    uneven) draw from core's stream: ``Tensor.normal_`` / ``uniform_`` / ``bernoulli_``
    equal numpy's whole-tensor values (so torch's ``nn.init`` calls agree bitwise), the
    ``*_like`` draws and both dropouts equal the same call on a ``Replicate`` DTensor;
    generator draws without such a route are refused by name."""
    from mindspore import mint, ops

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    shape, out = (7, 5), {}

    def make(placement: object, value: float = 0.0) -> DTensor:
        local = p.from_numpy(np.full(_local_shape(shape, [placement], mesh), value, np.float32))
        return DTensor.from_local(local, mesh, [placement], shape=shape)

    for name, call, (kind, params) in (
            ("normal_", lambda t: t.normal_(0.5, 0.02), ("normal", {"mean": 0.5, "std": 0.02})),
            ("uniform_", lambda t: t.uniform_(-0.1, 0.3), ("uniform", {"low": -0.1, "high": 0.3})),
            ("bernoulli_", lambda t: t.bernoulli_(0.3), ("bernoulli", {"p": 0.3}))):
        want = philox.draw(kind, params, philox.RngState(SEED), shape, (0, 0), shape, np.dtype(np.float32))
        dt_random.manual_seed(SEED)
        x = make(Shard(1))
        y = call(x)
        out[name] = y is x and bool(np.array_equal(p.to_numpy(x.full_tensor()), want))
    for name, call in (("rand_like", mint.rand_like), ("randn_like", mint.randn_like),
                       ("ops.dropout", lambda t: ops.dropout(t, 0.3)),
                       ("mint dropout", lambda t: mint.nn.functional.dropout(t, 0.3, True))):
        out[name] = _as_on_replicate(call, lambda placement: make(placement, 1.0), Shard(1))
    for name, call in (("mint.bernoulli", mint.bernoulli), ("mint.normal", lambda t: mint.normal(t, 1.0))):
        out[f"{name} refused"] = _refused(lambda: call(make(Shard(0), 0.5)), "draws from MindSpore's generator")
    return out


@pytest.mark.skipif(not os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                    reason="MindSpore's own random calls")
def test_mindspore_draws_on_dtensors(run_on_ranks) -> None:
    results = run_on_ranks(check_mindspore_draws, world_size=2)
    assert all(all(r.values()) for r in results), results
