"""pytest fixtures for multi-rank tests. Enable with, in ``tests/conftest.py``::

    pytest_plugins = ["hyper_parallel.testing.pytest_plugin"]

Then a test reads::

    def test_all_reduce(run_on_ranks):
        results = run_on_ranks(check_all_reduce, world_size=4)

where ``check_all_reduce`` is a module-level function (pickled by name). The backend is
``$HYPER_PARALLEL_PLATFORM`` (default ``torch-cpu``); pools are reused for the session
and restarted after a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pytest

from hyper_parallel.testing.cache import PoolCache
from hyper_parallel.testing.rendezvous import selected_platform


class RunOnRanks(Protocol):
    """The ``run_on_ranks`` fixture's value."""

    def __call__(self, fn: Callable[..., Any], *args: Any, world_size: int = 2,
                 timeout_s: float = 120.0) -> list[Any]:
        """Run ``fn(*args)`` on ``world_size`` ranks (seconds: ``timeout_s``); each
        rank's return value in rank order. Raises ``RankError``/``RankTimeout``."""
        ...


@pytest.fixture(scope="session")
def rank_platform() -> str:
    """The backend name the rank processes use (``$HYPER_PARALLEL_PLATFORM`` or ``torch-cpu``)."""
    return selected_platform()


#: The session's ``PoolCache``, for the summary after the tests.
_POOLS_KEY = pytest.StashKey[PoolCache]()


@pytest.fixture(scope="session")
def rank_pools(pytestconfig: pytest.Config) -> Iterator[PoolCache]:
    """The session's pools, closed when the session ends."""
    with PoolCache() as cache:
        pytestconfig.stash[_POOLS_KEY] = cache
        yield cache


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line per (platform, world size, reason): how many pools the session started
    and the seconds they took to start (a MindSpore start costs seconds, so a restart
    after a failure or an eviction shows here)."""
    cache = config.stash.get(_POOLS_KEY, None)
    if cache is None or not cache.start_log:
        return
    groups: dict[tuple[str, int, str], list[float]] = {}
    for platform, world_size, seconds, why in cache.start_log:
        groups.setdefault((platform, world_size, why), []).append(seconds)
    total = sum(seconds for *_, seconds, _ in cache.start_log)
    terminalreporter.write_sep("-", f"hyper_parallel.testing: {len(cache.start_log)} pools started in {total:.1f} s")
    for (platform, world_size, why), times in sorted(groups.items()):
        terminalreporter.write_line(f"{platform} world {world_size} {why}: {len(times)} x, {sum(times):.1f} s")


@pytest.fixture
def run_on_ranks(rank_pools: PoolCache, rank_platform: str) -> RunOnRanks:
    """``run_on_ranks(fn, *args, world_size=2, timeout_s=120.0) -> list`` on a cached pool."""

    def run(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 120.0) -> list[Any]:
        return rank_pools.run(rank_platform, world_size, fn, *args, timeout_s=timeout_s)

    return run
