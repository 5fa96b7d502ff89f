"""MindSpore's delayed initialisation under fully_shard, as MindFormers' trainer does it:
the Cell built and fully_shard applied under ``mindspore.DeviceCtx("meta")`` (the shards
are meta DTensor parameters), then ``Cell.to_empty(device=...)``, whose ``empty_like`` of
each parameter is a "like" op (same spec, this rank's local shape, no communication, no
read of the meta values); then values written into the local pieces, and training
gradients as without meta. 2 ranks, an uneven chunk (5 rows). MindSpore only.

On MindSpore 2.10 CPU, ``to_empty()`` without ``device`` keeps a meta tensor meta
(``empty_like(meta, device=None)``), so the device is named here."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, init_device_mesh
from hyper_parallel.core.dtensor.layout import Layout
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.platform import get_platform

pytestmark = pytest.mark.skipif(not os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="mindspore.DeviceCtx and Cell.to_empty are MindSpore's")


def _cell():
    import mindspore as ms
    from mindspore import mint, nn

    class Cell(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = ms.Parameter(mint.empty((5, 4), dtype=ms.float32), name="w1")
            self.w2 = ms.Parameter(mint.empty((3, 5), dtype=ms.float32), name="w2")

        def construct(self, x):
            return mint.matmul(mint.matmul(x, self.w1.T), self.w2.T)

    return Cell()


def check_meta_then_to_empty() -> list:
    import mindspore as ms

    p = get_platform()
    rng = np.random.default_rng(0)
    values = {"w1": rng.standard_normal((5, 4)).astype(np.float32),
              "w2": rng.standard_normal((3, 5)).astype(np.float32)}
    x = ms.Tensor(rng.standard_normal((2, 4)).astype(np.float32))
    mesh = init_device_mesh(p.device_type, (p.world_size(),))
    with ms.DeviceCtx("meta"):
        cell = _cell()
        fully_shard(cell, mesh=mesh)
    params = dict(cell.parameters_and_names())
    assert all(isinstance(q, DTensor) and q.is_meta for q in params.values())
    cell.to_empty(device="CPU")
    shapes = []
    for name, q in params.items():
        assert isinstance(q, DTensor) and not q.is_meta, name
        area = Layout.of(q.device_mesh, q.placements, q.shape).slice_area(p.rank())
        q.to_local().copy_(ms.Tensor(values[name][tuple(slice(b, e) for b, e in area)]))
        shapes.append((name, tuple(q.shape), tuple(q.to_local().shape), [str(pl) for pl in q.placements]))
    empty = ms.mint.empty_like(params["w1"])  # a like op on a real DTensor: spec kept, no values read
    assert isinstance(empty, DTensor) and empty.placements == params["w1"].placements
    assert tuple(empty.to_local().shape) == tuple(params["w1"].to_local().shape)

    def loss_fn(inp):
        return (cell(inp) ** 2).sum()

    loss, grads = ms.value_and_grad(loss_fn, None, weights=list(params.values()))(x)
    xn = x.asnumpy()
    hidden = xn @ values["w1"].T
    y = hidden @ values["w2"].T
    np.testing.assert_allclose(float(loss.asnumpy()), float((y ** 2).sum()), rtol=1e-5)
    # AVG over the 2 ranks of the same batch: the one-process gradient
    want = {"w2": (2 * y).T @ hidden, "w1": ((2 * y) @ values["w2"]).T @ xn}
    for (name, q), grad in zip(params.items(), grads):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        area = Layout.of(q.device_mesh, q.placements, q.shape).slice_area(p.rank())
        np.testing.assert_allclose(local.asnumpy(), want[name][tuple(slice(b, e) for b, e in area)], rtol=1e-4,
                                   atol=1e-5, err_msg=name)
    return shapes


def test_meta_then_to_empty(run_on_ranks) -> None:
    shapes = run_on_ranks(check_meta_then_to_empty, world_size=2)
    assert shapes[0] == [("w1", (5, 4), (3, 4), ["Shard(dim=0)"]), ("w2", (3, 5), (2, 5), ["Shard(dim=0)"])]
    assert shapes[1] == [("w1", (5, 4), (2, 4), ["Shard(dim=0)"]), ("w2", (3, 5), (1, 5), ["Shard(dim=0)"])]
