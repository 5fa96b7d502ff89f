"""Property tests: over random mesh shapes, placements and tensor shapes (uneven and empty
shards included), ``redistribute(...).full_tensor()`` is the original tensor, and the
plan is well formed."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from hyper_parallel.core.dtensor.redistribute import redistribute_plan
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import expected_local

MESH_SHAPES = [(4,), (2, 2), (1, 4), (4, 1)]


def _placements(ndim_mesh: int, ndim_tensor: int):
    one = st.one_of(st.builds(Shard, st.integers(0, ndim_tensor - 1)), st.just(Replicate()), st.just(Partial("sum")))
    return st.lists(one, min_size=ndim_mesh, max_size=ndim_mesh).map(tuple)


@st.composite
def cases(draw):
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    src = draw(_placements(len(mesh_shape), len(shape)))
    dst = draw(_placements(len(mesh_shape), len(shape)))
    return mesh_shape, shape, src, dst


@settings(max_examples=200, deadline=None)
@given(cases())
def test_plan_is_well_formed(case) -> None:
    _, _, src, dst = case
    current = list(src)
    for step in redistribute_plan(src, dst):
        assert tuple(current) == step.before and current[step.axis] == step.src and step.src != step.dst
        current[step.axis] = step.dst
    assert tuple(current) == dst


def check_round_trip(mesh_shape, shape, src, dst) -> None:
    p = get_platform()
    mesh = init_device_mesh(p.device_type, mesh_shape)
    value = np.random.default_rng(1).standard_normal(shape)
    local = expected_local(value, src, mesh_shape, mesh.get_coordinate())
    dt = DTensor.from_local(p.from_numpy(local), mesh, src, shape=shape)
    where = f"{list(src)} -> {list(dst)} on {mesh_shape}, shape {shape}"
    np.testing.assert_allclose(p.to_numpy(dt.redistribute(mesh, dst).full_tensor()), value, rtol=1e-12,
                               atol=1e-12, err_msg=where)
    back = dt.redistribute(mesh, dst).redistribute(mesh, src)
    assert tuple(back.to_local().shape) == local.shape, where


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_redistribute_round_trip(run_on_ranks, case) -> None:
    run_on_ranks(check_round_trip, *case, world_size=4)
