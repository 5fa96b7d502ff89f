"""``hyper-parallel train --pp-schedule zbh1``: the core's ZB-H1 schedule
(``ScheduleInterleavedZeroBubble``, one stage per rank; Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024), whose backwards are split into an input-gradient pass ``I`` and a
deferred weight-gradient pass ``W`` (``core/pipeline_parallel/weight_grad.py``), composed
with the layout chain TP -> activation checkpointing of every stage.

Through the harness on both backends, against the single-process reference (losses and
validation losses within 2e-5, each rank's parameter shapes; ``check_pipeline_parity``):
pp 2 alone (with a checkpoint resume), pp 2 x tp 2, and pp 2 x tp 2 with activation
checkpointing (bit-equal to the same run without it, ``check_checkpointed_pipelines``).
The split's deferred weight gradients must reach the parameters exactly once: a first
step's gradients under ZB-H1 equal 1F1B's on pp 2 x tp 2 (a gradient landed twice or not at
all would differ), a check the losses alone cannot make (AdamW's first steps are nearly
scale-free). Layouts that fully_shard the stages (``--dp-shard``, ``--dp-replicate``,
``--cp``) are refused: the split's weight gradients, computed from the gathered weight in
``W``, do not reach fully_shard's reduce-scatter yet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.config import Layout
from hyper_parallel.train.loop import setup, train
from tests.train._ranks import check_pipeline_parity, tiny_config
from tests.train.test_pipeline_activation_checkpointing import check_checkpointed_pipelines

#: the 4-rank composition (``tiny``: 2 blocks, one per stage)
LAYOUTS_4 = [{"pp": 2, "tp": 2, "microbatches": 4, "pp_schedule": "zbh1"}]
#: activation checkpointing on top (``PIPELINE_MODEL``: 4 blocks, 2 per stage)
CHECKPOINTED = [{"pp": 2, "tp": 2, "microbatches": 2, "pp_schedule": "zbh1"}]


def check_gradients_match_1f1b(out: str, degrees: dict) -> None:
    """One step of ``degrees`` under ZB-H1 and under 1F1B from the same parameters: this
    rank's gradients (its stages' shards, reduce-scattered over dp-shard) agree. Tolerance:
    the same microbatch gradients summed in another order (ZB-H1 computes the linear layers'
    weight gradients in a separate matmul per microbatch, W), float32: 1e-5 relative, and
    1e-7 absolute for entries that are sums cancelling to near zero."""
    p = get_platform()
    grads = {}
    for schedule in ("1f1b", "zbh1"):
        layout = Layout(**{**degrees, "pp_schedule": schedule})
        cfg = tiny_config(f"{out}/grads-{schedule}", nproc=p.world_size(), layout=layout, steps=1)
        run = setup(cfg)
        train(cfg, write_outputs=False, run=run)
        assert run.pipe is not None
        grads[schedule] = [p.to_numpy(grad) for grad in run.pipe.gradients()]
        names = run.names
    assert len(grads["zbh1"]) == len(grads["1f1b"]) > 0
    for name, got, want in zip(names, grads["zbh1"], grads["1f1b"], strict=True):
        assert np.abs(want).max() > 0, name  # a gradient that never arrived would pass the comparison
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"gradient of {name}: zbh1 vs 1f1b")


def check_zero_bubble_compositions(out: str) -> list[list[list[float]]]:
    """One rank function (MindSpore pays seconds per multi-rank call): the gradient check,
    the compositions' parity, then activation checkpointing."""
    check_gradients_match_1f1b(f"{out}/grads", LAYOUTS_4[0])
    got = check_pipeline_parity(f"{out}/parity", LAYOUTS_4)
    return [got, check_checkpointed_pipelines(f"{out}/ac", CHECKPOINTED)]


def test_zbh1_pp2_matches_single_process_and_resumes(run_on_ranks, tmp_path: Path) -> None:
    layouts = [{"pp": 2, "microbatches": 4, "pp_schedule": "zbh1"}]
    results = run_on_ranks(check_pipeline_parity, str(tmp_path), layouts, True, world_size=2, timeout_s=300)
    np.testing.assert_array_equal(results[1], results[0])


def test_zbh1_compositions_match_single_process(run_on_ranks, tmp_path: Path) -> None:
    results = run_on_ranks(check_zero_bubble_compositions, str(tmp_path), world_size=4, timeout_s=600)
    for other in results[1:]:  # every rank reports the last stage's losses
        for got, want in zip(other, results[0], strict=True):
            np.testing.assert_array_equal(got, want)


def test_zbh1_flag() -> None:
    cfg = config_from_args(build_parser().parse_args(["train", "--pp", "2", "--pp-schedule", "zbh1",
                                                      "--microbatches", "2"]))
    assert cfg.layout.pp_schedule == "zbh1" and cfg.layout.num_stages == 2
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("flags, needles", [
    (["--dp-shard", "2", "--nproc", "4"], ["--pp-schedule zbh1", "--dp-shard=2", "fully_shard's reduce-scatter"]),
    (["--dp-replicate", "2", "--nproc", "4"], ["--dp-replicate=2", "use --pp-schedule 1f1b"]),
    (["--cp", "2", "--nproc", "4"], ["--cp=2", "zbh1 with --pp and --tp only"]),
])
def test_zbh1_with_fully_shard_is_refused(flags: list[str], needles: list[str]) -> None:
    """Every data- or context-parallel layout fully_shards the stages, whose gathered
    weights the split's deferred weight gradients do not reach yet: refused before any
    rank starts, with the rule and the fix."""
    with pytest.raises(ValueError) as err:
        config_from_args(build_parser().parse_args(["train", "--pp", "2", "--pp-schedule", "zbh1",
                                                    "--microbatches", "2", *flags]))
    for needle in needles:
        assert needle in str(err.value), str(err.value)
