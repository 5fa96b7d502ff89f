"""Property tests: for random meshes, tensor shapes (uneven and size-1 dims included) and
input placements, an op on DTensors gives ``full_tensor()`` equal to numpy's answer on
the whole tensors.

Hypothesis draws a batch of cases per example, and each batch runs in one call on the
ranks (a call costs seconds on MindSpore).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from hyper_parallel.core.dtensor import functional as F
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import expected_local

MESH_SHAPES = [(4,), (2, 2), (1, 4)]
OPS = ("add", "mul", "matmul", "linear", "sum", "mean", "softmax", "transpose", "reshape")


def _softmax(x: np.ndarray, dim: int) -> np.ndarray:
    e = np.exp(x - x.max(dim, keepdims=True))
    return e / e.sum(dim, keepdims=True)


def _sizes(draw, count: int) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 7), min_size=count, max_size=count)))


@st.composite
def op_case(draw):
    """``(op, shapes, params)``; params hold the op's non-tensor arguments."""
    op = draw(st.sampled_from(OPS))
    if op in ("add", "mul"):
        out = _sizes(draw, draw(st.integers(1, 3)))
        other = tuple(draw(st.sampled_from([s, 1])) for s in out[draw(st.integers(0, len(out) - 1)):])
        return op, (out, other), {}
    if op == "matmul":
        m, k, n = _sizes(draw, 3)
        batch = _sizes(draw, draw(st.integers(0, 1)))
        return op, (batch + (m, k), (k, n)), {}
    if op == "linear":
        lead, k, n = _sizes(draw, draw(st.integers(1, 2))), *_sizes(draw, 2)
        return op, (lead + (k,), (n, k), (n,)), {}
    shape = _sizes(draw, draw(st.integers(1, 3)))
    if op in ("sum", "mean"):
        dims = tuple(sorted(set(draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape))))))
        return op, (shape,), {"dim": dims, "keepdim": draw(st.booleans())}
    if op == "softmax":
        return op, (shape,), {"dim": draw(st.integers(0, len(shape) - 1))}
    if op == "transpose":
        return op, (shape,), {"dims": (draw(st.integers(0, len(shape) - 1)), draw(st.integers(0, len(shape) - 1)))}
    # reshape: merge two neighbouring dims, or split one in two
    if len(shape) >= 2 and draw(st.booleans()):
        d = draw(st.integers(0, len(shape) - 2))
        return op, (shape,), {"shape": shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:]}
    d = draw(st.integers(0, len(shape) - 1))
    factor = draw(st.integers(1, 3))
    return op, (shape[:d] + (shape[d] * factor,) + shape[d + 1:],), {"shape": shape[:d] + (shape[d], factor) + shape[d + 1:]}


@st.composite
def cases(draw):
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    batch = []
    for _ in range(6):
        op, shapes, params = draw(op_case())
        placements = []
        for shape in shapes:
            one = st.one_of(st.builds(Shard, st.integers(0, len(shape) - 1)), st.just(Replicate()),
                            st.just(Partial("sum")))
            placements.append(tuple(draw(st.lists(one, min_size=len(mesh_shape), max_size=len(mesh_shape)))))
        batch.append((op, shapes, params, tuple(placements)))
    return mesh_shape, batch


def _reference(op: str, values: list[np.ndarray], params: dict) -> np.ndarray:
    if op == "add":
        return values[0] + values[1]
    if op == "mul":
        return values[0] * values[1]
    if op == "matmul":
        return values[0] @ values[1]
    if op == "linear":
        return values[0] @ values[1].T + values[2]
    if op == "sum":
        return values[0].sum(params["dim"], keepdims=params["keepdim"])
    if op == "mean":
        return values[0].mean(params["dim"], keepdims=params["keepdim"])
    if op == "softmax":
        return _softmax(values[0], params["dim"])
    if op == "transpose":
        return np.swapaxes(values[0], *params["dims"])
    return values[0].reshape(params["shape"])


def _run(op: str, dts: list, params: dict):
    if op == "add":
        return dts[0] + dts[1]
    if op == "mul":
        return dts[0] * dts[1]
    if op == "matmul":
        return dts[0] @ dts[1]
    if op == "linear":
        return F.linear(*dts)
    if op == "sum":
        return dts[0].sum(params["dim"], keepdim=params["keepdim"])
    if op == "mean":
        return dts[0].mean(params["dim"], keepdim=params["keepdim"])
    if op == "softmax":
        return F.softmax(dts[0], params["dim"])
    if op == "transpose":
        return dts[0].transpose(*params["dims"])
    return dts[0].reshape(*params["shape"])


def check_batch(mesh_shape, batch) -> None:
    p = get_platform()
    # MindSpore's CPU softmax and exp are approximate (see test_ops.py); torch is exact
    # up to summation order.
    tol = 1e-5 if p.framework == "mindspore" else 1e-9
    mesh = init_device_mesh(p.device_type, mesh_shape)
    rng = np.random.default_rng(5)
    for op, shapes, params, placements in batch:
        values = [rng.standard_normal(shape) for shape in shapes]
        dts = [DTensor.from_local(p.from_numpy(expected_local(v, pl, mesh_shape, mesh.get_coordinate())), mesh, pl,
                                  shape=v.shape) for v, pl in zip(values, placements)]
        out = _run(op, dts, params)
        np.testing.assert_allclose(p.to_numpy(out.full_tensor()), _reference(op, values, params), rtol=tol, atol=tol,
                                   err_msg=f"{op} {params} of {shapes} placed {placements} on {mesh_shape}")


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_ops_match_numpy(run_on_ranks, case) -> None:
    run_on_ranks(check_batch, *case, world_size=4)
