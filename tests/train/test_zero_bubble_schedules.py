"""``hyper-parallel train --pp-schedule zbh1|zbv``: the core's zero-bubble schedules (Qi et
al., "Zero Bubble Pipeline Parallelism", ICLR 2024): ZB-H1 (``ScheduleInterleavedZeroBubble``,
one stage per rank) and ZB-V (``ScheduleZBVZeroBubble``, ``2 pp`` stages in the V placement:
rank ``r`` runs stages ``r`` and ``2 pp - 1 - r``), whose backwards are split into an
input-gradient pass ``I`` and a deferred weight-gradient pass ``W``
(``core/pipeline_parallel/weight_grad.py``), composed with the layout chain TP -> activation
checkpointing of every stage.

Through the harness on both backends, against the single-process reference (losses and
validation losses within 2e-5, each rank's parameter shapes; ``check_pipeline_parity``):
pp 2 of each (ZB-V with a checkpoint resume), pp 2 x tp 2, and pp 2 x tp 2 with activation
checkpointing (bit-equal to the same run without it, ``check_checkpointed_pipelines``).
The split's deferred weight gradients must reach the parameters exactly once: a first
step's gradients under ZB-H1 and ZB-V equal 1F1B's on pp 2 x tp 2 (a gradient landed twice
or not at all would differ), a check the losses alone cannot make (AdamW's first steps are
nearly scale-free). Layouts that fully_shard the stages (``--dp-shard``, ``--dp-replicate``,
``--cp``): ``W`` hands the deferred weight gradients of the gathered weights to their
fully_shard units, which reduce once per step after the stage's last ``W`` ([Note: one
reduction per step] in ``core/pipeline_parallel/gradient_sync.py``): pp 2 x dp-shard 2
gradients under ZB-H1 and ZB-V equal 1F1B's (whose units reduce per microbatch), and
pp 2 x dp-shard 2, pp 2 x dp-replicate 2 and pp 2 x cp 2 match the single process; ZB-V on
pp 2 x dp-shard 2 checkpointed equals it without checkpointing bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.config import Layout
from hyper_parallel.train.loop import setup, train
from hyper_parallel.train.model import parameter_shapes
from tests.train._ranks import PIPELINE_MODEL, check_pipeline_parity, tiny_config
from tests.train.test_pipeline_activation_checkpointing import check_checkpointed_pipelines
from hyper_parallel.core.process_groups import barrier

#: the 4-rank compositions (``tiny``: 2 blocks, one per stage; ``PIPELINE_MODEL`` for ZB-V's 4 stages)
LAYOUTS_4 = [{"pp": 2, "tp": 2, "microbatches": 4, "pp_schedule": "zbh1"},
             {"pp": 2, "tp": 2, "microbatches": 2, "pp_schedule": "zbv"}]
#: the fully_shard'ed compositions on 4 ranks (``--dp-shard``, HSDP's ``--dp-replicate``,
#: ``--cp``'s fully_shard over dp x cp)
SHARDED_4 = [{"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "zbh1"},
             {"pp": 2, "dp_replicate": 2, "microbatches": 2, "pp_schedule": "zbv"},
             {"pp": 2, "cp": 2, "microbatches": 2, "pp_schedule": "zbh1"}]
#: activation checkpointing on top (``PIPELINE_MODEL``: 4 blocks, 2 per stage under ZB-H1, 1 under ZB-V)
CHECKPOINTED = [{"pp": 2, "tp": 2, "microbatches": 2, "pp_schedule": "zbh1"},
                {"pp": 2, "tp": 2, "microbatches": 2, "pp_schedule": "zbv"},
                {"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "zbv"}]


def check_gradients_match_1f1b(out: str, degrees: dict) -> None:
    """One step of ``degrees`` (``PIPELINE_MODEL``, 4 blocks) under 1F1B, ZB-H1 and ZB-V from
    the same parameters: every parameter's gradient (each rank's tensor-parallel shard)
    agrees across the schedules. The schedules place the blocks differently (1F1B and ZB-H1:
    2 stages, ZB-V: 4 in a V), so each rank saves its gradients by name and every rank
    compares all of them, keyed by (tensor-parallel coordinate, name). Tolerance: the same
    microbatch gradients summed in another order (the split computes the linear layers'
    weight gradients in a separate matmul per microbatch, W), float32: 1e-5 relative, and
    1e-7 absolute for entries that are sums cancelling to near zero."""
    p = get_platform()
    n, rank = p.world_size(), p.rank()
    Path(out).mkdir(parents=True, exist_ok=True)
    for schedule in ("1f1b", "zbh1", "zbv"):
        layout = Layout(**{**degrees, "pp_schedule": schedule})
        cfg = tiny_config(f"{out}/{schedule}", nproc=n, layout=layout, steps=1, model=PIPELINE_MODEL,
                          model_name="tiny-4-layers")
        run = setup(cfg)
        train(cfg, write_outputs=False, run=run)
        assert run.pipe is not None
        np.savez(f"{out}/{schedule}-{rank}.npz", **{name: p.to_numpy(grad)
                                                    for name, grad in zip(run.names, run.pipe.gradients(), strict=True)})
    barrier()
    inner = n // degrees["pp"]  # the mesh's pp axis is outermost: rank % inner is the other axes' coordinate

    def load(schedule: str) -> dict[tuple[int, str], np.ndarray]:
        grads = {}
        for r in range(n):
            with np.load(f"{out}/{schedule}-{r}.npz") as saved:
                grads.update({(r % inner, name): saved[name] for name in saved.files})
        return grads

    want = load("1f1b")
    assert len(want) == inner * len(parameter_shapes(PIPELINE_MODEL)), sorted(want)
    for schedule in ("zbh1", "zbv"):
        got = load(schedule)
        assert sorted(got) == sorted(want), schedule
        for key, grad in want.items():
            assert np.abs(grad).max() > 0, key  # a gradient that never arrived would pass the comparison
            np.testing.assert_allclose(got[key], grad, rtol=1e-5, atol=1e-7,
                                       err_msg=f"gradient of {key}: {schedule} vs 1f1b")


def check_zero_bubble_compositions(out: str) -> list[list[list[float]]]:
    """One rank function (MindSpore pays seconds per multi-rank call): the gradient check,
    the compositions' parity, then activation checkpointing."""
    check_gradients_match_1f1b(f"{out}/grads", {"pp": 2, "tp": 2, "microbatches": 2})
    check_gradients_match_1f1b(f"{out}/grads-dp", {"pp": 2, "dp_shard": 2, "microbatches": 2})
    got = check_pipeline_parity(f"{out}/parity", LAYOUTS_4 + SHARDED_4)
    return [got, check_checkpointed_pipelines(f"{out}/ac", CHECKPOINTED)]


