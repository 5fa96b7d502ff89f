"""``hyper-parallel train --grad-accum N`` (microbatches accumulated before the optimizer
step; fully_shard reduces only the last one's gradients) and ``--log tensorboard|wandb``
beside ``metrics.jsonl``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.testing.rendezvous import selected_platform
from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.config import TrainConfig
from hyper_parallel.train.metrics import TENSORBOARD_DIR, ExtraLoggers
from tests.train._cli import run_cli
from tests.train._precision_ranks import grad_accum_parity
from tests.train._ranks import TEST_DATA



def test_grad_accum_matches_one_process_and_reduces_once(run_on_ranks, tmp_path: Path) -> None:
    """dp-shard 2 (one reduce-scatter per unit per step, counted) and tp 2 with two
    microbatches, and one process with two, against one process without accumulation."""
    results = run_on_ranks(grad_accum_parity, str(tmp_path), [{"dp_shard": 2}, {"tp": 2}], world_size=2,
                           timeout_s=500)
    np.testing.assert_array_equal(results[1], results[0])


def test_grad_accum_flag_and_refusals(tmp_path: Path) -> None:
    parser = build_parser()
    base = ["train", "--out", str(tmp_path / "run")]
    cfg = config_from_args(parser.parse_args([*base, "--grad-accum", "2", "--dp-shard", "2"]))
    assert cfg.grad_accum == 2 and TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert config_from_args(parser.parse_args(base)).grad_accum == 1
    with pytest.raises(ValueError, match=r"--grad-accum=0 must be a positive integer"):
        config_from_args(parser.parse_args([*base, "--grad-accum", "0"]))
    with pytest.raises(ValueError, match=r"--batch-size=8 must be divisible by the data-parallel degree \(4\) x "
                                         r"--grad-accum \(3\) = 12"):
        config_from_args(parser.parse_args([*base, "--grad-accum", "3"]))
    with pytest.raises(ValueError, match=r"--grad-accum=2 cannot be combined with --pp=2.*--microbatches 4"):
        config_from_args(parser.parse_args([*base, "--grad-accum", "2", "--pp", "2", "--nproc", "2"]))


def test_log_flag_and_refusals(tmp_path: Path) -> None:
    parser = build_parser()
    base = ["train", "--out", str(tmp_path / "run")]
    assert config_from_args(parser.parse_args(base)).log == ()
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parser.parse_args([*base, "--log", "mlflow"])
    with pytest.raises(ValueError, match=r"--log='mlflow' is not a logger; use one of tensorboard, wandb"):
        TrainConfig(platform="torch", log=("mlflow",))
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ValueError, match=r"--log wandb needs the wandb package, which is not installed here: "
                                             r"pip install wandb"):
            config_from_args(parser.parse_args([*base, "--log", "wandb"]))


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed "
                    "(pip install -e '.[logging]')")
def test_tensorboard_events_hold_the_metrics(tmp_path: Path) -> None:
    """A real launch (one rank) with ``--log tensorboard``: TensorBoard's own reader finds
    every step's loss and learning rate, equal (as float32) to the JSONL's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    args = ["train", "--platform", selected_platform(), "--nproc", "1", "--dp-shard", "1", "--model", "tiny",
            "--steps", "3", "--seq-len", "32", "--batch-size", "4", "--grad-accum", "2", "--eval-every", "3",
            "--out", str(out), "--no-progress", "--log", "tensorboard", "--data", *TEST_DATA]
    run_cli(args, tmp_path)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / TENSORBOARD_DIR))
    events.Reload()
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes_max", "val_loss"):
        assert tag in events.Tags()["tensors"], events.Tags()
    for tag in ("loss", "lr"):
        logged = {event.step: float(np.asarray(event.tensor_proto.float_val[0]))
                  for event in events.Tensors(tag)}
        assert logged == {row["step"]: float(np.float32(row[tag])) for row in rows}, (tag, logged)


def test_extra_loggers_scalars() -> None:
    row = {"step": 3, "loss": 2.5, "lr": 1e-3, "peak_memory_bytes": [10, 30], "val_loss": 2.6}
    assert ExtraLoggers.scalars(row) == {"loss": 2.5, "lr": 1e-3, "val_loss": 2.6, "peak_memory_bytes_max": 30.0}


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install -e "
                    "'.[logging]'); its refusal is tested in test_log_flag_and_refusals")
def test_wandb_offline_run_holds_the_metrics(tmp_path: Path) -> None:
    """``--log wandb``'s logger: an offline run under ``<out>/wandb`` (no network) whose
    record file holds every scalar's name and a row's values."""
    logger = ExtraLoggers(("wandb",), tmp_path, {"model": "tiny"}, "test")
    rows = [{"step": 1, "loss": 5.25, "lr": 1e-3, "peak_memory_bytes": [7, 9]},
            {"step": 2, "loss": 4.75, "lr": 2e-3, "peak_memory_bytes": [7, 9], "val_loss": 4.5}]
    for row in rows:
        logger.write(row)
    logger.close()
    (record,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    for token in (b"loss", b"lr", b"val_loss", b"peak_memory_bytes_max", b"5.25", b"4.75", b"4.5"):
        assert token in data, token
