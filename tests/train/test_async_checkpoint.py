"""``hyper-parallel train --async-checkpoint``: checkpoints written in the background while
training continues (``train/checkpoint_async.py``), the same files as a synchronous save,
and a failed background write leaves the previous checkpoint the newest complete one.
Through the launcher: tests/train/test_checkpoint_reshard.py's
test_pipeline_resume_through_the_launcher runs with the flag."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.train._async_ranks import check_async_checkpoints


def test_async_checkpoints(run_on_ranks, tmp_path: Path) -> None:
    results = run_on_ranks(check_async_checkpoints, str(tmp_path), world_size=2, timeout_s=400)
    np.testing.assert_array_equal(results[1], results[0])  # every rank reports the loss of the whole batch


def test_async_checkpoint_flag() -> None:
    from hyper_parallel.train.cli import build_parser, config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse(["train", "--async-checkpoint"])).async_checkpoint is True
    assert config_from_args(parse(["train"])).async_checkpoint is False
