"""A rank that raises, dies or hangs fails the call fast, names the rank, kills the pool,
and the next call gets a fresh pool. Runs on the backend ``HYPER_PARALLEL_PLATFORM`` selects."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hyper_parallel.testing.pool as pool_module
from hyper_parallel.testing import PoolCache, RankError, RankTimeout, WorkerPool
from hyper_parallel.platform.launch import free_port
from hyper_parallel.testing.pytest_plugin import RunOnRanks
from tests.harness import rank_functions as fns
from tests.harness.processes import wait_until_gone

#: The brief's bound for noticing a failure (seconds); actual: about the 3 s grace period.
DETECTION_BOUND_S = 60.0


def test_rank_that_raises_is_named_and_the_pool_restarts(run_on_ranks: RunOnRanks, rank_pools: PoolCache,
                                                         rank_platform: str) -> None:
    old_pids = rank_pools.get(rank_platform, 2).pids
    started = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 raised ValueError: deliberate failure on rank 1") as info:
        run_on_ranks(fns.raise_on_rank, 1, world_size=2)
    assert time.monotonic() - started < DETECTION_BOUND_S
    assert info.value.rank == 1
    assert info.value.remote_traceback is not None and "in raise_on_rank" in info.value.remote_traceback
    assert "--- remote traceback (rank 1) ---" in str(info.value)
    assert not isinstance(info.value, RankTimeout)
    assert wait_until_gone(old_pids, timeout_s=5.0) == []

    # the cache replaces the broken pool
    starts = rank_pools.starts
    assert run_on_ranks(fns.all_reduce_rank_plus_one, world_size=2) == [[3.0] * 4] * 2
    assert rank_pools.starts == starts + 1
    assert rank_pools.start_log[-1][:2] == (rank_platform, 2) and rank_pools.start_log[-1][3] == "after a failure"
    assert set(rank_pools.get(rank_platform, 2).pids).isdisjoint(old_pids)


def test_rank_that_exits_inside_a_collective_is_named(run_on_ranks: RunOnRanks, rank_pools: PoolCache,
                                                      rank_platform: str) -> None:
    old_pids = rank_pools.get(rank_platform, 4).pids
    started = time.monotonic()
    with pytest.raises(RankError, match=r"rank 2 of 4 \(pid \d+\) exited with code 3") as info:
        run_on_ranks(fns.exit_in_collective, 2, 3, world_size=4)
    assert time.monotonic() - started < DETECTION_BOUND_S
    assert info.value.rank == 2
    assert info.value.exit_code == 3
    assert wait_until_gone(old_pids, timeout_s=5.0) == []
    assert run_on_ranks(fns.scaled_rank, 0, 1, world_size=4) == [0, 1, 2, 3]


def test_hang_times_out_and_kills_every_process(run_on_ranks: RunOnRanks, rank_pools: PoolCache,
                                                rank_platform: str, tmp_path: Path) -> None:
    pool = rank_pools.get(rank_platform, 2)
    pids = [*pool.pids, *filter(None, [pool.scheduler_pid])]
    pid_file = tmp_path / "grandchild.pid"
    started = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[1\] had not answered after 5.0 s") as info:
        run_on_ranks(fns.hang_on_rank, 1, str(pid_file), world_size=2, timeout_s=5)
    elapsed = time.monotonic() - started
    assert 5.0 <= elapsed < DETECTION_BOUND_S
    assert info.value.rank == 1 and info.value.ranks == (1,)
    assert "in hang_on_rank" in info.value.stacks[1]  # faulthandler's dump of the hung rank
    # the pool's processes are reaped, and the process group took the grandchild along
    assert wait_until_gone([*pids, int(pid_file.read_text())], timeout_s=5.0) == []
    assert run_on_ranks(fns.scaled_rank, 0, 1, world_size=2) == [0, 1]


def test_rank_killed_between_calls_is_reported(run_on_ranks: RunOnRanks, rank_pools: PoolCache,
                                               rank_platform: str) -> None:
    pool = rank_pools.get(rank_platform, 2)
    assert pool.run(fns.scaled_rank, 0, 1) == [0, 1]
    os.kill(pool.pids[1], signal.SIGKILL)  # as the OOM killer would, while the pool is idle
    with pytest.raises(RankError, match=r"rank 1 of 2 \(pid \d+\) was killed by signal 9 \(SIGKILL\)") as info:
        pool.run(fns.scaled_rank, 0, 1)
    assert info.value.rank == 1 and info.value.exit_code == -signal.SIGKILL
    with pytest.raises(RuntimeError, match="is broken"):
        pool.run(fns.scaled_rank, 0, 1)
    assert run_on_ranks(fns.scaled_rank, 0, 1, world_size=2) == [0, 1]  # the cache starts a new pool


_ORPHANING_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from hyper_parallel.testing import WorkerPool
    from tests.harness import rank_functions
    pool = WorkerPool(sys.argv[1], 2)
    with open(sys.argv[2] + ".tmp", "w") as out:
        json.dump([*pool.pids, *filter(None, [pool.scheduler_pid])], out)
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    pool.run(rank_functions.block_in_collective, sys.argv[3], timeout_s=600)
""")


def test_children_die_with_their_parent(rank_platform: str, tmp_path: Path) -> None:
    """The parent is SIGKILLed while rank 0 waits inside a collective and rank 1 sleeps:
    every child (the MindSpore scheduler too, which blocks in C++ holding the GIL for
    the cluster's lifetime) dies at once, far below MindSpore's own failure detection."""
    pids_file = tmp_path / "pids.json"
    markers = tmp_path / "markers"
    markers.mkdir()
    log = tmp_path / "parent.log"
    # the orphaned pool's dump folder goes to tmp_path, where its removal is checked
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "TMPDIR": str(tmp_path)}
    with open(log, "wb") as log_file:
        parent = subprocess.Popen([sys.executable, "-c", _ORPHANING_SCRIPT, rank_platform, str(pids_file),  # noqa: S603
                                   str(markers)],
                                  env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(markers.iterdir())) < 2 and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(markers.iterdir())) == 2, \
            f"the ranks did not reach the call; the parent's log:\n{log.read_text(errors='replace')[-4000:]}"
        time.sleep(0.5)  # rank 0 is inside the all-reduce by now
        pids = json.loads(pids_file.read_text())
        os.kill(parent.pid, signal.SIGKILL)  # no cleanup code of the parent runs
        parent.wait()
        # each child's sentinel wakes on the parent's exit and kills the child's group
        assert wait_until_gone(pids, timeout_s=10.0) == []
        assert list(tmp_path.glob("hyper_parallel_pool_*")) == []  # the children removed their dump folder
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()


def test_late_rank_does_not_fail_a_collective(run_on_ranks: RunOnRanks) -> None:
    """A rank 6 s late to an all-reduce (a loaded host) is waited for: MindSpore's CPU
    collectives gave up after 5 s when the harness set MS_NODE_TIMEOUT=5."""
    assert run_on_ranks(fns.late_all_reduce, 1, 6.0, world_size=2) == [[3.0] * 4] * 2


def test_start_retries_when_the_rendezvous_port_is_taken(rank_platform: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        ports = iter([squatter.getsockname()[1]])  # the first port picked is already taken
        monkeypatch.setattr(pool_module, "free_port", lambda host: next(ports, None) or free_port(host))
        with WorkerPool(rank_platform, 2, start_timeout_s=60) as pool:
            assert pool.run(fns.scaled_rank, 0, 1) == [0, 1]
