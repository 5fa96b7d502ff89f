"""``hyper-parallel train --dtype bf16|fp16|fp32`` ([Note: the job's mixed precision] in
``train/precision.py``): parity of several layouts with one process in the same dtype, the
float32 master weights and optimizer state, float16's dynamic loss scaling, the refusals,
and a real launch through the command line (preflight probe, ``--check-parity``).

Each backend runs the dtypes its CPU kernels take: torch bfloat16 and float16, MindSpore
float16 (its CPU Gather kernel takes no bfloat16, which the command line refuses by name)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.testing.rendezvous import framework_of, selected_platform
from hyper_parallel.train import preflight
from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.config import TrainConfig
from hyper_parallel.train.precision import (DEFAULT_ACCELERATOR, DEFAULT_CPU, LossScaler, mixed_precision_policy,
                                            resolve_dtype)
from tests.train._cli import run_cli
from tests.train._precision_ranks import checkpointed_dtype, dtype_parity, loss_scaling, pipeline_dtype
from tests.train._ranks import TEST_DATA


#: The low-precision dtypes each framework's CPU kernels take (the probe of
#: ``preflight.check_dtype`` refuses the others).
CPU_DTYPES = {"torch": ("bf16", "fp16"), "mindspore": ("fp16",)}


def _dtypes() -> tuple[str, ...]:
    return CPU_DTYPES[framework_of(selected_platform())]


def test_layouts_match_one_process_in_the_dtype(run_on_ranks, tmp_path: Path) -> None:
    """fully_shard with the policy (dp-shard 2) and the same policy without fully_shard
    (tp 2), against one process in the dtype (tolerance: ``LOW_PRECISION_RTOL``, with its
    reasons), in each dtype the backend's CPU kernels take."""
    layouts = [{"dp_shard": 2}, {"tp": 2}]
    for dtype in _dtypes():
        results = run_on_ranks(dtype_parity, str(tmp_path), dtype, layouts, world_size=2, timeout_s=500)
        for other in results[1:]:  # every rank reports the mean loss over the data-parallel ranks
            np.testing.assert_array_equal(other, results[0][:len(layouts)])


@pytest.mark.slow
def test_four_rank_layouts_match_one_process_in_the_dtype(run_on_ranks, tmp_path: Path) -> None:
    """The 4-rank compositions (HSDP 2 x 2, dp-shard 2 x cp 2 ring, tp 2 x dp-shard 2) in
    the first low-precision dtype of the backend."""
    layouts = [{"dp_shard": 2, "cp": 2, "cp_mode": "ring"}, {"tp": 2, "dp_shard": 2},
               {"dp_replicate": 2, "dp_shard": 2}]
    run_on_ranks(dtype_parity, str(tmp_path), _dtypes()[0], layouts, world_size=4, timeout_s=600)


def test_float16_loss_scaling_skips_overflowing_steps(run_on_ranks, tmp_path: Path) -> None:
    """[Note: dynamic loss scaling]: an overflow skips the step and halves the scale, the
    dropped gradients do not leak into the next step, a finite scale trains."""
    result = run_on_ranks(loss_scaling, str(tmp_path), world_size=1, timeout_s=300)[0]
    assert result["losses"][-1] < result["losses"][0]


def test_loss_scaler_halves_and_grows() -> None:
    scaler = LossScaler(enabled=True, scale=8.0)
    assert not scaler.update(float("inf")) and scaler.scale == 4.0
    assert not scaler.update(float("nan")) and scaler.scale == 2.0
    for _ in range(1999):
        assert scaler.update(1.0)
    assert scaler.scale == 2.0
    assert scaler.update(1.0) and scaler.scale == 4.0 and scaler.good_steps == 0
    off = LossScaler(enabled=False)
    assert off.scale == 1.0 and off.update(float("inf")) and off.scale == 1.0


