"""``hyper-parallel train``'s refusals of a run that cannot work here, before any rank starts
(``train/preflight.py``, ``TrainConfig``): each exits with status 2 and one line naming the
flag, the value, the rule and the fix, without a traceback. Real command lines in a
subprocess (no rank is started, so each takes about a second)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.train.cli import build_parser, config_from_args, main
from tests.train._ranks import TEST_DATA

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hyper_parallel.train.cli", "train", *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def _save_tiny_checkpoint(root: Path, step: int = 2) -> None:
    """A one-rank checkpoint of ``--model tiny`` (one parameter is enough for the checks made
    before any rank starts)."""
    from hyper_parallel.core.fully_shard import Box
    from hyper_parallel.train import checkpoint
    from hyper_parallel.train.loop import layout_record, model_record
    from hyper_parallel.train.model import parameter_shapes

    written = config_from_args(build_parser().parse_args(["train", "--model", "tiny", "--nproc", "1"]))
    pieces = {f"param/{name}": checkpoint.Piece(Box(shape, (0,) * len(shape), shape), np.zeros(shape, np.float32))
              for name, shape in parameter_shapes(written.model).items()}
    meta = {"layout": layout_record(written, written.layout), "model": model_record(written)}
    checkpoint.save(None, root, step, pieces, meta, world=1, rank=0)


#: (id, flags, what the one line must say). ``{tmp}`` is the test's folder.
REFUSALS = [
    ("seed", ["--seed", "-1"], ["--seed=-1", "integer >= 0", "use --seed 0"]),
    ("checkpoint-every", ["--checkpoint-every", "-5"], ["--checkpoint-every=-5", ">= 0", "0: only at the last step"]),
    ("resume-nothing", ["--resume", "--out", "{tmp}/run"],
     ["--resume: no checkpoint to resume under", "run/checkpoints", "it does not exist", "drop --resume"]),
    ("resume-empty", ["--resume", "--out", "{tmp}", "--checkpoint-dir", "{tmp}"],
     ["--resume: no checkpoint to resume under", "(--checkpoint-dir)", "holds no step_* checkpoint"]),
    ("out-missing-parent", ["--out", "/proc/hyper-parallel-test/run"],
     ["--out='/proc/hyper-parallel-test/run' is not a folder this process can write", "No such file or directory",
      "give --out a writable folder"]),
    ("out-under-a-file", ["--out", "/dev/null/run"], ["--out='/dev/null/run'", "Not a directory"]),
    ("checkpoint-dir", ["--out", "{tmp}/run", "--checkpoint-dir", "/dev/null/ckpt"],
     ["--checkpoint-dir='/dev/null/ckpt' is not a folder this process can write"]),
]


@pytest.mark.parametrize("flags, needles", [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS])
def test_refused_before_any_rank(tmp_path: Path, flags: list[str], needles: list[str]) -> None:
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    done = _cli(*flags, "--model", "tiny", "--nproc", "1", "--data", *TEST_DATA, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyper-parallel train: error: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "run" / "config.json").exists()  # no launch began


def test_too_little_data_is_one_line_before_any_rank(tmp_path: Path) -> None:
    """--data of 3 bytes: the split sizes come from the files' sizes in the launching
    process (one line), not from every rank's traceback after the launch."""
    (tmp_path / "hostname").write_bytes(b"ab\n")
    done = _cli("--model", "tiny", "--nproc", "1", "--seq-len", "128", "--data", str(tmp_path / "hostname"),
                "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "hyper-parallel train: error: the train split of --data has 3 bytes but one sequence needs 129 (--seq-len + "
        "1); give more text with --data or a smaller --seq-len"], done.stderr
    assert not (tmp_path / "run" / "config.json").exists()  # no launch began


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_unavailable_platform_is_one_line(tmp_path: Path) -> None:
    """torch-npu without torch_npu / CANN: one line, not a traceback from every rank."""
    done = _cli("--platform", "torch-npu", "--model", "tiny", "--nproc", "1", "--out", str(tmp_path / "run"),
                cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "hyper-parallel train: error: --platform='torch-npu' cannot run on this machine: torch_npu is not installed "
        "here (it needs Ascend CANN); use --platform torch-cpu here, or run on a machine with that backend installed"]


def test_resume_with_only_a_cut_off_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint that fails verification does not count: --resume names it and why."""
    _save_tiny_checkpoint(tmp_path)
    (tmp_path / "step_00000002" / "model.safetensors.index.json").unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--nproc", "1", "--resume", "--checkpoint-dir", str(tmp_path),
              "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "none of its 1 checkpoints is complete (step_00000002: it has no model.safetensors.index.json" in message, message


def test_resume_with_another_model_names_parameters_and_shapes(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The first mismatching parameters with both shapes, then the sizes that differ."""
    _save_tiny_checkpoint(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--hidden-dim", "96", "--nproc", "1", "--resume", "--checkpoint-dir",
              str(tmp_path), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert ("holds another model: layers.0.feed_forward.w1.weight has shape (64, 32) in the checkpoint, (96, 32) in "
            "this run; layers.0.feed_forward.w2.weight has shape (32, 64) in the checkpoint, (32, 96) in this run"
            in message), message
    assert "(and 3 more)" in message and "hidden_dim=64" in message and "hidden_dim=96" in message, message


def test_checkpoint_every_zero_means_the_last_step_only() -> None:
    cfg = config_from_args(build_parser().parse_args(["train", "--steps", "7", "--checkpoint-every", "0"]))
    assert [step for step in range(1, 8) if cfg.checkpoint_due(step)] == [7]
    cfg = cfg.replace(checkpoint_every=3)
    assert [step for step in range(1, 8) if cfg.checkpoint_due(step)] == [3, 6, 7]


def test_world_size_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside torchrun (``RANK``/``WORLD_SIZE``) or msrun (``MS_ROLE``/``MS_WORKER_NUM``) the
    world is the launcher's: no --nproc needed; a contradicting one is refused."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    parse = build_parser().parse_args
    assert config_from_args(parse(["train", "--tp", "2", "--dp-shard", "2"])).nproc == 4
    assert config_from_args(parse(["train"])).layout.dp_shard == 4  # the default layout over the launcher's world
    with pytest.raises(ValueError, match=r"--nproc=2 but the launcher runs 4 ranks .* leave --nproc out"):
        config_from_args(parse(["train", "--nproc", "2"]))
    with pytest.raises(ValueError, match=r"\(--tp 2\) need 2 ranks but the launcher runs 4"):
        config_from_args(parse(["train", "--tp", "2"]))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("MS_WORKER_NUM", "2")
    assert config_from_args(parse(["train", "--pp", "2"])).nproc == 2


@pytest.mark.parametrize("files", [1, 3, 25])
def test_split_sizes_are_the_corpus_splits(tmp_path: Path, files: int) -> None:
    """The sizes the command line checks from the files' sizes are the splits the ranks
    load (one file, a few: the last tenth of the stream; many: every N-th file)."""
    from hyper_parallel.train.data import Corpus, split_sizes

    rng = np.random.default_rng(files)
    for i in range(files):
        (tmp_path / f"f{i:02d}.txt").write_bytes(bytes(rng.integers(32, 127, int(rng.integers(1, 300))).tolist()))
    corpus = Corpus.load([str(tmp_path)], 1)
    assert split_sizes([str(tmp_path)]) == (len(corpus.train), len(corpus.validation))


def test_command_line_surface(capsys: pytest.CaptureFixture[str]) -> None:
    """Bare `hyper-parallel` lists the subcommands; --version; --list-presets gives each
    preset's sizes and parameter count; --help shows the defaults, a line for every flag,
    and no internal file names or reStructuredText."""
    from hyper_parallel.train.config import PRESETS
    from hyper_parallel.train.model import parameter_shapes

    assert main([]) == 0
    assert "{train,export,generate,eval}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("hyper-parallel ")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--list-presets"])
    listing = capsys.readouterr().out
    assert exit_info.value.code == 0
    for name, model in PRESETS.items():
        count = sum(int(np.prod(shape)) for shape in parameter_shapes(model).values())
        assert any(line.split()[0] == name and f"{count:,}" in line for line in listing.splitlines()), listing
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "``" not in text and not re.search(r"\w\.py\b", text), text  # no module file names
    flat = " ".join(text.split())  # argparse wraps a help line where it is long (the preset list)
    assert "(default: 150)" in flat and "(default: small)" in flat and "dp-shard 4" in flat, text
    parser = build_parser()
    for action in parser._subparsers._group_actions[0].choices["train"]._actions:  # noqa: SLF001
        assert action.help, f"{action.option_strings} has no help line"
