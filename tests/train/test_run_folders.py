"""Run folders of ``hyper-parallel train`` (``train/run_folder.py``, [Note: run folders]) and
checkpoint retention per run (``checkpoint``'s [Note: retention]): a second run never
deletes, overwrites or hides the first one's files.

The folder rules and retention are checked in this process (no rank is started: every
command line here is refused before the launch); one end-to-end test launches three real
runs of one rank on the selected backend: two runs into the default folder, then an
export and a resume through ``runs/latest``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.core.fully_shard import Box
from hyper_parallel.testing.rendezvous import selected_platform
from hyper_parallel.train import checkpoint, run_folder
from hyper_parallel.train.cli import build_parser, config_from_args, main
from hyper_parallel.train.config import TrainConfig
from tests.train._cli import run_cli
from tests.train._ranks import TEST_DATA



def _save(root: Path, step: int, run: str, keep: int = checkpoint.KEEP) -> Path:
    piece = checkpoint.Piece(Box((3,), (0,), (3,)), np.full(3, step, np.float32))
    return checkpoint.save(None, root, step, {"param/norm.weight": piece}, {"run": run}, world=1, rank=0, keep=keep)


def _steps(root: Path) -> dict[int, str | None]:
    return {step: checkpoint.run_of(root / f"step_{step:08d}") for step in checkpoint.complete_steps(root)}


def test_retention_deletes_only_this_runs_older_checkpoints(tmp_path: Path) -> None:
    """The issue's case: run a left steps 50/100/150; run b's step 20 in the same folder is
    kept (it used to be deleted at once, the 3 highest steps being a's), and a's are never
    touched. b keeps its own newest ``keep``, and never the one just written."""
    for step in (50, 100, 150):
        _save(tmp_path, step, "a")
    _save(tmp_path, 20, "b")
    assert _steps(tmp_path) == {20: "b", 50: "a", 100: "a", 150: "a"}
    for step in (30, 40, 60):
        _save(tmp_path, step, "b")
    assert _steps(tmp_path) == {30: "b", 40: "b", 50: "a", 60: "b", 100: "a", 150: "a"}
    _save(tmp_path, 10, "b", keep=1)  # below b's others: it stays, they go
    assert _steps(tmp_path) == {10: "b", 50: "a", 100: "a", 150: "a"}
    for step in (11, 12, 13):
        _save(tmp_path, step, "b", keep=0)  # 0: keep all
    assert sorted(step for step, run in _steps(tmp_path).items() if run == "b") == [10, 11, 12, 13]
    # a checkpoint without a readable index belongs to no run: never deleted
    (tmp_path / "step_00000050" / checkpoint.INDEX).unlink()
    _save(tmp_path, 160, "a", keep=1)
    assert _steps(tmp_path) == {10: "b", 11: "b", 12: "b", 13: "b", 50: None, 160: "a"}


def test_default_folders_are_new_and_latest_links_the_newest(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    folder, linked = run_folder.choose(None, None, False, runs)
    assert linked and Path(folder).parent == runs
    first = run_folder.claim(Path(folder))
    second = run_folder.claim(Path(folder))  # the same second: a numbered name, both created
    assert first == Path(folder) and second == Path(f"{folder}-2") and first.is_dir() and second.is_dir()
    assert run_folder.link_latest(first, runs) is None and run_folder.latest_target(runs) == first
    assert run_folder.link_latest(second, runs) is None and run_folder.latest_target(runs) == second
    assert os.readlink(runs / "latest") == second.name  # relative: the tree can move
    assert run_folder.choose(None, None, True, runs) == (str(second), False)  # --resume: the newest run
    assert run_folder.choose(None, "exp1", False, runs) == (str(runs / "exp1"), True)
    assert run_folder.choose("elsewhere", None, True, runs) == ("elsewhere", False)
    # an earlier version's real runs/latest folder is left alone, and still resumable
    legacy = tmp_path / "legacy"
    (legacy / "latest").mkdir(parents=True)
    assert "left as it is" in run_folder.link_latest(first, legacy)
    assert run_folder.latest_target(legacy) == legacy / "latest"


def _refusal(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--nproc", "1", "--data", *TEST_DATA, *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyper-parallel train: error: "), lines
    return lines[0]


def _previous_run(out: Path) -> None:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(TrainConfig(out=str(out)).to_dict()))
    (out / "metrics.jsonl").write_text("")
    for step in (50, 100, 150):
        _save(out / "checkpoints", step, "first")


@pytest.mark.parametrize("case, args, needles", [
    ("out-holds-a-run", ["--out", "{tmp}/run"],
     ["--out='{tmp}/run' holds another run (config.json, metrics.jsonl, 3 checkpoints (step_00000050 ... "
      "step_00000150) in {tmp}/run/checkpoints)", "--resume to continue that run", "--overwrite to delete it"]),
    ("checkpoint-dir-holds-a-run", ["--out", "{tmp}/new", "--checkpoint-dir", "{tmp}/run/checkpoints"],
     ["--checkpoint-dir='{tmp}/run/checkpoints' holds another run (3 checkpoints", "give a new --checkpoint-dir"]),
    ("overwrite-and-resume", ["--out", "{tmp}/run", "--overwrite", "--resume"],
     ["--overwrite deletes the run in the folder and --resume continues it; give one of them"]),
    ("out-and-run-name", ["--out", "{tmp}/run", "--run-name", "x"], ["--out=", "and --run-name='x' both name"]),
    ("run-name-latest", ["--run-name", "latest"], ["--run-name='latest' must be a folder name under runs/"]),
    ("run-name-path", ["--run-name", "a/b"], ["--run-name='a/b' must be a folder name", "no '/'"]),
    ("keep-negative", ["--out", "{tmp}/new", "--keep-checkpoints", "-1"],
     ["--keep-checkpoints=-1 must be an integer >= 0", "0: keep every checkpoint"]),
    ("resume-without-latest", ["--resume"],
     ["--resume without --out continues the newest run, 'runs/latest', which does not exist here", "give --out"]),
])
def test_refused_before_any_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str], case: str, args: list[str],
                                 needles: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _previous_run(tmp_path / "run")
    before = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    message = _refusal(capsys, *(arg.replace("{tmp}", str(tmp_path)) for arg in args))
    for needle in needles:
        assert needle.replace("{tmp}", str(tmp_path)) in message, message
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == before  # nothing written


def test_inside_a_launcher_the_folder_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank of torchrun/msrun runs the command line: a dated folder would differ per rank."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        main(["train", "--model", "tiny", "--data", *TEST_DATA])
    assert "inside torchrun/msrun" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_overwrite_deletes_the_previous_run_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _previous_run(out)
    (out / "checkpoints" / ".step_00000200.tmp").mkdir()
    (out / "notes.txt").write_text("mine")
    cfg = config_from_args(build_parser().parse_args(["train", "--out", str(out), "--overwrite"]))
    run_folder.check_not_another_run(cfg, overwrite=True)
    deleted = run_folder.clear_previous_run(cfg)
    assert deleted[:2] == ["config.json", "metrics.jsonl"] and "3 checkpoints" in deleted[2], deleted
    assert sorted(path.name for path in out.rglob("*")) == ["checkpoints", "notes.txt"]
    run_folder.check_not_another_run(cfg, overwrite=False)  # empty now


def test_keep_checkpoints_default_is_checkpoint_keep() -> None:
    assert TrainConfig().keep_checkpoints == checkpoint.KEEP
    assert config_from_args(build_parser().parse_args(["train", "--keep-checkpoints", "0"])).keep_checkpoints == 0


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(args, cwd)


def test_two_runs_into_the_default_folder_then_export_and_resume_lose_nothing(tmp_path: Path) -> None:
    """The issue's sequence with tiny settings: a run, then another model into the default
    folder; each keeps its own folder and checkpoints, ``runs/latest`` names the second,
    whose newest checkpoint the export and the resume name and use."""
    common = ["--platform", selected_platform(), "--model", "tiny", "--nproc", "1", "--seq-len", "16",
              "--batch-size", "2", "--eval-every", "100", "--no-progress", "--data", *TEST_DATA]
    first = _cli(tmp_path, "train", *common, "--steps", "4", "--checkpoint-every", "1")
    second = _cli(tmp_path, "train", *common, "--dim", "64", "--steps", "2", "--checkpoint-every", "1")
    runs = tmp_path / "runs"
    folders = sorted(path for path in runs.iterdir() if path.name != "latest")
    assert len(folders) == 2 and run_folder.latest_target(runs) == folders[1], folders
    a, b = folders
    assert f"run folder {a.relative_to(tmp_path)}" in first.stdout
    assert f"run folder {b.relative_to(tmp_path)} (runs/latest links to it)" in second.stdout
    steps_a, steps_b = _steps(a / "checkpoints"), _steps(b / "checkpoints")
    assert sorted(steps_a) == [2, 3, 4] and sorted(steps_b) == [1, 2], (steps_a, steps_b)  # KEEP = 3 each
    assert len(set(steps_a.values())) == 1 and len(set(steps_b.values())) == 1
    assert set(steps_a.values()) != set(steps_b.values())
    newest = Path("runs/latest/checkpoints/step_00000002")
    exported = _cli(tmp_path, "export", "runs/latest/checkpoints", "--out", "exported")
    assert f"exported {newest} (that is {os.path.realpath(b / 'checkpoints' / newest.name)})" in exported.stdout, exported.stdout
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["hidden_size"] == 64
    resumed = _cli(tmp_path, "train", *common, "--dim", "64", "--steps", "3", "--checkpoint-every", "1", "--resume")
    b_link = Path("runs") / b.name / "checkpoints" / "step_00000002"
    assert f"--resume: continuing from checkpoint {b_link} (step 2)" in resumed.stderr, resumed.stderr
    assert _steps(b / "checkpoints") == {1: steps_b[1], 2: steps_b[1], 3: steps_b[1]}  # the run's own id
    assert _steps(a / "checkpoints") == steps_a and run_folder.latest_target(runs) == b
    rows = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
