"""Pipeline runtime parity: GPipe, 1F1B and interleaved 1F1B (2 virtual stages per
rank; also with OVERLAP_B_F) on 2 and 4 ranks with 4 and 8 microbatches; every microbatch loss, the merged
output and every parameter gradient against the unpipelined chain on the whole batch.

float32: the pipelined gradient sums microbatch gradients where the reference sums over
the whole batch at once, a different summation order: agreement to a few ulps
(rtol/atol 1e-5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hyper_parallel.core.pipeline_parallel import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                   ScheduleInterleaved1F1B)
from hyper_parallel.core.pipeline_parallel.schedules import simulate
from hyper_parallel.platform import get_platform
from tests.pipeline_parallel._models import DIM, build_chain, layer_weights, mse

TOL = dict(rtol=1e-5, atol=1e-5)
BATCH = 16


def _reference(p, weights, x, y, n_microbatches):
    model = build_chain(p, weights)
    params = [param for _, param in p.named_parameters(model)]
    out, backward = p.vjp(lambda t: mse(model(t), p.from_numpy(y)), [p.from_numpy(x)], params)
    _, grads = backward([p.full((), 1.0, out.dtype)])
    full = p.to_numpy(model(p.from_numpy(x)))
    per = BATCH // n_microbatches
    losses = [float(np.mean((full[i * per:(i + 1) * per] - y[i * per:(i + 1) * per]) ** 2))
              for i in range(n_microbatches)]
    return full, losses, [p.to_numpy(g) for g in grads]


def check_step(p: Any, schedule: Any, stages: list, x: np.ndarray, y: np.ndarray, reference: tuple,
               layers_per_stage: int, place: Callable[[int], int], what: str) -> None:
    """One ``step`` of ``schedule``: the output and losses (on the last stage's rank), the
    peak activation count (against the simulator) and every parameter gradient of this
    rank's ``stages`` against ``reference = (output, losses, gradients)``."""
    full, ref_losses, ref_grads = reference
    r, num_stages = p.rank(), stages[0].num_stages
    losses: list = []
    out = schedule.step(p.from_numpy(x), target=p.from_numpy(y), losses=losses)
    if place(num_stages - 1) == r:
        np.testing.assert_allclose(p.to_numpy(out), full, **TOL, err_msg=f"{what}: output")
        np.testing.assert_allclose([float(p.to_numpy(v)) for v in losses], ref_losses, **TOL,
                                   err_msg=f"{what}: losses")
    else:
        assert out is None and losses == [], what
    predicted = simulate(schedule.schedule, num_stages, stage_to_rank=place).peak_activations[r]
    assert schedule.peak_activations == predicted, (what, schedule.peak_activations, predicted)
    for stage in stages:
        grads = stage.param_grads()
        for i in range(layers_per_stage):
            layer = stage.stage_index * layers_per_stage + i
            for j, leaf in enumerate(("weight", "bias")):
                np.testing.assert_allclose(p.to_numpy(grads[f"layers.{i}.{leaf}"]), ref_grads[2 * layer + j],
                                           **TOL, err_msg=f"{what}: gradient of layer {layer} {leaf}")


def check_schedules(layers_per_stage: int) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    for kind in ("gpipe", "1f1b", "interleaved", "overlap"):
        virtual = 2 if kind in ("interleaved", "overlap") else 1
        num_stages = n * virtual
        weights = layer_weights(num_stages * layers_per_stage)
        for n_microbatches in (8,) if kind == "overlap" else (4, 8):
            full, ref_losses, ref_grads = _reference(p, weights, x, y, n_microbatches)
            stages = [PipelineStage(build_chain(p, weights[s * layers_per_stage:(s + 1) * layers_per_stage]), s,
                                    num_stages) for s in range(r, num_stages, n)]
            if kind == "gpipe":
                schedule = ScheduleGPipe(stages[0], n_microbatches, mse)
            elif kind == "1f1b":
                schedule = Schedule1F1B(stages[0], n_microbatches, mse)
            else:  # OVERLAP_B_F on two threads; this chain has no MoE hooks, test_overlap pairs them
                schedule = ScheduleInterleaved1F1B(stages, n_microbatches, mse, overlap_b_f=kind == "overlap")
            what = f"{kind}, {num_stages} stages, {n_microbatches} microbatches, rank {r}"
            # a second step (reusing the inferred shapes) for one configuration: CI time
            for _ in range(2 if (kind, n_microbatches) == ("interleaved", 8) else 1):
                check_step(p, schedule, stages, x, y, (full, ref_losses, ref_grads), layers_per_stage,
                           lambda s: s % n, what)


@pytest.mark.parametrize("world_size", [2, 4])
def test_schedules_match_unpipelined(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_schedules, 2 if world_size == 2 else 1, world_size=world_size, timeout_s=300)


def check_bad_input() -> None:
    p = get_platform()
    chain = build_chain(p, layer_weights(1))
    with pytest.raises(ValueError, match=r"stage_index=2 must be in \[0, num_stages=2\)"):
        PipelineStage(chain, 2, 2)
    stage = PipelineStage(chain, 0, 1)
    with pytest.raises(ValueError, match="one stage per rank, but num_stages=2"):
        ScheduleGPipe(PipelineStage(chain, 0, 2), 2, mse)
    with pytest.raises(TypeError, match="loss_fn='mse' is not callable"):
        Schedule1F1B(stage, 2, "mse")
    with pytest.raises(TypeError, match="has no loss_fn .* call run"):
        Schedule1F1B(stage, 2).step(p.from_numpy(np.zeros((2, DIM), np.float32)))
    with pytest.raises(TypeError, match="has a loss_fn; call step"):
        Schedule1F1B(stage, 2, mse).run(p.from_numpy(np.zeros((2, DIM), np.float32)))
    with pytest.raises(ValueError, match=r"give the number of stages once, as num_stages \(got 2\) or as stage_num"):
        PipelineStage(chain, 0, 2, stage_num=2)
    with pytest.raises(ValueError, match="device='gpu' is not a device of this platform"):
        PipelineStage(chain, 0, stage_num=1, device="gpu")
    with pytest.raises(ValueError, match="n_microbatches=0 must both be >= 1"):
        Schedule1F1B(stage, 0, mse)
    schedule = ScheduleGPipe(stage, 4, mse)
    x = p.from_numpy(np.zeros((6, DIM), np.float32))
    with pytest.raises(ValueError, match="batch size 6 \\(dim 0\\), not divisible by n_microbatches=4"):
        schedule.step(x, target=x)
    with pytest.raises(ValueError, match="runs the last stage and needs target="):
        schedule.step(p.from_numpy(np.zeros((8, DIM), np.float32)))
    with pytest.raises(ValueError, match="runs stage 0 and needs the batch"):
        schedule.step(target=x)


def test_bad_input(run_on_ranks) -> None:
    run_on_ranks(check_bad_input, world_size=1)


def check_custom_functions() -> None:
    """``register_custom_function``: a custom ``F`` that runs the forward through
    ``forward_one_chunk`` / ``update_losses`` gives the plain step's losses and gradients
    exactly and sees every forward; bad registrations, and the chunk calls outside a step,
    are refused."""
    from hyper_parallel.core.pipeline_parallel import MetaStepType

    p = get_platform()
    rng = np.random.default_rng(3)
    x, y = (p.from_numpy(rng.standard_normal((8, DIM)).astype(np.float32)) for _ in range(2))
    results, seen = [], []

    def custom_forward(action, ctx) -> None:
        stage = ctx.schedule._stage_dict[action.stage_index]
        ctx.schedule.wait_fwd_recv(action.stage_index, action.micro_index)
        out = stage.forward_one_chunk(action.micro_index, ctx.arg_mbs[action.micro_index],
                                      ctx.kwarg_mbs[action.micro_index])
        ctx.schedule.update_losses(stage, out, ctx.losses)
        seen.append((str(action), float(p.to_numpy(ctx.losses[-1]))))

    for custom in (False, True):
        stage = PipelineStage(build_chain(p, layer_weights(2)), 0, 1)
        schedule = Schedule1F1B(stage, 4, mse)
        if custom:
            schedule.register_custom_function(MetaStepType.F, custom_forward)
        losses: list = []
        schedule.step(x, target=y, losses=losses)
        results.append(([float(p.to_numpy(v)) for v in losses], [p.to_numpy(g) for g in stage.param_grads().values()]))
    assert results[1][0] == results[0][0] and [loss for _, loss in seen] == results[0][0], (results, seen)
    assert [a for a, _ in seen] == ["0F0", "0F1", "0F2", "0F3"], seen
    for got, want in zip(results[1][1], results[0][1]):
        np.testing.assert_array_equal(got, want)

    with pytest.raises(ValueError, match="action_type=<ActionType.SEND_F: 'SEND_F'> is not a compute action type"):
        schedule.register_custom_function(MetaStepType.SEND_F, custom_forward)
    with pytest.raises(TypeError, match="fn='f' is not callable"):
        schedule.register_custom_function(MetaStepType.F, "f")
    with pytest.warns(UserWarning, match="no rank runs an action of type OVERLAP_B_F in this schedule, so fn will not run"):
        schedule.register_custom_function(MetaStepType.OVERLAP_B_F, custom_forward)
    with pytest.raises(RuntimeError, match="stage 0 is not in a running step; call it from a function registered"):
        stage.forward_one_chunk(0)
    with pytest.raises(RuntimeError, match="is not in a running step"):
        schedule.wait_bwd_recv(0, 0)


def test_custom_functions(run_on_ranks) -> None:
    run_on_ranks(check_custom_functions, world_size=1)
