"""Zero-bubble schedules (ZB-H1 on interleaved stages, ZB-V, DualPipeV): the generated
schedules validate, their simulated bubble is smaller than 1F1B's at no more activation
memory, and the runtime (split backward: ``I`` then ``W``, the linear layers through the
weight-gradient split) gives every microbatch loss, the output and every parameter
gradient of the unpipelined chain, for every schedule with 4 and 8 microbatches on 2
and 4 ranks, on both backends.

float32: the pipelined gradient sums microbatch gradients where the reference sums over
the whole batch at once (rtol/atol 1e-5), as in test_runtime."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.pipeline_parallel import (PipelineStage, ScheduleDualPipeV, ScheduleInterleavedZeroBubble,
                                                   ScheduleZBVZeroBubble)
from hyper_parallel.core.pipeline_parallel.gradient_sync import defers_reduction, last_gradient_actions
from hyper_parallel.core.pipeline_parallel.schedules import (ActionType, ScheduleError, add_communication, dualpipe_v,
                                                             interleaved_1f1b, interleaved_zero_bubble, one_f_one_b,
                                                             simulate, v_placement, validate, zbv_zero_bubble)
from hyper_parallel.platform import get_platform
from tests.pipeline_parallel._models import DIM, build_chain, layer_weights, mse
from tests.pipeline_parallel.test_runtime import BATCH, _reference, check_step

A = ActionType
UNIT = {A.F: 1.0, A.B: 2.0, A.I: 1.0, A.W: 1.0}  # the paper's cost model: T_F = T_I = T_W


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("n_microbatches", [4, 8])
def test_zero_bubble_validates_and_shrinks_the_bubble(num_ranks: int, n_microbatches: int) -> None:
    p, m = num_ranks, n_microbatches
    one_f = simulate(one_f_one_b(p, m), p, costs=UNIT)
    zbh1 = interleaved_zero_bubble(p, 1, m)
    validate(add_communication(zbh1, p), p, m)
    result = simulate(zbh1, p, costs=UNIT)
    assert result.bubble_fraction < one_f.bubble_fraction
    assert all(result.peak_activations[r] <= one_f.peak_activations[r] for r in range(p))  # H1: 1F1B's memory
    assert all(a.type in (A.F, A.I, A.W) for actions in zbh1.values() for a in actions)

    half = {k: v / 2 for k, v in UNIT.items()}  # two stages per rank: each half the work
    inter = interleaved_1f1b(p, 2, m)
    izb = interleaved_zero_bubble(p, 2, m)
    validate(add_communication(izb, 2 * p), 2 * p, m)
    result = simulate(izb, 2 * p, costs=half)
    assert result.bubble_fraction < simulate(inter, 2 * p, costs=half).bubble_fraction < one_f.bubble_fraction
    limit = simulate(inter, 2 * p).peak_activations
    assert all(result.peak_activations[r] <= limit[r] for r in range(p))

    place = v_placement(p)
    zbv = zbv_zero_bubble(p, m)
    validate(add_communication(zbv, 2 * p, place), 2 * p, m, stage_to_rank=place)
    result = simulate(zbv, 2 * p, stage_to_rank=place, costs=half)
    assert result.bubble_fraction < one_f.bubble_fraction
    assert max(result.peak_activations.values()) <= 2 * p
    assert {a.stage_index for a in zbv[0]} == {0, 2 * p - 1}

    if m >= 2 * p:  # DualPipeV needs both directions' pipelines full
        dual = dualpipe_v(p, m)
        validate(add_communication(dual, 2 * p, place), 2 * p, m, stage_to_rank=place)
        result = simulate(dual, 2 * p, stage_to_rank=place, costs=half)
        assert result.bubble_fraction < one_f.bubble_fraction
        assert any(a.type is A.OVERLAP_B_F for a in dual[0]) and any(a.type is A.W for a in dual[0])


def test_zero_bubble_bad_arguments() -> None:
    assert [v_placement(3)(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="n_virtual=0 must be >= 1"):
        interleaved_zero_bubble(2, 0, 4)
    with pytest.raises(ValueError, match="must both be >= 1"):
        zbv_zero_bubble(2, 0)
    with pytest.raises(ValueError, match="n_microbatches=6 must be >= 2 \\* num_ranks = 8"):
        dualpipe_v(4, 6)
    zbh1 = interleaved_zero_bubble(2, 1, 4)
    broken = {r: [a for a in actions if a.type is not A.W or r] for r, actions in zbh1.items()}  # rank 0 drops W
    with pytest.raises(ScheduleError, match="lacks its W half"):
        validate(broken, 2, 4)


def _check_bad_input(p) -> None:
    """Bad input, raised before any communication (inside the parity run: MindSpore pays
    seconds per rank call)."""
    n, r = p.world_size(), p.rank()
    chain = build_chain(p, layer_weights(1))
    with pytest.raises(ValueError, match=f"placement='v' needs num_stages = 2 x the pipeline group size \\({2 * n}\\)"):
        PipelineStage(chain, r, n, placement="v")
    with pytest.raises(ValueError, match=r"placement='x' must be 'loop', 'v' or None \(the schedule's\)"):
        PipelineStage(chain, r, n, placement="x")
    if r == 0:
        with pytest.raises(ValueError, match=r"runs on group rank 1 \(V placement: stage s on rank s, or"):
            PipelineStage(chain, 2 * n - 2, 2 * n, placement="v")
    with pytest.raises(ValueError, match=r"stage \d+ was built with placement='loop', but ScheduleZBVZeroBubble "
                                         r"places its stages 'v'"):
        ScheduleZBVZeroBubble([PipelineStage(chain, r, 2 * n, placement="loop"),
                               PipelineStage(chain, r + n, 2 * n, placement="loop")], 4, mse)
    with pytest.raises(TypeError, match="must be a non-empty list of PipelineStage"):
        ScheduleInterleavedZeroBubble([], 4, mse)


def check_zero_bubble(layers_per_stage: int, configs: list[tuple[str, int]]) -> None:
    """Each ``(kind, n_microbatches)`` of ``configs``: kind ``zbh1`` (one stage
    per rank), ``izb`` (two interleaved stages per rank), ``zbv`` or ``dualpipev`` (V
    placement; DualPipeV's OVERLAP_B_F pairs on two threads, this chain has no MoE hooks)."""
    p = get_platform()
    _check_bad_input(p)
    n, r = p.world_size(), p.rank()
    rng = np.random.default_rng(11)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    for kind, n_microbatches in configs:
        num_stages = n if kind == "zbh1" else 2 * n
        placement = "v" if kind in ("zbv", "dualpipev") else "loop"
        weights = layer_weights(num_stages * layers_per_stage)
        full, ref_losses, ref_grads = _reference(p, weights, x, y, n_microbatches)
        place = v_placement(n) if placement == "v" else (lambda s: s % n)
        stages = [PipelineStage(build_chain(p, weights[s * layers_per_stage:(s + 1) * layers_per_stage]), s,
                                num_stages, placement=placement) for s in range(num_stages) if place(s) == r]
        if kind == "zbv":
            schedule = ScheduleZBVZeroBubble(stages, n_microbatches, mse)
        elif kind == "dualpipev":
            schedule = ScheduleDualPipeV(stages, n_microbatches, mse)
        else:
            schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches, mse)
        assert any(a.type is A.W for a in schedule.actions)
        what = f"{kind}, {num_stages} stages, {n_microbatches} microbatches, rank {r}"
        check_step(p, schedule, stages, x, y, (full, ref_losses, ref_grads), layers_per_stage, place, what)


