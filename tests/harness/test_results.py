"""Results, reuse and the one-shot API, on the backend ``HYPER_PARALLEL_PLATFORM`` selects."""

from __future__ import annotations

import pytest

from hyper_parallel.testing import PoolCache, PoolState, WorkerPool, run_on_ranks as run_once
from hyper_parallel.testing.pytest_plugin import RunOnRanks
from tests.harness import rank_functions as fns
from tests.harness.processes import wait_until_gone


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(run_on_ranks: RunOnRanks, world_size: int) -> None:
    reports = run_on_ranks(fns.rank_report, world_size=world_size)
    assert [(rank, world) for rank, world, _ in reports] == [(r, world_size) for r in range(world_size)]
    assert len({pid for _, _, pid in reports}) == world_size  # one process per rank

    sums = run_on_ranks(fns.all_reduce_rank_plus_one, world_size=world_size)
    expected = float(world_size * (world_size + 1) // 2)  # sum of rank + 1 over the ranks: exact in fp32
    assert sums == [[expected] * 4] * world_size


def test_arguments_reach_every_rank(run_on_ranks: RunOnRanks) -> None:
    assert run_on_ranks(fns.scaled_rank, 7, 10, world_size=2) == [7, 17]


def test_pool_is_reused_across_runs(run_on_ranks: RunOnRanks, rank_pools: PoolCache, rank_platform: str) -> None:
    first = [pid for _, _, pid in run_on_ranks(fns.rank_report, world_size=2)]
    starts = rank_pools.starts
    second = [pid for _, _, pid in run_on_ranks(fns.rank_report, world_size=2)]
    assert second == first
    assert rank_pools.starts == starts  # no new pool was started
    assert rank_pools.get(rank_platform, 2).pids == first


def test_unpicklable_function_is_a_type_error_and_keeps_the_pool(run_on_ranks: RunOnRanks,
                                                                 rank_pools: PoolCache, rank_platform: str) -> None:
    pool = rank_pools.get(rank_platform, 2)
    with pytest.raises(TypeError, match="module-level function of an importable module"):
        run_on_ranks(lambda: 0, world_size=2)
    assert pool.alive
    assert run_on_ranks(fns.scaled_rank, 0, 1, world_size=2) == [0, 1]
    assert rank_pools.get(rank_platform, 2) is pool


def test_one_shot_run_on_ranks_leaves_no_process(rank_platform: str) -> None:
    reports = run_once(fns.rank_report, 2, platform=rank_platform, timeout_s=60)
    assert [rank for rank, _, _ in reports] == [0, 1]
    assert wait_until_gone([pid for _, _, pid in reports], timeout_s=5.0) == []


def test_closed_pool_refuses_to_run(rank_platform: str) -> None:
    with WorkerPool(rank_platform, 1) as pool:
        assert pool.run(fns.scaled_rank, 3, 1) == [3]
    assert pool.state is PoolState.CLOSED
    assert wait_until_gone([*pool.pids, *filter(None, [pool.scheduler_pid])], timeout_s=5.0) == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(fns.scaled_rank, 3, 1)
