"""``PoolCache``: live pools reused across tests, keyed by (platform, world_size)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hyper_parallel.testing.pool import WorkerPool

_log = logging.getLogger(__name__)


class PoolCache:
    """Keeps one live ``WorkerPool`` per (platform, world_size) and replaces a pool that
    failed. Owned by whoever needs reuse (the pytest plugin's session fixture); there is
    no process-wide instance.

    Args:
        max_pools: most pools kept alive at once; starting one more closes the least
            recently used (each MindSpore worker holds ~430 MB).
        start_timeout_s: seconds for a new pool to start (see ``WorkerPool``).
        **pool_options: other ``WorkerPool`` keyword arguments (``grace_s``, ``env``, ...).

    Raises:
        ValueError: ``max_pools < 1``.
    """

    def __init__(self, *, max_pools: int = 3, start_timeout_s: float = 120.0, **pool_options: Any) -> None:
        if max_pools < 1:
            raise ValueError(f"PoolCache: max_pools={max_pools} must be >= 1")
        self._max_pools = max_pools
        self._start_timeout_s = start_timeout_s
        self._pool_options = pool_options
        self._pools: OrderedDict[tuple[str, int], WorkerPool] = OrderedDict()  # least recently used first
        self.starts = 0  # pools started by this cache (tests read it to see a restart)
        #: every start: (platform, world_size, seconds, why) with why "first", "after a
        #: failure" or "after eviction"; the pytest plugin sums it up after the session
        self.start_log: list[tuple[str, int, float, str]] = []
        self._retired: dict[tuple[str, int], str] = {}  # key -> why its pool is gone

    def get(self, platform: str, world_size: int) -> WorkerPool:
        """A ready pool for ``(platform, world_size)``: the cached one if it is alive,
        else a new one (a broken or dead one is killed first).

        Raises:
            RankError, RankTimeout: the new pool failed to start (see ``WorkerPool``).
        """
        key = (platform, world_size)
        pool = self._pools.pop(key, None)
        if pool is not None and not pool.alive:
            _log.info("hyper_parallel.testing: replacing %r", pool)
            pool.kill()
            pool = None
            self._retired[key] = "after a failure"
        if pool is None:
            while len(self._pools) >= self._max_pools:
                evicted_key, evicted = self._pools.popitem(last=False)
                evicted.close()
                self._retired[evicted_key] = "after eviction"
            why = self._retired.pop(key, "first")
            try:
                pool = WorkerPool(platform, world_size, start_timeout_s=self._start_timeout_s, **self._pool_options)
            except BaseException:
                self._retired[key] = "after a failure"
                raise
            self.starts += 1
            self.start_log.append((platform, world_size, pool.start_s, why))
        self._pools[key] = pool
        return pool

    def run(self, platform: str, world_size: int, fn: Callable[..., Any], *args: Any,
            timeout_s: float = 120.0) -> list[Any]:
        """``self.get(platform, world_size).run(fn, *args, timeout_s=timeout_s)``: each
        rank's return value in rank order. Raises what ``WorkerPool.run`` raises; the
        failed pool is replaced on the next call."""
        return self.get(platform, world_size).run(fn, *args, timeout_s=timeout_s)

    def close_all(self) -> None:
        """Close every pool, in parallel (bounded by the pools' ``close_timeout_s``)."""
        pools = list(self._pools.values())
        self._pools.clear()
        for pool in pools:
            pool.begin_close()
        for pool in pools:
            pool.wait_closed()

    def __enter__(self) -> PoolCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close_all()