# Every schedule with 4 and 8 microbatches on both backends (one rank call per world
# size: MindSpore pays seconds per call); one layer per stage at world 4 (CI time).
_FULL = [(kind, m) for kind in ("zbh1", "izb", "zbv", "dualpipev") for m in (4, 8)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_bubble_matches_unpipelined(run_on_ranks, world_size: int) -> None:
    full = [(kind, m) for kind, m in _FULL if kind != "dualpipev" or m >= 2 * world_size]  # its minimum
    run_on_ranks(check_zero_bubble, 2 if world_size == 2 else 1, full, world_size=world_size,
                 timeout_s=300)


@pytest.mark.parametrize("kind", ["zbh1", "zbv", "dualpipev", "1f1b"])
def test_reduction_points(kind: str) -> None:
    """[Note: one reduction per step]: each stage of a rank is reduced once, after the last
    action that computes its gradients (a ``W``, a ``B``, or a pair holding its backward),
    and only ranks with ``W`` or ``OVERLAP_B_F`` actions defer."""
    n, m = 2, 4
    compute = {"zbh1": lambda: interleaved_zero_bubble(n, 1, m), "zbv": lambda: zbv_zero_bubble(n, m),
               "dualpipev": lambda: dualpipe_v(n, m), "1f1b": lambda: one_f_one_b(n, m)}[kind]()
    for rank, actions in compute.items():
        assert defers_reduction(actions) is (kind != "1f1b")
        after = last_gradient_actions(actions)
        stages = sorted(s for group in after.values() for s in group)
        assert stages == sorted({a.stage_index for a in actions}), (kind, rank, after)
        for index, group in after.items():
            for s in group:
                later = actions[index + 1:]
                assert not any(a.stage_index == s and a.type in (A.B, A.W) for a in later), (kind, rank, s)
                assert not any(a.type is A.OVERLAP_B_F and a.sub_actions[0].stage_index == s for a in later)
