"""Schedules built without ``loss_fn`` ([Note: the loss inside the last stage] in
``core/pipeline_parallel/runtime.py``): upstream hyper-parallel's and MindFormers'
convention, where ``run(**batch)`` hands every stage the microbatch's keyword arguments and
the last stage returns its loss, seeded by ``PipelineStage.get_last_stage_sens``.

GPipe, 1F1B and interleaved 1F1B on 2 and 4 ranks: the last stage's per-microbatch
outputs and every parameter gradient against the unpipelined chain on the whole batch
(``test_runtime._reference``), with a stage subclass that scales its seed by
``1 / n_microbatches`` as MindFormers' ``ScaledLossPipelineStage`` does with its
``loss_scale``, or the base stage with ``scale_grads=True``; a non-tensor keyword
(``scale``) reaches every microbatch. float32, summation order differs: rtol/atol 1e-5.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hyper_parallel import DTensor, init_device_mesh
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate
from hyper_parallel.core.pipeline_parallel import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                   ScheduleInterleaved1F1B)
from hyper_parallel.platform import get_platform
from tests.pipeline_parallel._models import DIM, build_loss_stage, layer_weights
from tests.pipeline_parallel.test_runtime import BATCH, TOL, _reference

SCALE = 2.0  # the loss the stages return is SCALE x the mean squared error


class ScaledStage(PipelineStage):
    """Seeds its loss with ``loss_scale``, as MindFormers' ``ScaledLossPipelineStage``."""

    loss_scale = 1.0

    def get_last_stage_sens(self, outputs: Any) -> Any:
        return [seed * self.loss_scale for seed in super().get_last_stage_sens(outputs)]


def _check_seeds(p: Any) -> None:
    mesh = init_device_mesh(p.device_type, (p.world_size(),), mesh_dim_names=("pp",))
    stage = PipelineStage(build_loss_stage(p, layer_weights(1), True), p.rank(), stage_num=p.world_size(),
                          device=p.device_type, mesh=mesh)
    assert stage.mesh is mesh and stage.group == mesh.get_group()
    loss = DTensor.from_local(p.full((), 3.0, p.dtype("float32")), mesh, (Replicate(),))
    (seed,) = stage.get_last_stage_sens((loss,))
    assert isinstance(seed, DTensor) and tuple(seed.placements) == (Replicate(),)
    assert float(p.to_numpy(seed.to_local())) == 1.0
    plain = stage.get_last_stage_sens(p.full((2,), 5.0, p.dtype("float32")))
    np.testing.assert_array_equal(p.to_numpy(plain), [1.0, 1.0])
    with pytest.raises(ValueError, match=r"a Partial loss has no seed of ones"):
        stage.get_last_stage_sens(DTensor.from_local(p.full((), 3.0, p.dtype("float32")), mesh, (Partial(),)))


def check_loss_in_stage(layers_per_stage: int) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    _check_seeds(p)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    m = 4
    for kind in ("gpipe", "1f1b", "interleaved"):
        virtual = 2 if kind == "interleaved" else 1
        num_stages = n * virtual
        weights = layer_weights(num_stages * layers_per_stage, seed=9)
        _, ref_losses, ref_grads = _reference(p, weights, x, y, m)
        cls = PipelineStage if kind == "gpipe" else ScaledStage
        stages = []
        for s in range(r, num_stages, n):
            module = build_loss_stage(p, weights[s * layers_per_stage:(s + 1) * layers_per_stage], s == num_stages - 1)
            stage = cls(module, s, stage_num=num_stages)
            stage.loss_scale = 1.0 / m  # MindFormers: 1 / (data-parallel size x microbatches)
            stages.append(stage)
        if kind == "gpipe":  # the base stage's seed of ones, the schedule scaling by 1 / m
            schedule = ScheduleGPipe(stages, m, scale_grads=True)
        elif kind == "1f1b":
            schedule = Schedule1F1B(stages, m)
        else:
            schedule = ScheduleInterleaved1F1B(stages, m)
        what = f"{kind}, {num_stages} stages, rank {r}"
        # stage 0 takes x positionally; every stage gets the keywords (the last one reads target)
        outs = schedule.run(p.from_numpy(x), target=p.from_numpy(y), scale=SCALE)
        if (num_stages - 1) % n == r:
            assert len(outs) == m and all(isinstance(out, tuple) and len(out) == 1 for out in outs), what
            np.testing.assert_allclose([float(p.to_numpy(out[0])) for out in outs], np.asarray(ref_losses) * SCALE,
                                       **TOL, err_msg=f"{what}: losses")
        else:
            assert outs == [], what
        for stage in stages:
            grads = stage.param_grads()
            for i in range(layers_per_stage):
                layer = stage.stage_index * layers_per_stage + i
                for j, leaf in enumerate(("weight", "bias")):
                    np.testing.assert_allclose(p.to_numpy(grads[f"chain.layers.{i}.{leaf}"]),
                                               SCALE * ref_grads[2 * layer + j], **TOL,
                                               err_msg=f"{what}: gradient of layer {layer} {leaf}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_loss_in_last_stage(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_loss_in_stage, 2 if world_size == 2 else 1, world_size=world_size, timeout_s=300)
