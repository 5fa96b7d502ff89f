"""Functions the harness tests run on every rank (module level: they are pickled by name)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np

from hyper_parallel.platform import get_platform


def rank_report() -> tuple[int, int, int]:
    """(rank, world size, pid) of this rank."""
    platform = get_platform()
    return platform.rank(), platform.world_size(), os.getpid()


def all_reduce_rank_plus_one() -> list[float]:
    """All-reduce [rank + 1] * 4 (sum): every rank gets world * (world + 1) / 2."""
    platform = get_platform()
    tensor = platform.from_numpy(np.full(4, platform.rank() + 1.0, dtype=np.float32))
    return [float(x) for x in platform.to_numpy(platform.all_reduce(tensor).wait())]


def scaled_rank(offset: int, scale: int) -> int:
    return offset + scale * get_platform().rank()


def raise_on_rank(bad_rank: int) -> list[float]:
    """``bad_rank`` raises before the collective; the others wait in it for ``bad_rank``."""
    if get_platform().rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return all_reduce_rank_plus_one()


def exit_in_collective(bad_rank: int, exit_code: int) -> list[float]:
    """The other ranks enter the all-reduce; ``bad_rank`` lets them block there, then exits."""
    if get_platform().rank() == bad_rank:
        time.sleep(1.0)  # the others are inside the all-reduce by now, waiting for this rank
        os._exit(exit_code)
    return all_reduce_rank_plus_one()


def hang_on_rank(bad_rank: int, pid_file: str) -> int:
    """``bad_rank`` starts a grandchild (its pid goes to ``pid_file``) and sleeps for ever."""
    if get_platform().rank() == bad_rank:
        grandchild = subprocess.Popen(["sleep", "600"])  # noqa: S603,S607 - a fixed test command
        Path(pid_file).write_text(str(grandchild.pid))
        time.sleep(600)
    return get_platform().rank()


def late_all_reduce(late_rank: int, delay_s: float) -> list[float]:
    """``late_rank`` reaches the all-reduce ``delay_s`` seconds after the others, as an
    oversubscribed host makes a rank now and then."""
    if get_platform().rank() == late_rank:
        time.sleep(delay_s)
    return all_reduce_rank_plus_one()


def block_in_collective(marker_dir: str) -> int:
    """Rank 0 waits inside an all-reduce (in the framework's C++ code) for rank 1, which
    sleeps; each first writes ``marker_dir/rank<r>`` to say it got there."""
    rank = get_platform().rank()
    Path(marker_dir, f"rank{rank}").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    all_reduce_rank_plus_one()
    return rank
