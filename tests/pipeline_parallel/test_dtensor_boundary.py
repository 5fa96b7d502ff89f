"""DTensors crossing a stage boundary ([Note: DTensors between stages] in
``core/pipeline_parallel/boundary.py``): 4 ranks as a ``(pp 2, tp 2)`` mesh, stage 0 hands
stage 1 its output as a DTensor on its tp submesh, ``Replicate`` or ``Shard(0)`` (the
batch rows split over tp, as sequence parallelism splits the sequence), 1F1B with the loss
inside the last stage, 2 microbatches. Stage 1 receives a DTensor with the same placements
and global shape on *its own* tp mesh (the ranks shifted along the pipeline, found from
its ``mesh=`` root), gathers it and computes the loss; the gradients return through the
pieces. Against the unpipelined chain: stage 1's gradients on every rank; stage 0's on
every rank (``Replicate``) or summed over the tp ranks, each of which saw its rows
(``Shard(0)``). float32, summation order differs: rtol/atol 1e-5."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hyper_parallel import DTensor, init_device_mesh
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.core.pipeline_parallel import Schedule1F1B
from hyper_parallel.platform import get_platform
from tests.pipeline_parallel._models import DIM, build_loss_stage, layer_weights
from tests.pipeline_parallel.test_loss_in_stage import ScaledStage
from tests.pipeline_parallel.test_runtime import BATCH, TOL, _reference

MICROBATCHES = 2


def check_boundary(placement: str) -> dict[str, Any]:
    p = get_platform()
    world = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("pp", "tp"))
    pp_index, tp_index = world.get_coordinate()
    tp_mesh = world["tp"]
    weights = layer_weights(2, seed=13)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    seen: list[Any] = []

    def hand_over(out: Any) -> Any:
        if placement == "replicate":
            return DTensor.from_local(out, tp_mesh, (Replicate(),))
        rows = out.shape[0] // 2
        return DTensor.from_local(p.narrow(out, 0, tp_index * rows, rows), tp_mesh, (Shard(0),))

    def take(dt: Any) -> Any:
        seen.append((type(dt).__name__, tuple(dt.placements), tuple(dt.shape), tuple(dt.device_mesh.mesh.tolist())))
        return dt.full_tensor()

    last = pp_index == 1
    module = build_loss_stage(p, weights[pp_index:pp_index + 1], last, wrap=None if last else hand_over,
                              prepare=take if last else None)
    stage = ScaledStage(module, pp_index, stage_num=2, mesh=world["pp"])
    stage.loss_scale = 1.0 / MICROBATCHES
    outs = Schedule1F1B([stage], MICROBATCHES).run(p.from_numpy(x), target=p.from_numpy(y))
    grads = {name: p.to_numpy(g) for name, g in stage.param_grads().items()}
    return {"pp": pp_index, "tp": tp_index, "seen": seen, "grads": grads,
            "losses": [float(p.to_numpy(out[0])) for out in outs]}


@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_dtensor_between_stages(run_on_ranks, placement: str) -> None:
    ranks = run_on_ranks(check_boundary, placement, world_size=4, timeout_s=300)
    p = get_platform()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    _, ref_losses, ref_grads = _reference(p, layer_weights(2, seed=13), x, y, MICROBATCHES)
    want = (Replicate(),) if placement == "replicate" else (Shard(0),)
    rows = BATCH // MICROBATCHES
    stage0 = [r for r in ranks if r["pp"] == 0]
    for r in ranks:
        if r["pp"] == 1:
            # stage 1 saw a DTensor of the global microbatch shape on its own tp ranks (2, 3)
            assert {s[1:] for s in r["seen"]} == {(want, (rows, DIM), (2, 3))}, r["seen"]
            np.testing.assert_allclose(r["losses"], ref_losses, **TOL)
            for j, leaf in enumerate(("weight", "bias")):
                np.testing.assert_allclose(r["grads"][f"chain.layers.0.{leaf}"], ref_grads[2 + j], **TOL)
    for j, leaf in enumerate(("weight", "bias")):
        got = [r["grads"][f"chain.layers.0.{leaf}"] for r in stage0]
        if placement == "replicate":
            for g in got:
                np.testing.assert_allclose(g, ref_grads[j], **TOL)
        else:  # each tp rank of stage 0 produced (and got the gradient of) its half of the rows
            np.testing.assert_allclose(got[0] + got[1], ref_grads[j], **TOL)
            assert not np.allclose(got[0], ref_grads[j], **TOL)
