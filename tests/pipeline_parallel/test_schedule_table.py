"""The schedule table (``core/pipeline_parallel/schedule_table.py``), stage placement
inferred from the schedule ([Note: stage placement] in ``stage.py``) and the forward-only
step ``PipelineSchedule.eval``.

- Every entry's generator validates lowered (forward-only too) for 2 and 4 ranks; names,
  aliases and an unknown name.
- On 2 ranks, both backends, every entry: stages built without ``placement=`` take the
  schedule's, and a step of them gives the same losses, output and gradients, exactly, as
  the same stages built with the placement given; a contradicting ``placement=`` raises
  naming both. ``eval`` gives the losses and output of the unpipelined chain's forward
  (float32, microbatch vs whole-batch matmuls: rtol/atol 1e-5 as in test_runtime), the
  ``run`` form's outputs too, and leaves the step's gradients alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.pipeline_parallel import SCHEDULES, PipelineStage, schedule_entry
from hyper_parallel.core.pipeline_parallel.schedule_table import ALIASES
from hyper_parallel.core.pipeline_parallel.schedules import add_communication, forward_only, validate
from hyper_parallel.platform import get_platform
from tests.pipeline_parallel._models import DIM, build_chain, layer_weights, mse
from tests.pipeline_parallel.test_runtime import BATCH, TOL, _reference


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_every_entry_generates_a_valid_schedule(num_ranks: int) -> None:
    m = 2 * num_ranks  # DualPipeV's minimum; a multiple of the ranks for the interleaved ones
    for name, entry in SCHEDULES.items():
        assert entry.name == name and entry.placement in ("loop", "v")
        num_stages, place = entry.num_stages(num_ranks), entry.stage_to_rank(num_ranks)
        assert sorted(s for r in range(num_ranks) for s in entry.stages_of(num_ranks, r)) == list(range(num_stages))
        compute = entry.generate(num_ranks, m)
        assert {a.stage_index for a in compute[0]} == set(entry.stages_of(num_ranks, 0)), name
        validate(add_communication(compute, num_stages, place), num_stages, m, stage_to_rank=place)
        validate(add_communication(forward_only(compute), num_stages, place), num_stages, m, stage_to_rank=place,
                 backward=False)
        assert entry.splits_backward == any(a.type.name == "W" for actions in compute.values() for a in actions)


def test_names() -> None:
    assert list(SCHEDULES) == ["gpipe", "1f1b", "interleaved-1f1b", "zbh1", "interleaved-zero-bubble", "zbv",
                               "dualpipev"]
    for alias, name in ALIASES.items():
        assert schedule_entry(alias) is SCHEDULES[name]
    assert schedule_entry("zbv").schedule_class.__name__ == "ScheduleZBVZeroBubble"
    with pytest.raises(ValueError, match="pipeline schedule 'zb-v' is not known; use one of gpipe, 1f1b"):
        schedule_entry("zb-v")
    with pytest.raises(ValueError, match="needs 2 stages per rank|two stages per rank in a V"):
        SCHEDULES["zbv"].generate(2, 4, stages_per_rank=1)


def _stages(p, entry, weights, placement):
    n, r = p.world_size(), p.rank()
    return [PipelineStage(build_chain(p, weights[s:s + 1]), s, entry.num_stages(n), placement=placement)
            for s in entry.stages_of(n, r)]


def check_table_placement_eval() -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    m = 2 * n
    for name, entry in SCHEDULES.items():
        num_stages, place = entry.num_stages(n), entry.stage_to_rank(n)
        weights = layer_weights(num_stages)
        full, ref_losses, _ = _reference(p, weights, x, y, m)
        last = place(num_stages - 1) == r
        results = []
        for placement in (None, entry.placement):  # inferred, then given
            stages = _stages(p, entry, weights, placement)
            schedule = entry.schedule_class(stages, m, mse)
            assert [s.placement for s in stages] == [entry.placement] * len(stages), name
            losses: list = []
            out = schedule.step(p.from_numpy(x), target=p.from_numpy(y), losses=losses)
            grads = [p.to_numpy(g) for s in stages for g in s.param_grads().values()]
            results.append(([float(p.to_numpy(v)) for v in losses], None if out is None else p.to_numpy(out), grads))

            # eval: the forward of the unpipelined chain; the step's gradients stay
            eval_losses: list = []
            got = schedule.eval(p.from_numpy(x), target=p.from_numpy(y), losses=eval_losses)
            if last:
                np.testing.assert_allclose(p.to_numpy(got), full, **TOL, err_msg=f"{name}: eval output")
                np.testing.assert_allclose([float(p.to_numpy(v)) for v in eval_losses], ref_losses, **TOL,
                                           err_msg=f"{name}: eval losses")
            else:
                assert got is None and eval_losses == [], name
            for want, stage_grad in zip(grads, [g for s in stages for g in s.param_grads().values()]):
                np.testing.assert_array_equal(p.to_numpy(stage_grad), want, err_msg=f"{name}: eval touched grads")
        inferred, given = results
        assert inferred[0] == given[0], name
        if last:
            np.testing.assert_array_equal(inferred[1], given[1], err_msg=name)
        for a, b in zip(inferred[2], given[2]):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: gradients")

    # eval before any step (shapes inferred by it), the run() form: per-microbatch outputs
    entry = SCHEDULES["interleaved-1f1b"]
    weights = layer_weights(entry.num_stages(n))
    full, _, _ = _reference(p, weights, x, y, m)
    schedule = entry.schedule_class(_stages(p, entry, weights, None), m)
    outs = schedule.eval(p.from_numpy(x))
    if entry.stage_to_rank(n)(entry.num_stages(n) - 1) == r:
        np.testing.assert_allclose(np.concatenate([p.to_numpy(o) for o in outs]), full, **TOL)
    else:
        assert outs == []

    # a contradicting placement= names both; a V stage that is not this rank's
    zbv = SCHEDULES["zbv"]
    loop_stages = [PipelineStage(build_chain(p, weights[:1]), s, 2 * n, placement="loop") for s in (r, r + n)]
    with pytest.raises(ValueError, match=r"ScheduleZBVZeroBubble: stage \d was built with placement='loop', but "
                                         r"ScheduleZBVZeroBubble places its stages 'v'"):
        zbv.schedule_class(loop_stages, m, mse)
    v_stages = _stages(p, zbv, layer_weights(2 * n), "v")
    with pytest.raises(ValueError, match="ScheduleInterleaved1F1B: stage .* was built with placement='v', but "
                                         "ScheduleInterleaved1F1B places its stages 'loop'"):
        SCHEDULES["interleaved-1f1b"].schedule_class(v_stages, m, mse)
    inferred_loop = [PipelineStage(build_chain(p, weights[:1]), s, 2 * n) for s in (r, r + n)]
    if r == 0:  # stage n runs on rank n - 1 in the V
        with pytest.raises(ValueError, match=rf"ScheduleZBVZeroBubble: stage {n} of {2 * n} runs on group rank "
                                             rf"{n - 1} \(V placement"):
            zbv.schedule_class(inferred_loop, m, mse)


def test_table_placement_and_eval(run_on_ranks) -> None:
    run_on_ranks(check_table_placement_eval, world_size=2, timeout_s=300)
