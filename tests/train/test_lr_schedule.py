"""The learning-rate schedules (``--lr-schedule cosine|linear|constant|wsd``, ``--min-lr``)
and ``--weight-decay``: the schedule's values, the refusals before any rank starts, and a
real run whose logged learning rates follow the schedule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.metrics import read_metrics
from hyper_parallel.train.optim import LR_SCHEDULES, WSD_DECAY_FRACTION, lr_at
from tests.train._ranks import TEST_DATA
from tests.train.test_preflight import _cli


def test_schedules() -> None:
    """Warmup to the peak, then each schedule down to min_lr at the last step."""
    peak, warmup, total, floor = 1.0, 10, 110, 0.05
    for schedule in LR_SCHEDULES:
        lrs = [lr_at(step, peak, warmup, total, schedule, floor) for step in range(1, total + 1)]
        assert lrs[:warmup] == [step / warmup for step in range(1, warmup + 1)], schedule
        after = lrs[warmup:]
        assert all(a >= b for a, b in zip(after, after[1:])), f"{schedule} rises after warmup"
        assert after[-1] == pytest.approx(peak if schedule == "constant" else floor), schedule
    middle = warmup + (total - warmup) // 2
    assert lr_at(middle, peak, warmup, total, "linear", 0.0) == pytest.approx(0.5)
    assert lr_at(middle, peak, warmup, total, "cosine", 0.0) == pytest.approx(0.5)
    # WSD: the peak until the last fraction of the steps after warmup, then linear
    stable_end = warmup + round((1 - WSD_DECAY_FRACTION) * (total - warmup))
    assert lr_at(stable_end, peak, warmup, total, "wsd", 0.0) == pytest.approx(peak)
    assert lr_at(stable_end + 10, peak, warmup, total, "wsd", 0.0) == pytest.approx(0.5)
    # the default (cosine to peak / 10) is the arithmetic earlier runs used, bit for bit
    for step in range(1, total + 20):
        progress = min(1.0, (step - warmup) / (total - warmup))
        old = step / warmup if step <= warmup else 0.1 + 0.9 * 0.5 * (1.0 + np.cos(np.pi * progress))
        assert lr_at(step, 1.0, warmup, total) == old


@pytest.mark.parametrize("flags, needle", [
    (["--lr-schedule", "step"], "--lr-schedule='step' is not a schedule; use one of cosine, linear, constant, wsd"),
    (["--min-lr", "0.5"], "--min-lr=0.5 must be a number in [0, --lr=0.003]"),
    (["--weight-decay", "-1"], "--weight-decay=-1.0 must be a number >= 0"),
])
def test_refused_before_any_rank(flags: list[str], needle: str) -> None:
    with pytest.raises(ValueError) as err:
        config_from_args(build_parser().parse_args(["train", "--nproc", "1", "--tp", "1", *flags]))
    assert needle in str(err.value), str(err.value)


def test_a_run_follows_its_schedule(tmp_path: Path) -> None:
    """One rank, 6 steps, linear to 0 after 2 warmup steps: the logged learning rates are
    the schedule's, and the run's config records the knobs."""
    out = tmp_path / "run"
    done = _cli("--model", "tiny", "--nproc", "1", "--tp", "1", "--steps", "6", "--warmup-steps", "2",
                "--lr-schedule", "linear", "--min-lr", "0", "--weight-decay", "0.01", "--seq-len", "32",
                "--batch-size", "2", "--eval-every", "100", "--checkpoint-every", "0", "--no-progress",
                "--out", str(out), "--data", *TEST_DATA, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [row for row in read_metrics(out / "metrics.jsonl") if "lr" in row]
    assert [row["step"] for row in rows] == list(range(1, 7))
    np.testing.assert_allclose([row["lr"] for row in rows],
                               [lr_at(step, 3e-3, 2, 6, "linear", 0.0) for step in range(1, 7)], rtol=1e-12)
    config = json.loads((out / "config.json").read_text())
    assert (config["lr_schedule"], config["min_lr"], config["weight_decay"]) == ("linear", 0.0, 0.01)