def test_pp2_matches_single_process_and_resumes(run_on_ranks, tmp_path: Path) -> None:
    """ZB-V first: its checkpoint (stages 0 and 3 on rank 0, 1 and 2 on rank 1) resumes
    bit-identically; then ZB-H1."""
    layouts = [{"pp": 2, "microbatches": 4, "pp_schedule": "zbv"}, {"pp": 2, "microbatches": 4, "pp_schedule": "zbh1"}]
    results = run_on_ranks(check_pipeline_parity, str(tmp_path), layouts, True, world_size=2, timeout_s=300)
    np.testing.assert_array_equal(results[1], results[0])


def test_compositions_match_single_process(run_on_ranks, tmp_path: Path) -> None:
    results = run_on_ranks(check_zero_bubble_compositions, str(tmp_path), world_size=4, timeout_s=600)
    for other in results[1:]:  # every rank reports the last stage's losses
        for got, want in zip(other, results[0], strict=True):
            np.testing.assert_array_equal(got, want)


def test_flags() -> None:
    for schedule, stages in (("zbh1", 2), ("zbv", 4)):
        cfg = config_from_args(build_parser().parse_args(["train", "--pp", "2", "--pp-schedule", schedule,
                                                          "--microbatches", "2"]))
        assert cfg.layout.pp_schedule == schedule and cfg.layout.num_stages == stages
        assert type(cfg).from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("flags, needles", [
    # ZB-V's 2 stages per rank need 2 x pp layers
    (["--pp-schedule", "zbv", "--model", "tiny"], ["--pp=2 makes 4 pipeline stages (2 per rank with --pp-schedule zbv)",
                                                   "has 2 layers"]),
])
def test_bad_zero_bubble_layouts_are_refused(flags: list[str], needles: list[str]) -> None:
    """ZB-V needs a block per stage: refused before any rank starts, with the rule and the
    fix."""
    with pytest.raises(ValueError) as err:
        config_from_args(build_parser().parse_args(["train", "--pp", "2", "--pp-schedule", "zbh1",
                                                    "--microbatches", "2", *flags]))
    for needle in needles:
        assert needle in str(err.value), str(err.value)
