"""Backend-neutral multi-process test harness.

Starts N rank processes of the selected backend (torch-cpu: gloo; mindspore-cpu: a
scheduler plus N workers), runs a function on every rank and returns each rank's
result; the first failure is re-raised naming its rank. Every call has a timeout that
kills the whole group, ports are picked free, and pools are reused (a MindSpore worker
takes seconds to start).

- ``WorkerPool``: a live world; ``pool.run(fn, *args, timeout_s=...)``.
- ``PoolCache``: pools kept per (platform, world_size), restarted after a failure.
- ``run_on_ranks``: one-shot (fresh pool, run, close).
- ``pytest_plugin``: the ``run_on_ranks`` and ``rank_pools`` fixtures.

Inside ``fn``, use the platform: ``get_platform().rank()``, ``.world_size()``.
"""

from hyper_parallel.testing.cache import PoolCache
from hyper_parallel.testing.errors import RankError, RankTimeout
from hyper_parallel.testing.launch import run_on_ranks
from hyper_parallel.testing.pool import PoolState, WorkerPool
from hyper_parallel.platform.launch import PLATFORM_ENV_VAR, free_port
from hyper_parallel.testing.rendezvous import selected_platform

__all__ = ["PLATFORM_ENV_VAR", "PoolCache", "PoolState", "RankError", "RankTimeout",
           "WorkerPool", "free_port", "run_on_ranks", "selected_platform"]
