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


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[PoolCache]:
    """The session's pools, closed when the session ends."""
    with PoolCache() as cache:
        yield cache


@pytest.fixture
def run_on_ranks(rank_pools: PoolCache, rank_platform: str) -> RunOnRanks:
    """``run_on_ranks(fn, *args, world_size=2, timeout_s=120.0) -> list`` on a cached pool."""

    def run(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 120.0) -> list[Any]:
        return rank_pools.run(rank_platform, world_size, fn, *args, timeout_s=timeout_s)

    return run
