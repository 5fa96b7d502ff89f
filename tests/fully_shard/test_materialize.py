"""Delayed initialisation: a model built on the meta device (torch ``torch.device("meta")``,
MindSpore ``mindspore.DeviceCtx("meta")``), sharded there by fully_shard, then given each
rank's piece by ``materialize`` from a counter-based stream (core's ``philox``: [Note:
random ops on DTensors]), so no rank computes or holds a whole sharded parameter. Checked:
every piece equals its box of the one-process weights bit for bit, the forward and the
gradients equal the one-process model's, and (torch) the largest tensor any op allocates
while building, sharding and materialising under dp-shard 4 is one rank's piece, never a
whole parameter (counted by a dispatch mode over every op's outputs, not timed).

Shapes: ``w1 [1003, 6]`` (1003 rows over 4 ranks: 251, 251, 251, 250; over 2: 502, 501)
and ``w2 [3, 1003]`` (3 rows over 4 ranks: one rank holds none)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, init_device_mesh, philox
from hyper_parallel.core.fully_shard import Box, fully_shard, local_boxes, materialize
from hyper_parallel.platform import get_platform

ON_MINDSPORE = os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore")
SHAPES = {"w1": (1003, 6), "w2": (3, 1003)}
SEED = 11


def _entry(name: str) -> philox.RngState:
    state = philox.RngState(SEED)
    for other, shape in SHAPES.items():
        if other == name:
            return state
        state = state.advanced("normal", int(np.prod(shape)))
    raise KeyError(name)


def piece(fqn: str, box: Box) -> np.ndarray:
    """This box of parameter ``fqn`` (its last name), drawn alone."""
    name = fqn.split(".")[-1]
    return philox.draw("normal", {"mean": 0.0, "std": 0.1}, _entry(name), SHAPES[name], box.starts, box.lengths,
                       np.dtype(np.float32))


def _whole(name: str) -> np.ndarray:
    shape = SHAPES[name]
    return piece(name, Box(shape, (0,) * len(shape), shape))


def _torch_module():
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.empty(SHAPES["w1"]))
            self.w2 = torch.nn.Parameter(torch.empty(SHAPES["w2"]))

        def forward(self, x):
            return (x @ self.w1.T) @ self.w2.T

    return Net()


def _mindspore_module():
    import mindspore as ms
    from mindspore import mint, nn

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = ms.Parameter(mint.empty(SHAPES["w1"], dtype=ms.float32), name="w1")
            self.w2 = ms.Parameter(mint.empty(SHAPES["w2"], dtype=ms.float32), name="w2")

        def construct(self, x):
            return mint.matmul(mint.matmul(x, self.w1.T), self.w2.T)

    return Net()


class _LargestAllocation:
    """A torch dispatch mode: the largest numel of any plain, non-meta tensor an op returns
    (a DTensor wrapper has the global shape and no storage: its local tensor is counted
    where the op that made it ran)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch
                from torch.utils._pytree import tree_flatten

                out = func(*args, **(kwargs or {}))
                for leaf in tree_flatten(out)[0]:
                    if type(leaf) is torch.Tensor and not leaf.is_meta:
                        outer.largest = max(outer.largest, leaf.numel())
                return out

        self.largest = 0
        self.mode = Mode()


def check_materialize() -> dict:
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (p.world_size(),))
    counter = None
    if ON_MINDSPORE:
        import mindspore as ms

        with ms.DeviceCtx("meta"):
            net = _mindspore_module()
            fully_shard(net, mesh=mesh)
        materialize(net, piece)
    else:
        import torch

        counter = _LargestAllocation()
        with counter.mode:
            with torch.device("meta"):
                net = _torch_module()
            fully_shard(net, mesh=mesh)
            materialize(net, piece)
    # every piece is its box of the one-process weights
    boxes = local_boxes(net)
    params = dict(p.named_parameters(net))
    for name, box in boxes.items():
        want = _whole(name)[tuple(slice(s, s + n) for s, n in zip(box.starts, box.lengths))]
        got = p.to_numpy(params[name].to_local())
        np.testing.assert_array_equal(got, want, err_msg=name)
    # forward and gradients against numpy (the same batch on every rank: fully_shard's
    # average of the gradients is the one-process gradient)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6)).astype(np.float32)
    w1, w2 = _whole("w1").astype(np.float64), _whole("w2").astype(np.float64)
    hidden = x @ w1.T
    y = hidden @ w2.T
    want_grads = {"w2": (2 * y).T @ hidden, "w1": ((2 * y) @ w2).T @ x}
    weights = [params["w1"], params["w2"]]

    def loss_fn(inp):
        return (net(inp) ** 2).sum()

    loss, backward = p.vjp(loss_fn, [p.from_numpy(x)], weights)
    np.testing.assert_allclose(float(p.to_numpy(loss)), float((y ** 2).sum()), rtol=1e-5)
    _, grads = backward([p.full((), 1.0, p.dtype("float32"))])
    # Tolerance: float32 GEMMs of 6 and 1003 terms against float64 ones, ~1e-6 relative
    for name, grad in zip(("w1", "w2"), grads):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        box = boxes[name]
        want = want_grads[name][tuple(slice(s, s + n) for s, n in zip(box.starts, box.lengths))]
        np.testing.assert_allclose(p.to_numpy(local), want, rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")
    return {"largest": None if counter is None else counter.largest,
            "pieces": {name: tuple(box.lengths) for name, box in boxes.items()}}


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_build_then_materialize(run_on_ranks, world_size: int) -> None:
    results = run_on_ranks(check_materialize, world_size=world_size, timeout_s=300)
    rows = [-(-1003 // world_size) * 6 for _ in results]
    for rank, result in enumerate(results):
        assert result["pieces"]["w1"][0] < SHAPES["w1"][0], result
        if result["largest"] is not None:
            # no op made a tensor as large as a whole sharded parameter: the largest is a piece
            assert 0 < result["largest"] <= rows[rank] < 1003 * 6, (rank, result)
