"""Checkpoints of ``hyper-parallel train`` resumed in another layout (resharded on load):
exact state after the reshard, loss curves matching the uninterrupted run and the
single-process reference; a pipeline's resume through the launcher; a resume on the other framework;
and the checkpoints of format 2 (.npz)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.testing import run_on_ranks as run_on_fresh_ranks
from hyper_parallel.testing.rendezvous import framework_of, selected_platform
from hyper_parallel.train.cli import main
from hyper_parallel.train.metrics import read_metrics
from tests.train._cli import run_cli
from tests.train._parity_ranks import CROSS_FRAMEWORK_RTOL
from tests.train._ranks import TEST_DATA
from tests.train._reshard_ranks import check_format_2_resume, check_reshard_chains, framework_leg, full_tensors


#: (model, layouts): each layout resumes the previous one's checkpoint. tp 2 x dp-shard 2
#: -> dp-shard 4 (tensor-parallel boxes into uneven fully_shard rows) -> dp-replicate 2 x cp 2
#: (replicas: each box written once; fully_shard over cp), then rank 0 alone.
CHAINS = [("tiny+uneven", [{"tp": 2, "dp_shard": 2}, {"dp_shard": 4}, {"dp_replicate": 2, "cp": 2, "cp_mode": "ring"}])]

#: A 2-stage pipeline x dp-shard 2 -> one stage over dp-shard 4 -> 4 stages (interleaved).
PIPELINE_CHAINS = [("tiny-4-layers", [{"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "1f1b"},
                                      {"dp_shard": 4},
                                      {"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "interleaved-1f1b"}])]


def test_resume_in_another_layout(run_on_ranks, tmp_path: Path) -> None:
    results = run_on_ranks(check_reshard_chains, str(tmp_path), CHAINS + PIPELINE_CHAINS, world_size=4,
                           timeout_s=600)
    for other in results[1:]:  # every rank reports the loss of the whole batch
        for mine, theirs in zip(other, results[0]):
            np.testing.assert_array_equal(mine, theirs)


def _launch(tmp_path: Path, out: Path, flags: list[str]) -> subprocess.CompletedProcess:
    """``hyper-parallel train`` from a shell on ``tiny`` for 3 steps, a checkpoint every step."""
    # --timeout 150 (a launch takes about 25 s): a hung launch is reported with its ranks'
    # stacks within the test's own 600 s, which three launches share
    return run_cli(["train", "--platform", selected_platform(), *flags, "--model", "tiny", "--steps", "3",
                    "--seq-len", "32", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--eval-every", "3",
                    "--checkpoint-every", "1", "--out", str(out), "--no-progress", "--data", *TEST_DATA], tmp_path,
                   timeout_s=150)


def _losses(out: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(out / "metrics.jsonl")]


def test_pipeline_resume_through_the_launcher(tmp_path: Path) -> None:
    """pp 2 (1F1B, 2 microbatches), each rank one stage: resumed from step 2 in
    the same layout, step 3's loss is bit-identical to the uninterrupted run's; resumed
    from step 1 as one stage over dp-shard 2, the curve matches within 2e-5 relative (the
    gradients are the same sums in another order: microbatches accumulated on a stage vs
    one reduce-scatter over two data-parallel ranks; see the layouts' parity tests). The
    first run writes its checkpoints with --async-checkpoint.

    Through the launcher, on both backends (test_resume_in_another_layout resumes
    pipelines across more layouts through the harness)."""
    out = tmp_path / "pp2"
    pp = ["--pp", "2", "--microbatches", "2", "--pp-schedule", "1f1b"]
    # written in the background (the same files as a synchronous save: test_async_checkpoint.py)
    _launch(tmp_path, out, [*pp, "--async-checkpoint"])
    full = _losses(out)
    ckpt = out / "checkpoints"
    assert sorted(path.name for path in ckpt.iterdir()) == [f"step_{s:08d}" for s in (1, 2, 3)]
    # the single-stage run resumes from step 1 (in its own folder: it writes steps 2 and 3)
    resharded = tmp_path / "dp2"
    shutil.copytree(ckpt / "step_00000001", resharded / "checkpoints" / "step_00000001")
    shutil.rmtree(ckpt / "step_00000003")  # interrupted after step 2's checkpoint
    done = _launch(tmp_path, out, [*pp, "--resume"])
    assert "resharding" not in done.stderr, done.stderr[-3000:]
    resumed = _losses(out)
    assert resumed[:2] == full[:2] and len(resumed) == 3, (resumed, full)
    assert resumed[2] == full[2], f"pp 2 resumed at step 2: {resumed[2]!r} != uninterrupted {full[2]!r}"
    done = _launch(tmp_path, resharded, ["--dp-shard", "2", "--nproc", "2", "--resume"])
    assert "written by layout pp=2 (2 ranks, 2 pipeline stages); resharding it into layout dp_shard=2 (2 ranks)" \
        in done.stderr, done.stderr[-3000:]
    np.testing.assert_allclose(_losses(resharded), full[1:], rtol=2e-5, atol=0, err_msg="pp 2 -> dp-shard 2 at step 1")


def test_first_format_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    """A checkpoint of the first format (per-rank arrays of one layout, no boxes) stops the
    resume before any rank starts, naming both formats and the fix."""
    step = tmp_path / "step_00000002"
    step.mkdir()
    manifest = {"step": 2, "world_size": 2, "layout": {"degrees": {"tp": 2}}, "shards": {}}
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--nproc", "1", "--resume", "--checkpoint-dir", str(tmp_path),
              "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "step_00000002 has format 1" in message and "reads formats 2, 3" in message, message
    assert "start a new --checkpoint-dir" in message, message


def test_format_2_checkpoint_resumes(run_on_ranks, tmp_path: Path) -> None:
    """Runs stay resumable across the format change: a ``.npz`` checkpoint (format 2)
    resumes in its own layout bit-identically and resharded into another
    (``check_format_2_resume``)."""
    results = run_on_ranks(check_format_2_resume, str(tmp_path), world_size=2, timeout_s=400)
    np.testing.assert_array_equal(results[1], results[0])


#: (first framework and layout, second framework and layout): trained 4 steps on the first,
#: resumed at step 2 on the second, in another layout (and world size).
CROSS_FRAMEWORK_RESUMES = [(("mindspore-cpu", {"tp": 2}), ("torch-cpu", {"dp_shard": 4})),
                           (("torch-cpu", {"dp_shard": 4}), ("mindspore-cpu", {"tp": 2}))]


def test_resume_on_the_other_framework(run_on_ranks, tmp_path: Path) -> None:
    """A checkpoint of one framework resumes on the other, resharded: MindSpore tp 2 ->
    torch dp-shard 4, and torch dp-shard 4 -> MindSpore tp 2. The state the second
    framework loads, written back, is bit-identical to the first's checkpoint (both
    frameworks read and write the same safetensors files through numpy), and its losses
    continue the first framework's uninterrupted curve.

    Tolerance: ``CROSS_FRAMEWORK_RTOL`` (1e-5, derived there: MindSpore's approximate
    ``exp`` and the GEMM orders; the layouts' own float32 parity, 2e-5 over a few steps,
    is measured far below it: ~1e-7). Both frameworks start from the same numpy weights.
    Measured: 4.0e-7 (MindSpore -> torch) and 4.2e-7 (torch -> MindSpore) over steps 3-4.

    Runs in the mindspore-cpu session, which starts the torch ranks itself (MindSpore's
    ranks come from the session's cached pools)."""
    if framework_of(selected_platform()) == "torch":
        pytest.skip("run in the mindspore-cpu session (it starts the torch ranks itself)")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")

    def leg(platform: str, degrees: dict, out: Path, resume: bool) -> dict:
        world = int(np.prod(list(degrees.values())))
        if platform == selected_platform():
            results = run_on_ranks(framework_leg, str(out), degrees, resume, world_size=world, timeout_s=600)
        else:
            results = run_on_fresh_ranks(framework_leg, world, str(out), degrees, resume, platform=platform,
                                         timeout_s=600)
        for other in results[1:]:  # every rank reports the loss of the whole batch
            assert other["losses"] == results[0]["losses"], (other, results[0])
        return results[0]

    for index, ((first, first_layout), (second, second_layout)) in enumerate(CROSS_FRAMEWORK_RESUMES):
        base = tmp_path / f"case{index}"
        full = leg(first, first_layout, base / "first", False)
        source = base / "first" / "checkpoints" / "step_00000002"
        shutil.copytree(source, base / "second" / "checkpoints" / source.name)
        resumed = leg(second, second_layout, base / "second", True)
        what = f"{first} {first_layout} -> {second} {second_layout}"
        assert resumed["start"] == 2 and "resharding it into layout" in resumed["message"], (what, resumed)
        _, saved = full_tensors(source)
        _, again = full_tensors(base / "second" / "round-trip" / source.name)
        assert sorted(saved) == sorted(again), what
        for key, value in saved.items():
            np.testing.assert_array_equal(again[key], value, err_msg=f"{what}: {key}")
        np.testing.assert_allclose(resumed["losses"], full["losses"][2:], rtol=CROSS_FRAMEWORK_RTOL, atol=0,
                                   err_msg=f"{what}: resumed losses vs the uninterrupted run on {first}")
