"""Which processes a backend needs to form a world, and the environment each one gets.

torch (torchrun-style): ``world_size`` workers that meet at ``MASTER_ADDR:MASTER_PORT``
(rank 0 hosts the store). MindSpore (msrun-style): one scheduler plus ``world_size``
workers that all dial ``MS_SCHED_HOST:MS_SCHED_PORT``; numeric ``MS_NODE_ID``\\ s make the
scheduler assign rank = node id.

The variables are given to the child at exec (``subprocess.Popen(env=...)``), before the
child imports anything: both frameworks read them when they are imported or initialised.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from hyper_parallel.platform import BACKENDS
from hyper_parallel.testing.protocol import Role

#: ``HYPER_PARALLEL_PLATFORM`` picks the backend of the tests; this when it is unset.
DEFAULT_PLATFORM = "torch-cpu"
PLATFORM_ENV_VAR = "HYPER_PARALLEL_PLATFORM"
HOST = "127.0.0.1"

#: MindSpore's failure detection (seconds), ``MS_NODE_TIMEOUT`` and
#: ``MS_HEARTBEAT_RETRY_TIMEOUT``. It also bounds how long a CPU collective waits for a
#: late peer: at 5 s, a peer that reached an all-reduce 8 s late failed it ("AllReduce
#: failed", "Recv failed"), which a heavily oversubscribed host does now and then. The
#: harness does not need MindSpore to notice failures: a rank that raises or dies is
#: reported by the pool (its message, its exit) and a hang ends at the call's
#: ``timeout_s``, which kills every process of the pool; an orphaned pool dies with its
#: parent through each child's sentinel (``testing/worker.py``). So the framework's own
#: bound is set above every call timeout the tests use, and a stuck collective always
#: ends as a ``RankTimeout`` with the stacks of the ranks that had not answered.
MS_NODE_TIMEOUT_S = 900
MS_HEARTBEAT_RETRY_TIMEOUT_S = 900

#: ``mindspore.runtime.launch_blocking()`` as an environment variable.
LAUNCH_BLOCKING_VAR = "MS_DEV_LAUNCH_BLOCKING"
# [Note: MindSpore CPU ranks launch blocking]
# PyNative hands every operation to a dispatch pipeline of threads (frontend queue,
# backend launch, kernel actors) and a read (``asnumpy``, but also ``ndim``/``shape`` of
# a pending result) waits for the pipeline to drain. With N ranks on a few cores each
# hand-off waits for a time slice: measured on the 2-core CI host at load ~13, a local
# ``x + 1`` read back cost 4-22 ms and a 4-rank float32 all-reduce 80-240 ms; with
# ``MS_DEV_LAUNCH_BLOCKING=1`` (operations run in the calling thread) 0.1-4 ms and
# 15-30 ms. Results are identical; only the overlap of Python with CPU kernels is lost,
# which N ranks sharing the cores cannot use anyway. A value set by the caller wins.


@dataclass(frozen=True)
class ProcessPlan:
    """One process of a world: its role, its rank (``None`` for a scheduler) and the
    variables to add to the parent's environment."""

    role: Role
    rank: int | None
    env: Mapping[str, str]

    @property
    def label(self) -> str:
        """How messages name this process: ``"rank 3"`` or ``"the scheduler"``."""
        return f"rank {self.rank}" if self.rank is not None else "the scheduler"


def selected_platform() -> str:
    """The backend the tests run on: ``$HYPER_PARALLEL_PLATFORM``, else ``"torch-cpu"``."""
    return os.environ.get(PLATFORM_ENV_VAR, "").strip() or DEFAULT_PLATFORM


def framework_of(platform: str) -> str:
    """``"torch"`` or ``"mindspore"`` for a backend name (or a bare framework name).

    Raises:
        ValueError: the name is not a backend.
    """
    name = platform.strip().lower()
    if name in ("torch", "mindspore"):
        return name
    if name in BACKENDS:
        return BACKENDS[name][0]
    choices = ", ".join(["torch", "mindspore", *BACKENDS])
    raise ValueError(f"platform={platform!r} is not a backend; use one of {choices}")


def check_world(platform: str, world_size: int) -> None:
    """Validate a world before anything starts.

    Raises:
        ValueError: unknown platform, or ``world_size < 1``.
    """
    framework_of(platform)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")


def launch_plan(platform: str, world_size: int, port: int,
                extra_env: Mapping[str, str] | None = None) -> list[ProcessPlan]:
    """The processes of a ``world_size``-rank world of ``platform`` meeting on ``HOST:port``
    (pick it with ``free_port``): workers in rank order, then the scheduler (MindSpore only).

    Raises:
        ValueError: see ``check_world``.
    """
    check_world(platform, world_size)
    framework = framework_of(platform)
    common = _common_env(platform, framework)
    common.update(extra_env or {})
    port_text = str(port)
    if framework == "torch":
        return [
            ProcessPlan(Role.WORKER, rank, {**common, "MASTER_ADDR": HOST, "MASTER_PORT": port_text, "RANK": str(rank),
                                            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                                            "LOCAL_WORLD_SIZE": str(world_size)})
            for rank in range(world_size)
        ]
    cluster = {**common, "MS_SCHED_HOST": HOST, "MS_SCHED_PORT": port_text, "MS_WORKER_NUM": str(world_size),
               "MS_NODE_TIMEOUT": str(MS_NODE_TIMEOUT_S),
               "MS_HEARTBEAT_RETRY_TIMEOUT": str(MS_HEARTBEAT_RETRY_TIMEOUT_S)}
    workers = [ProcessPlan(Role.WORKER, rank, {**cluster, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank),
                                               "LOCAL_RANK": str(rank)})
               for rank in range(world_size)]
    return [*workers, ProcessPlan(Role.SCHEDULER, None, {**cluster, "MS_ROLE": "MS_SCHED"})]


def _common_env(platform: str, framework: str) -> dict[str, str]:
    env = {
        # a rank that calls get_platform() (or reset_platform() and then get_platform()) gets this backend
        PLATFORM_ENV_VAR: platform,
        # output of a rank that is killed is not lost in a buffer
        "PYTHONUNBUFFERED": "1",
    }
    if "OMP_NUM_THREADS" not in os.environ:
        # N ranks on a few cores: one intra-op thread each, as torchrun does by default;
        # more only oversubscribe the cores and slow the collectives down.
        env["OMP_NUM_THREADS"] = "1"
    if framework == "torch" and "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = _loopback_interface()
        if loopback is not None:
            # every rank is on this host; gloo otherwise resolves the hostname, which in
            # containers can name an interface the ranks cannot reach each other on
            env["GLOO_SOCKET_IFNAME"] = loopback
    if framework == "mindspore" and "GLOG_v" not in os.environ:
        # MindSpore logs every rendezvous retry at WARNING; keep errors only
        env["GLOG_v"] = "3"
    if platform == "mindspore-cpu" and LAUNCH_BLOCKING_VAR not in os.environ:
        # see [Note: MindSpore CPU ranks launch blocking]
        env[LAUNCH_BLOCKING_VAR] = "1"
    return env


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None
