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


#: op -> (numpy on the whole arrays, the op on DTensors), both taking (inputs, params)
IMPLEMENTATIONS = {
    "add": (lambda v, _: v[0] + v[1], lambda d, _: d[0] + d[1]),
    "mul": (lambda v, _: v[0] * v[1], lambda d, _: d[0] * d[1]),
    "matmul": (lambda v, _: v[0] @ v[1], lambda d, _: d[0] @ d[1]),
    "linear": (lambda v, _: v[0] @ v[1].T + v[2], lambda d, _: F.linear(*d)),
    "sum": (lambda v, a: v[0].sum(a["dim"], keepdims=a["keepdim"]),
            lambda d, a: d[0].sum(a["dim"], keepdim=a["keepdim"])),
    "mean": (lambda v, a: v[0].mean(a["dim"], keepdims=a["keepdim"]),
             lambda d, a: d[0].mean(a["dim"], keepdim=a["keepdim"])),
    "softmax": (lambda v, a: _softmax(v[0], a["dim"]), lambda d, a: F.softmax(d[0], a["dim"])),
    "transpose": (lambda v, a: np.swapaxes(v[0], *a["dims"]), lambda d, a: d[0].transpose(*a["dims"])),
    "reshape": (lambda v, a: v[0].reshape(a["shape"]), lambda d, a: d[0].reshape(*a["shape"])),
}
assert set(IMPLEMENTATIONS) == set(OPS)


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
        reference, on_dtensors = IMPLEMENTATIONS[op]
        out = on_dtensors(dts, params)
        np.testing.assert_allclose(p.to_numpy(out.full_tensor()), reference(values, params), rtol=tol, atol=tol,
                                   err_msg=f"{op} {params} of {shapes} placed {placements} on {mesh_shape}")


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_ops_match_numpy(run_on_ranks, case) -> None:
    run_on_ranks(check_batch, *case, world_size=4)
