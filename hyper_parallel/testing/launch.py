"""``run_on_ranks``: the one-shot way to run a function on N ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyper_parallel.testing.pool import WorkerPool
from hyper_parallel.testing.rendezvous import selected_platform


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, platform: str | None = None,
                 timeout_s: float = 120.0, start_timeout_s: float = 120.0) -> list[Any]:
    """Start a fresh ``world_size``-rank pool, run ``fn(*args)`` on every rank, close it.

    Args:
        fn: a module-level function of an importable module (it is pickled by name).
        platform: backend name; default ``$HYPER_PARALLEL_PLATFORM``, else ``"torch-cpu"``.
        timeout_s: seconds for every rank to answer.
        start_timeout_s: seconds for every rank to join the process group.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankError: a rank raised or died (the message names the first one and quotes
            its traceback).
        RankTimeout: not every rank answered (or started) in time; all were killed.
        TypeError, ValueError: see ``WorkerPool.run``.

    Tests should prefer the ``run_on_ranks`` pytest fixture, which reuses pools.
    """
    with WorkerPool(platform or selected_platform(), world_size, start_timeout_s=start_timeout_s) as pool:
        return pool.run(fn, *args, timeout_s=timeout_s)
