"""Rank functions of tests/train/test_async_checkpoint.py (importable by module path, as
the harness requires)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from hyper_parallel.platform import get_platform
from hyper_parallel.train import checkpoint, loop
from hyper_parallel.train.config import Layout
from tests.train._ranks import losses, tiny_config
from tests.train._reshard_ranks import full_tensors
from hyper_parallel.core.process_groups import barrier

#: seconds each background write is held back, so that training visibly goes on meanwhile
WRITE_DELAY_S = 0.3


def check_async_checkpoints(out: str) -> list[float]:
    """``--async-checkpoint`` on dp-shard over the world, a checkpoint every step:

    - the losses equal the synchronous run's, bit for bit, and so do the checkpoints
      (every tensor, the optimizer step);
    - each write runs off the training thread, at most one at a time on a rank, and the
      next step starts before the previous checkpoint's write ends (training continues);
    - a write that fails (raised in the background writer of step 3 on the last rank)
      makes every rank raise at the next save, naming the step and the rank; step 3 stays
      a ``.tmp`` folder and step 2 is the newest complete checkpoint, from which
      ``--resume`` continues bit-identically to the uninterrupted run."""
    p = get_platform()
    n, r = p.world_size(), p.rank()
    cfg = tiny_config(f"{out}/sync", nproc=n, layout=Layout(dp_shard=n), steps=4, checkpoint_every=1, eval_every=4)
    full = losses(loop.train(cfg))

    write = checkpoint.write_shard
    events: list[tuple[str, int, float]] = []  # (what, step, time) on this rank
    in_flight = [0, 0]  # now, most at once

    def slow(path: Path, arrays: dict, metadata: dict) -> Any:
        assert threading.current_thread() is not threading.main_thread(), "a write ran on the training thread"
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        time.sleep(WRITE_DELAY_S)
        try:
            return write(path, arrays, metadata)
        finally:
            in_flight[0] -= 1
            events.append(("written", int(metadata["step"]), time.perf_counter()))

    step_fn = loop._train_step

    def timed_step(run: Any, step: int) -> Any:
        events.append(("step", step, time.perf_counter()))
        return step_fn(run, step)

    async_cfg = cfg.replace(out=f"{out}/async", async_checkpoint=True)
    with mock.patch.object(checkpoint, "write_shard", slow), mock.patch.object(loop, "_train_step", timed_step):
        rows = loop.train(async_cfg)
    np.testing.assert_array_equal(losses(rows), full, err_msg="async vs sync checkpoints: the losses")
    assert in_flight[1] == 1, f"{in_flight[1]} writes at once on rank {r}"
    written = {step: t for what, step, t in events if what == "written"}
    started = {step: t for what, step, t in events if what == "step"}
    assert sorted(written) == [1, 2, 3, 4], events
    for step in (1, 2, 3):  # the next step ran while this step's checkpoint was being written
        assert started[step + 1] < written[step], (step, events)
    barrier()
    if r == 0:
        for step in (2, 3, 4):  # the newest KEEP
            name = f"step_{step:08d}"
            sync_manifest, sync_values = full_tensors(cfg.checkpoint_path / name)
            async_manifest, async_values = full_tensors(async_cfg.checkpoint_path / name)
            assert sync_manifest["optimizer_step"] == async_manifest["optimizer_step"] == step
            assert sorted(sync_values) == sorted(async_values)
            for key, value in sync_values.items():
                np.testing.assert_array_equal(async_values[key], value, err_msg=f"{name} {key}")

    # a background write that fails: step 3 on the last rank
    def failing(path: Path, arrays: dict, metadata: dict) -> Any:
        if metadata["step"] == "3" and r == n - 1:
            raise OSError("no space left on device (injected)")
        return write(path, arrays, metadata)

    crash_cfg = cfg.replace(out=f"{out}/crash", async_checkpoint=True)
    with mock.patch.object(checkpoint, "write_shard", failing):
        try:
            loop.train(crash_cfg)
        except RuntimeError as err:
            message = str(err)
        else:
            raise AssertionError(f"rank {r}: a failed background write did not stop the run")
    assert "checkpoint of step 3 failed on rank(s)" in message and f"{n - 1}]" in message, message
    assert "previous checkpoint is the newest complete one" in message, message
    if r == n - 1:
        assert "no space left on device (injected)" in message, message
    root = crash_cfg.checkpoint_path
    assert checkpoint.complete_steps(root) == [1, 2], sorted(x.name for x in root.iterdir())
    assert (root / ".step_00000003.tmp" / f"rank_{n - 1:05d}.failed").is_file()
    found = checkpoint.latest_manifest(root)
    assert found is not None and found[1]["step"] == 2, found
    barrier()
    resumed = losses(loop.train(crash_cfg.replace(resume=True)))
    np.testing.assert_array_equal(resumed, full[2:], err_msg="resumed from step 2 after the failed write")
    assert checkpoint.complete_steps(root) == [2, 3, 4], sorted(x.name for x in root.iterdir())
    return resumed.tolist()