def test_dtype_flag_defaults_and_refusals(tmp_path: Path) -> None:
    """The default by device, the policy of each dtype, and every refusal naming the flag."""
    assert resolve_dtype(None, "cpu") == DEFAULT_CPU == "fp32"
    assert resolve_dtype(None, "cuda") == resolve_dtype(None, "npu") == DEFAULT_ACCELERATOR == "bf16"
    assert mixed_precision_policy("fp32") is None
    policy = mixed_precision_policy("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == ("bfloat16", "float32")
    parser = build_parser()
    base = ["train", "--out", str(tmp_path / "run")]
    cfg = config_from_args(parser.parse_args([*base, "--dtype", "fp16", "--dp-shard", "2"]))
    assert cfg.dtype == "fp16" and TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert config_from_args(parser.parse_args(base)).dtype is None
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parser.parse_args([*base, "--dtype", "int8"])
    with pytest.raises(ValueError, match=r"--dtype='half' is not a training dtype; use one of fp32, bf16, fp16"):
        TrainConfig(platform="torch", dtype="half")
    for dtype in ("fp32", "bf16", "fp16"):  # pipelines take every dtype
        cfg = config_from_args(parser.parse_args([*base, "--dtype", dtype, "--pp", "2", "--nproc", "2"]))
        assert (cfg.layout.pp, cfg.dtype) == (2, dtype)


def test_a_dtype_the_cpu_kernels_do_not_take_is_refused_by_name() -> None:
    """The probe in a separate process of the backend: what runs passes, what does not is
    refused before any rank starts with the flag, the value, the reason and the fix."""
    platform = selected_platform()
    for dtype in _dtypes():
        preflight.check_dtype(TrainConfig(platform=platform, dtype=dtype))
    refused = [d for d in ("bf16", "fp16") if d not in _dtypes()]
    for dtype in refused:
        with pytest.raises(ValueError, match=rf"--dtype {dtype} cannot run on --platform {platform}: its kernels do "
                                             r"not take \w+ \(.+\); use --dtype fp32 or"):
            preflight.check_dtype(TrainConfig(platform=platform, dtype=dtype))


@pytest.mark.parametrize("layout", [["--dp-shard", "2"], ["--pp", "2", "--microbatches", "2"]],
                         ids=["dp-shard2", "pp2"])
def test_command_line_run_in_low_precision(tmp_path: Path, layout: list[str]) -> None:
    """A real launch: dp-shard 2, and pp 2 (on MindSpore through its launcher; float16's
    loss scale seeds the pipeline's backward), in the backend's first low-precision dtype,
    with ``--check-parity`` against one process in the same dtype (tolerance: as
    ``LOW_PRECISION_RTOL``); float16 rows carry the loss scale."""
    from tests.train._precision_ranks import LOW_PRECISION_RTOL

    platform, dtype = selected_platform(), _dtypes()[0]
    out = tmp_path / "run"
    args = ["train", "--platform", platform, "--nproc", "2", *layout, "--dtype", dtype, "--model", "tiny", "--steps", "4",
            "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "2", "--eval-every", "4", "--out", str(out),
            "--no-progress", "--check-parity", "--data", *TEST_DATA]
    done = run_cli(args, tmp_path)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
    assert all(("loss_scale" in row) == (dtype == "fp16") and row["dtype"] == dtype for row in rows)
    assert f"done: step 4 ({dtype})" in done.stdout
    parity = json.loads((out / "parity.json").read_text())
    assert parity["steps_compared"] == 4 and parity["max_rel_diff"] < LOW_PRECISION_RTOL[dtype], parity
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype


@pytest.mark.skipif(framework_of(selected_platform()) == "mindspore",
                    reason="MindSpore runs pipelines on CPU only through its launcher: "
                           "test_command_line_run_in_low_precision[pp2] covers it")
def test_pipeline_in_low_precision(run_on_ranks, tmp_path: Path) -> None:
    """pp 2 x dp-shard 2 (fully_shard on each stage: its root must not cast the positions)
    and pp 2 alone (the hooks of apply_mixed_precision), 1F1B, sequences of 320: the
    positions cross each stage boundary unrounded in float32, the blocks compute in the
    dtype, the losses match one process in it."""
    dtype = _dtypes()[0]
    for degrees, world in (({"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "1f1b"}, 4),
                           ({"pp": 2, "microbatches": 2, "pp_schedule": "1f1b"}, 2)):
        results = run_on_ranks(pipeline_dtype, str(tmp_path / str(world)), dtype, degrees, world_size=world,
                               timeout_s=600)
        assert any(r["received"] for r in results), results


def test_activation_checkpointing_in_low_precision(run_on_ranks, tmp_path: Path) -> None:
    """--activation-checkpointing in the dtype equals the same run without it, exactly: one
    process and tp 2 (the hooks of apply_mixed_precision rerun in the recomputation, and a
    recomputation stopped early leaves no copy behind for the next step), dp-shard 2
    (fully_shard's policy)."""
    dtype = _dtypes()[0]
    run_on_ranks(checkpointed_dtype, str(tmp_path / "one"), dtype, {}, world_size=1, timeout_s=300)
    for degrees in ({"tp": 2}, {"dp_shard": 2}):
        results = run_on_ranks(checkpointed_dtype, str(tmp_path / str(degrees)), dtype, degrees, world_size=2,
                               timeout_s=400)
        np.testing.assert_array_equal(results[1], results[0])


def test_resume_in_another_dtype(tmp_path: Path) -> None:
    """Checkpoints hold the float32 master weights and moments whatever the dtype, so a
    float32 run resumes in the backend's low-precision dtype (and its rows say so)."""
    platform, dtype = selected_platform(), _dtypes()[0]
    out = tmp_path / "run"
    common = ["train", "--platform", platform, "--nproc", "2", "--dp-shard", "2", "--model", "tiny", "--seq-len", "32",
              "--batch-size", "4", "--out", str(out), "--no-progress", "--data", *TEST_DATA]
    for extra in (["--steps", "2"], ["--steps", "4", "--resume", "--dtype", dtype]):
        done = run_cli([*common, *extra], tmp_path)
    assert "continuing from checkpoint" in done.stderr and f"done: step 4 ({dtype})" in done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["dtype"]) for row in rows] == [(1, "fp32"), (2, "fp32"), (3, dtype), (4, dtype)]
