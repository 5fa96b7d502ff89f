"""The parameters fully_shard and tensor parallelism make are DTensors of the global shape,
and the frameworks' own tools read them as whole tensors: torch's ``state_dict`` and
``clip_grad_norm_`` (and ``hp.clip_grads_by_global_norm`` on MindSpore, whose
``value_and_grad`` returns local pieces), with the frameworks' own AdamW, over several
clipped steps against one process: fully_shard over 4 ranks (uneven: 7 and 6 rows),
tensor parallelism over 4, and tp 2 x fully_shard 2.

The reference clips with the framework's own single-process function (torch
``clip_grad_norm_``, MindSpore ``ops.clip_by_global_norm``), so a norm taken over this
rank's pieces only (the bug this replaces: 4-38% off) fails the per-step norm check.

Tolerance: rtol 2e-4 / atol 2e-5 on parameters, 1e-5 relative on norms (float32): the
sharded GEMMs and the data-parallel gradient sums add in other orders than the
full-batch GEMMs, a few ulps that Adam keeps relative; a piece-only norm is off by
O(1%)."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, clip_grads_by_global_norm, init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.core.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hyper_parallel.platform import get_platform
from tests.tensor_parallel._models import build, weights

STEPS = 3
MAX_NORM = 0.05  # below every step's norm: each step clips
TOL = dict(rtol=2e-4, atol=2e-5)
PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def _data(step: int) -> np.ndarray:
    return np.random.default_rng(40 + step).standard_normal((4, 3, 6)).astype(np.float32)  # [batch, seq, dim]


class _Loop:
    """Forward, backward, clip to ``MAX_NORM``, AdamW step, with each framework's own tools."""

    def __init__(self, p, model, reference: bool) -> None:
        self.p, self.model, self.reference = p, model, reference
        self.params = [param for _, param in p.named_parameters(model)]
        if p.framework == "torch":
            import torch

            self.opt = torch.optim.AdamW(self.params, lr=0.02, weight_decay=0.1)
        else:
            import mindspore as ms
            from mindspore.experimental.optim import AdamW

            self.opt = AdamW(self.params, lr=0.02, weight_decay=0.1)
            self.grad_fn = ms.value_and_grad(lambda x: (self.model(x) ** 2).mean(), None, weights=self.params)

    def step(self, x: np.ndarray) -> float:
        """One step on this rank's batch ``x``; returns the gradient norm before clipping."""
        p = self.p
        if p.framework == "torch":
            import torch

            (self.model(p.from_numpy(x)) ** 2).mean().backward()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
            self.opt.step()
            self.opt.zero_grad()
            # a DTensor (Replicate) for DTensor parameters: the same value on every rank
            return float(p.to_numpy(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        from mindspore import ops

        _, grads = self.grad_fn(p.from_numpy(x))
        if self.reference:
            norm = float(np.sqrt(sum(float((p.to_numpy(g).astype(np.float64) ** 2).sum()) for g in grads)))
            grads = ops.clip_by_global_norm(grads, MAX_NORM)
        else:
            grads, total = clip_grads_by_global_norm(self.params, grads, MAX_NORM)
            norm = float(p.to_numpy(total))
        self.opt(tuple(grads))
        return norm


def _layout(p, layout: str):
    """``(model, rows of the batch this rank takes)`` for ``layout``."""
    model = build(p, "mlp", weights("mlp"))
    n, r = p.world_size(), p.rank()
    if layout == "fsdp4":
        mesh = init_device_mesh(p.device_type, (n,))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, slice(r, r + 1)
    if layout == "tp4":
        parallelize_module(model, init_device_mesh(p.device_type, (n,)), PLAN)
        return model, slice(0, 4)
    mesh = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], PLAN)
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh.get_local_rank("dp")
    return model, slice(2 * dp, 2 * dp + 2)


def check_dtensor_parameters(layout: str) -> None:
    p = get_platform()
    values = weights("mlp")
    ref = _Loop(p, build(p, "mlp", values), reference=True)
    ref_norms = [ref.step(_data(step)) for step in range(STEPS)]
    assert min(ref_norms) > MAX_NORM, ref_norms  # every step clips
    ref_params = {name: p.to_numpy(param) for name, param in p.named_parameters(ref.model)}

    model, rows = _layout(p, layout)
    for name, param in p.named_parameters(model):
        assert isinstance(param, DTensor) and tuple(param.shape) == values[name].shape, (layout, name, param.shape)
        np.testing.assert_array_equal(p.to_numpy(param.full_tensor()), values[name], err_msg=f"{layout}: {name}")
    if p.framework == "torch":
        # what DCP and torch's state-dict helpers read: DTensors of the global shapes, no padding
        state = model.state_dict()
        assert sorted(state) == sorted(values), sorted(state)
        assert all(isinstance(v, DTensor) and tuple(v.shape) == values[k].shape for k, v in state.items()), \
            {k: (type(v).__name__, tuple(v.shape)) for k, v in state.items()}
    loop = _Loop(p, model, reference=False)
    norms = [loop.step(_data(step)[rows]) for step in range(STEPS)]
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5, err_msg=f"{layout}: gradient norms before clipping")
    for name, param in p.named_parameters(model):
        np.testing.assert_allclose(p.to_numpy(param.full_tensor()), ref_params[name], **TOL,
                                   err_msg=f"{layout}: {name} after {STEPS} clipped AdamW steps")


@pytest.mark.parametrize("layout", ["fsdp4", "tp4", "tp2_fsdp2"])
def test_dtensor_parameters_with_framework_tools(run_on_ranks, layout: str) -> None:
    run_on_ranks(check_dtensor_parameters, layout, world_size=4)
