"""DTensor redistribution: every pair of placements, forward values and gradients against
the single-process tensor, on 1-D meshes (world 2 and 4) and a 2x2 mesh, even and uneven
shapes (7x5 over 4 ranks leaves the last shard short; 3x5 on 2x2 leaves one empty).

Float64 data keeps the comparisons near machine precision; the tolerance (1e-12) only
absorbs the different summation orders of Partial reductions.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, init_device_mesh
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import (PAVG, PMAX, PMIN, PSUM, S0, S1, R, chunk, expected_local, grad_local,
                                      placement_lists)


ALL_OPS = (S0, S1, R, PSUM, PAVG, PMAX, PMIN)
#: On 2x2 the even shape sweeps every kind of Partial; the uneven shapes sweep the
#: shard/replicate/sum combinations (each extra op multiplies the pairs; the other
#: reductions' per-axis transforms are swept on the 1-D meshes). MindSpore's emulated
#: CPU collectives make each pair cost ~0.3 s there.
OPS_2D_FULL = (S0, S1, R, PSUM, PAVG, PMAX)
OPS_2D_CORE = (S0, S1, R, PSUM)


def _pairs(mesh_ndim: int, ops: tuple = ALL_OPS):
    lists = placement_lists(mesh_ndim, ops)
    return [(src, dst) for src in lists for dst in lists]


def check_all_pairs(mesh_shape: tuple[int, ...], shape: tuple[int, ...], ops: tuple = ALL_OPS) -> int:
    p = get_platform()
    mesh = init_device_mesh(p.device_type, mesh_shape)
    coordinate = mesh.get_coordinate()
    rng = np.random.default_rng(0)
    value = rng.standard_normal(shape)
    weight = rng.standard_normal(shape)
    checked = 0
    for src, dst in _pairs(len(mesh_shape), ops):
        where = f"{list(src)} -> {list(dst)} on mesh {mesh_shape}, shape {shape}"
        src_local = expected_local(value, src, mesh_shape, coordinate)
        out = DTensor.from_local(p.from_numpy(src_local), mesh, src, shape=shape).redistribute(mesh, dst)
        assert out.placements == dst and out.shape == shape, where
        dst_local = expected_local(value, dst, mesh_shape, coordinate)
        assert tuple(out.to_local().shape) == dst_local.shape, f"{where}: local shape {tuple(out.to_local().shape)}"
        if not any(pl.is_partial() for pl in dst):
            np.testing.assert_allclose(p.to_numpy(out.to_local()), dst_local, rtol=1e-12, atol=1e-12, err_msg=where)
        np.testing.assert_allclose(p.to_numpy(out.full_tensor()), value, rtol=1e-12, atol=1e-12, err_msg=where)

        def fn(local, src=src, dst=dst):
            return DTensor.from_local(local, mesh, src, shape=shape).redistribute(mesh, dst).to_local()

        _, backward = p.vjp(fn, [p.from_numpy(src_local)])
        grad_out = p.from_numpy(grad_local(weight, dst, mesh_shape, coordinate))
        reduces_max_min = any(a != b and (a in (PMAX, PMIN) or b in (PMAX, PMIN)) for a, b in zip(src, dst))
        if reduces_max_min:
            try:
                backward([grad_out])
            except RuntimeError as err:
                assert "has no gradient" in str(err), f"{where}: {err}"
            else:
                raise AssertionError(f"{where}: a max/min reduction produced a gradient")
        else:
            (grad,), _ = backward([grad_out])
            np.testing.assert_allclose(p.to_numpy(grad), grad_local(weight, src, mesh_shape, coordinate),
                                       rtol=1e-12, atol=1e-12, err_msg=f"{where}: gradient")
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("shape", [(8, 6), (7, 5)], ids=["even", "uneven"])
def test_all_pairs_1d(run_on_ranks, world_size: int, shape: tuple[int, int]) -> None:
    counts = run_on_ranks(check_all_pairs, (world_size,), shape, world_size=world_size)
    assert counts == [len(_pairs(1))] * world_size


@pytest.mark.parametrize("shape,ops", [((8, 6), OPS_2D_FULL), ((7, 5), OPS_2D_CORE), ((3, 5), OPS_2D_CORE)],
                         ids=["even", "uneven", "empty_shard"])
def test_all_pairs_2x2(run_on_ranks, shape: tuple[int, int], ops: tuple) -> None:
    counts = run_on_ranks(check_all_pairs, (2, 2), shape, ops, world_size=4, timeout_s=600)
    assert counts == [len(_pairs(2, ops))] * 4


def test_world_one(run_on_ranks) -> None:
    assert run_on_ranks(check_all_pairs, (1,), (3, 4), world_size=1) == [len(_pairs(1))]


def check_to_local_grad_placements(shape: tuple[int, int]) -> None:
    """Column-parallel matmul by hand: x is replicated, each rank multiplies it by its rows
    of W; x's gradient arrives as Partial and ``to_local(grad_placements=[Partial()])``
    all-reduces it into G @ W, the single-process gradient."""
    p = get_platform()
    n, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (n,))
    rng = np.random.default_rng(3)
    out_features, in_features = shape
    x, w = rng.standard_normal((4, in_features)), rng.standard_normal((out_features, in_features))
    g = rng.standard_normal((4, out_features))
    start, length = chunk(out_features, n, r)
    w_local = w[start:start + length]

    def fn(x_local):
        x_dt = DTensor.from_local(x_local, mesh, [R])
        return x_dt.to_local(grad_placements=[PSUM]) @ p.from_numpy(w_local).transpose(0, 1)

    out, backward = p.vjp(fn, [p.from_numpy(x)])
    np.testing.assert_allclose(p.to_numpy(out), x @ w_local.T, rtol=1e-12)
    (grad,), _ = backward([p.from_numpy(np.ascontiguousarray(g[:, start:start + length]))])
    np.testing.assert_allclose(p.to_numpy(grad), g @ w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_to_local_grad_placements(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_to_local_grad_placements, (7, 5), world_size=world_size)
