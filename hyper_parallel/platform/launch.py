"""Starting the processes of a world, once for the job and the test harness: free ports,
the processes each framework needs and the environment each one gets, the scheduler of a
MindSpore cluster, how a process ended.

torch (torchrun-style): ``world_size`` workers that meet at ``MASTER_ADDR:MASTER_PORT``
(rank 0 hosts the store). MindSpore (msrun-style): one scheduler plus ``world_size``
workers that all dial ``MS_SCHED_HOST:MS_SCHED_PORT``; numeric ``MS_NODE_ID``\\ s make the
scheduler assign rank = node id.

The variables are given to the child at exec (``subprocess.Popen(env=...)``), before the
child imports anything: both frameworks read them when they are imported or initialised.
``hyper-parallel train`` (``train/launch.py``) and the harness (``hyper_parallel.testing``)
both start their processes from ``launch_plan``; nothing here imports a framework.
"""

from __future__ import annotations

import enum
import math
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hyper_parallel.platform.selection import ENV_VAR as PLATFORM_ENV_VAR
from hyper_parallel.platform.selection import framework_of

HOST = "127.0.0.1"

#: Text that a framework puts in a bind failure (torch's TCPStore does; MindSpore's
#: scheduler only logs it, so ``port_in_use`` is checked too).
ADDRESS_IN_USE_MARKERS: tuple[str, ...] = ("address already in use", "eaddrinuse", "errno 98")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free when this returned.

    The kernel picks it (bind to port 0). Another process can still take it before the
    framework binds it; ``WorkerPool`` retries its start on a new port when that happens
    (the failure names the port, or the port is found taken afterwards).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether another socket holds ``port`` on ``host`` now (bound or listening).

    ``SO_REUSEADDR`` makes the check ignore connections of processes that just died
    (TIME_WAIT), so only a live owner counts.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


def is_address_in_use(text: str) -> bool:
    """Whether an error text reports a port that was already bound."""
    lowered = text.lower()
    return any(marker in lowered for marker in ADDRESS_IN_USE_MARKERS)


def exit_status(code: int) -> str:
    """``"exit code 3"``, or ``"killed by signal 9 (SIGKILL)"`` for a negative ``code``
    (``subprocess``'s and ``os.waitstatus_to_exitcode``'s convention)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    return f"killed by signal {-code} ({name})"


def describe_exit(code: int) -> str:
    """``"exited with code 3"``, ``"was killed by signal 9 (SIGKILL)"``."""
    return f"exited with code {code}" if code >= 0 else f"was {exit_status(code)}"


class Role(enum.Enum):
    """What a process of a world is."""

    WORKER = "worker"        # one rank of the world
    SCHEDULER = "scheduler"  # MindSpore's cluster scheduler: no rank, runs no user code


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
# ``launch_plan`` sets the variable; a MindSpore CPU rank started otherwise (msrun) gets it
# from the backend's ``init_process_group``: 4 ranks of tp 2 x dp-shard 2 on 2 cores took
# 6.3 s a step with PyNative's async dispatch and 0.64 s without it, the same losses.


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


def check_world(platform: str, world_size: int) -> None:
    """Validate a world before anything starts.

    Raises:
        ValueError: unknown platform, or ``world_size < 1``.
    """
    framework_of(platform)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")


def launch_plan(platform: str, world_size: int, port: int, extra_env: Mapping[str, str] | None = None, *,
                node_timeout_s: float = MS_NODE_TIMEOUT_S) -> list[ProcessPlan]:
    """The processes of a ``world_size``-rank world of ``platform`` meeting on ``HOST:port``
    (pick it with ``free_port``): workers in rank order, then the scheduler (MindSpore only).

    Args:
        extra_env: variables added to every process's (after ``common_env``'s).
        node_timeout_s: MindSpore's failure-detection bound (``MS_NODE_TIMEOUT``,
            ``MS_HEARTBEAT_RETRY_TIMEOUT``), seconds; a value in the environment wins.

    Raises:
        ValueError: see ``check_world``.
    """
    check_world(platform, world_size)
    framework = framework_of(platform)
    common = common_env(platform)
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
               "MS_NODE_TIMEOUT": os.environ.get("MS_NODE_TIMEOUT", str(math.ceil(node_timeout_s))),
               "MS_HEARTBEAT_RETRY_TIMEOUT": os.environ.get("MS_HEARTBEAT_RETRY_TIMEOUT",
                                                            str(math.ceil(node_timeout_s)))}
    workers = [ProcessPlan(Role.WORKER, rank, {**cluster, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank),
                                               "LOCAL_RANK": str(rank)})
               for rank in range(world_size)]
    return [*workers, ProcessPlan(Role.SCHEDULER, None, {**cluster, "MS_ROLE": "MS_SCHED"})]


@dataclass(frozen=True)
class LaunchCommand:
    """One process a launcher starts from a plain shell: how messages name it
    (``ProcessPlan.label``, or ``"torchrun"``), its command line and the variables to add
    to the caller's environment; ``scheduler``: MindSpore's scheduler (no rank, it leaves
    when the workers have)."""

    label: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    scheduler: bool = False


def launch_commands(platform: str, world_size: int, rank_argv: Sequence[str], *,
                    node_timeout_s: float = MS_NODE_TIMEOUT_S) -> list[LaunchCommand]:
    """The processes that start a ``world_size``-rank world of ``platform`` on this host,
    each rank running ``python *rank_argv``, through the framework's own launcher: torch,
    one ``torchrun`` (``python -m torch.distributed.run --standalone``) that starts the
    ranks; MindSpore, ``launch_plan``'s workers and scheduler (what ``msrun`` does), on a
    free port. The caller adds ``common_env(platform)`` to every process's environment
    (torchrun passes it on to its ranks; ``launch_plan``'s already hold it).

    Raises:
        ValueError: see ``check_world``.
    """
    check_world(platform, world_size)
    python = sys.executable
    if framework_of(platform) == "torch":
        return [LaunchCommand("torchrun", (python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                                           "--nproc-per-node", str(world_size), *rank_argv), {})]
    return [LaunchCommand(plan.label, (python, *(rank_argv if plan.role is Role.WORKER else SCHEDULER_COMMAND)),
                          dict(plan.env), scheduler=plan.role is Role.SCHEDULER)
            for plan in launch_plan(platform, world_size, free_port(HOST), node_timeout_s=node_timeout_s)]


def common_env(platform: str) -> dict[str, str]:
    """The variables every process of a world of ``platform`` gets (a rank's own are added
    by ``launch_plan``, or by torchrun): the platform, unbuffered output, one intra-op
    thread, gloo on the loopback interface, MindSpore's log level and, on MindSpore CPU,
    launch blocking. A variable already in the environment wins.

    Raises:
        ValueError: not a backend name.
    """
    framework = framework_of(platform)
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


#: the command line of a MindSpore cluster's scheduler process (``run_scheduler`` below)
SCHEDULER_COMMAND = ("-c", "from hyper_parallel.platform.launch import run_scheduler; run_scheduler()")


def run_scheduler() -> None:
    """Run this process as the scheduler of a MindSpore cluster (``MS_ROLE=MS_SCHED``);
    return when every worker has left. See ``platform.mindspore.run_scheduler``.

    Raises:
        RuntimeError: ``MS_ROLE`` is not ``MS_SCHED``.
    """
    from hyper_parallel.platform.mindspore import run_scheduler as run

    run()
