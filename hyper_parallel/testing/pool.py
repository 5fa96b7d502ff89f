"""``WorkerPool``: a live world of rank processes that runs functions on every rank.

Starting a world costs seconds (a MindSpore worker: ~430 MB and several seconds), so a
pool is started once and then runs many functions. Any failure (a rank raises, dies, or
does not answer in time) tears the whole pool down: after a failed collective the
surviving ranks' process group is in an unknown state. ``PoolCache`` starts a new one.
"""

from __future__ import annotations

import enum
import logging
import os
import pickle
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hyper_parallel.platform.launch import (HOST, check_world, describe_exit, free_port, is_address_in_use, launch_plan,
                                             port_in_use)
from hyper_parallel.testing.errors import RankError, RankTimeout
from hyper_parallel.testing.events import POLL_INTERVAL_S, ChannelClosed, Death, Event, Message, next_events
from hyper_parallel.testing.failures import Failure, failure_error, timeout_error
from hyper_parallel.testing.process import ChildProcess
from hyper_parallel.testing.protocol import (
    ChildSpec,
    CloseRequest,
    Raised,
    Ready,
    Result,
    Role,
    RunRequest,
    StartFailed,
)

_log = logging.getLogger(__name__)

#: Starts that fail because another process took the rendezvous port are retried this often.
_START_ATTEMPTS = 3
#: Time (seconds) given to hung ranks to write their stacks before they are killed.
_STACK_DUMP_WAIT_S = 1.0
#: Time (seconds) to reap a SIGKILLed process (it only has to be scheduled once).
_REAP_TIMEOUT_S = 10.0


class PoolState(enum.Enum):
    """``STARTING`` -> ``READY`` -> ``CLOSING`` -> ``CLOSED``; any failure -> ``BROKEN``.
    Only a ``READY`` pool runs functions."""

    STARTING = "starting"
    READY = "ready"
    CLOSING = "closing"
    BROKEN = "broken"
    CLOSED = "closed"


class WorkerPool:
    """``world_size`` rank processes of ``platform`` that have joined one process group.

    Args:
        platform: backend name as for ``hyper_parallel.platform.init`` (``"torch-cpu"``,
            ``"mindspore-cpu"``, ...).
        world_size: number of ranks, >= 1.
        start_timeout_s: seconds for every rank to join the process group.
        collective_timeout_s: seconds passed to each rank's ``init_process_group``; it
            bounds a framework's own wait in a collective. The harness does not rely on
            it: ``run``'s ``timeout_s`` kills the pool first.
        grace_s: after the first rank fails, seconds to wait for the others' answers
            (they are quoted in the error) before the pool is killed.
        close_timeout_s: seconds ``close`` waits for a clean exit before killing.
        env: extra environment variables for every child.

    Raises:
        ValueError: unknown platform, ``world_size < 1`` or a non-positive timeout.
        RankError: a rank (or the scheduler) failed to start; the message quotes its
            traceback or exit status.
        RankTimeout: not every rank joined within ``start_timeout_s``.

    Children run in their own sessions; they kill themselves (and what they started)
    when this process disappears, and a pool dropped without ``close`` is killed by a
    finalizer. Not thread-safe: one caller at a time.
    """

    def __init__(self, platform: str, world_size: int, *, start_timeout_s: float = 120.0,
                 collective_timeout_s: float = 300.0, grace_s: float = 3.0, close_timeout_s: float = 30.0,
                 env: Mapping[str, str] | None = None) -> None:
        for name, value in (("start_timeout_s", start_timeout_s), ("collective_timeout_s", collective_timeout_s),
                            ("close_timeout_s", close_timeout_s)):
            if value <= 0:
                raise ValueError(f"WorkerPool: {name}={value} must be > 0 seconds")
        if grace_s < 0:
            raise ValueError(f"WorkerPool: grace_s={grace_s} must be >= 0 seconds")
        check_world(platform, world_size)
        self.platform = platform
        self.world_size = world_size
        self._start_timeout_s = start_timeout_s
        self._collective_timeout_s = collective_timeout_s
        self._grace_s = grace_s
        self._close_timeout_s = close_timeout_s
        self._env = dict(env or {})
        self._state = PoolState.STARTING
        self._call_id = 0
        self._close_deadline = 0.0          # monotonic seconds; set by begin_close
        self._children = _Children()
        self._finalizer = weakref.finalize(self, self._children.destroy)
        self._pids: list[int] = []
        self._scheduler_pid: int | None = None
        started = time.monotonic()
        self._start()
        #: seconds the start took (every rank joined the process group)
        self.start_s = time.monotonic() - started

    # ---- introspection ----------------------------------------------------------

    @property
    def state(self) -> PoolState:
        return self._state

    @property
    def pids(self) -> list[int]:
        """Worker pids in rank order (kept after the pool is closed or broken)."""
        return list(self._pids)

    @property
    def scheduler_pid(self) -> int | None:
        """The MindSpore scheduler's pid; ``None`` for backends without one."""
        return self._scheduler_pid

    @property
    def alive(self) -> bool:
        """``READY`` and every process still running (checked now, without side effects)."""
        return self._state is PoolState.READY and all(p.exit_code() is None for p in self._children.processes)

    def __repr__(self) -> str:
        return f"WorkerPool({self.platform!r}, {self.world_size}, state={self._state.value})"

    # ---- running --------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> list[Any]:
        """Run ``fn(*args)`` on every rank; each rank's return value, in rank order.

        ``fn`` and ``args`` are pickled: ``fn`` must be a module-level function of a
        module the ranks can import by name (they get this process's ``sys.path``);
        return values must pickle too (plain values and numpy arrays travel best). To
        assert an expected exception, catch it inside ``fn`` and return its message: a
        raise is a failure and costs a pool restart.

        Args:
            timeout_s: seconds for every rank to answer.

        Raises:
            TypeError: ``fn`` or ``args`` cannot be sent (the pool stays usable).
            ValueError: ``timeout_s <= 0``.
            RuntimeError: the pool is not ``READY`` (closed, or broken by an earlier failure).
            RankError: a rank raised (the first one's traceback is in the message) or a
                process of the pool died; the pool is torn down.
            RankTimeout: some ranks had not answered after ``timeout_s``; every process
                of the pool was killed.
        """
        if timeout_s <= 0:
            raise ValueError(f"WorkerPool.run: timeout_s={timeout_s} must be > 0 seconds")
        self._require_ready("run")
        payload = _pickle_call(fn, args)
        self._call_id += 1
        what = f"run({_qualified_name(fn)})"
        try:
            self._check_still_alive(what)
            return self._run_call(what, RunRequest(self._call_id, payload), timeout_s)
        except BaseException:
            # also an interrupt (Ctrl-C, pytest-timeout): ranks are mid-call, the pool is unusable
            if self._state is PoolState.READY:
                self._teardown()
            raise

    def _run_call(self, what: str, request: RunRequest, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        results: dict[int, bytes] = {}
        pending = set(range(self.world_size))
        failures: list[Failure] = []
        for worker in self._children.workers:
            worker.send(request)  # a dead worker's send fails; its Death event follows
        grace_end: float | None = None
        while pending:
            now = time.monotonic()
            end = deadline if grace_end is None else grace_end
            if now >= end:
                break
            for event in next_events(self._children.processes, min(POLL_INTERVAL_S, end - now)):
                rank = event.process.rank
                failure = _failure_of(event)
                if failure is not None:
                    failures.append(failure)
                elif isinstance(event, Message) and isinstance(event.message, Result) \
                        and event.message.call_id == request.call_id and rank is not None:
                    results[rank] = event.message.data
                else:
                    _log.warning("hyper_parallel.testing: %s ignored %r from %s", self, event, event.process.label)
                    continue
                pending.discard(rank)  # the scheduler (None) is never pending
            if failures and grace_end is None:
                grace_end = time.monotonic() + self._grace_s
        if failures:
            error = failure_error(failures, sorted(pending), self._context(what), self._grace_s)
            self._teardown()
            raise error
        if pending:
            stacks = self._dump_stacks(sorted(pending))
            self._teardown()
            raise timeout_error(sorted(pending), timeout_s, self._context(what), stacks)
        try:
            return [pickle.loads(results[rank]) for rank in range(self.world_size)]
        except Exception as exc:
            self._teardown()
            raise RankError(f"{self._context(what)}: this process cannot unpickle a rank's return value "
                            f"({type(exc).__name__}: {exc}); return plain values or numpy arrays",
                            rank=None) from exc

    # ---- lifetime ----------------------------------------------------------------

    def close(self, timeout_s: float | None = None) -> None:
        """Shut down: every rank leaves the process group and exits (then the scheduler).

        Waits at most ``timeout_s`` seconds (default: the pool's ``close_timeout_s``),
        then kills what is left. A child that does not exit cleanly is logged, never
        raised. Idempotent; a broken pool is just marked closed.
        """
        self.begin_close(timeout_s)
        self.wait_closed()

    def begin_close(self, timeout_s: float | None = None) -> None:
        """First half of ``close``: ask every rank to leave, without waiting. Lets a
        caller close several pools in parallel (``PoolCache.close_all``)."""
        budget = self._close_timeout_s if timeout_s is None else timeout_s
        self._close_deadline = time.monotonic() + budget
        if self._state is PoolState.READY and self.alive:
            for worker in self._children.workers:
                worker.send(CloseRequest())
            self._state = PoolState.CLOSING

    def wait_closed(self) -> None:
        """Second half of ``close``: wait for the exits until the deadline, then kill the rest."""
        if self._state is PoolState.CLOSING:
            processes = self._children.processes
            while not all(p.gone for p in processes) and (now := time.monotonic()) < self._close_deadline:
                for event in next_events(processes, min(POLL_INTERVAL_S, self._close_deadline - now),
                                         exit_after_eof_s=0.0):
                    if isinstance(event, Death) and event.exit_code != 0:
                        _log.warning("hyper_parallel.testing: %s of %r %s while closing", event.process.label,
                                     self, describe_exit(event.exit_code))
            leftover = [p.label for p in processes if not p.gone]
            if leftover:
                _log.warning("hyper_parallel.testing: %s of %r did not exit in time after close(); killing",
                             ", ".join(leftover), self)
        self.kill()

    def kill(self) -> None:
        """Kill every process of the pool now (no clean shutdown) and mark it closed."""
        self._children.destroy()
        self._state = PoolState.CLOSED

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------

    def _start(self) -> None:
        for attempt in range(1, _START_ATTEMPTS + 1):
            port = free_port(HOST)
            try:
                self._start_once(port)
                return
            except RankTimeout:
                raise
            except RankError as error:
                # another process took the port between free_port() and the framework's bind
                stolen = is_address_in_use(str(error)) or port_in_use(port, HOST)
                if attempt == _START_ATTEMPTS or not stolen:
                    raise
                _log.info("hyper_parallel.testing: rendezvous port %d was taken; starting %r again", port, self)
                self._state = PoolState.STARTING

    def _start_once(self, port: int) -> None:
        self._children.dump_dir = Path(tempfile.mkdtemp(prefix="hyper_parallel_pool_"))
        try:
            # the scheduler first: the workers dial it as soon as they start
            for plan in sorted(launch_plan(self.platform, self.world_size, port, self._env),
                               key=lambda plan: plan.role is not Role.SCHEDULER):
                name = "scheduler" if plan.rank is None else f"rank{plan.rank}"
                spec = ChildSpec(role=plan.role, rank=plan.rank, platform=self.platform, sys_path=tuple(sys.path),
                                 parent_pid=os.getpid(),
                                 stack_dump_path=str(self._children.dump_dir / f"{name}.stacks"),
                                 collective_timeout_s=self._collective_timeout_s)
                self._children.add(ChildProcess.spawn(plan, spec))
            self._pids = [w.pid for w in self._children.workers]
            scheduler = self._children.scheduler
            self._scheduler_pid = scheduler.pid if scheduler is not None else None
            self._await_ready()
        except BaseException:
            if self._state is not PoolState.BROKEN:
                self._teardown()
            raise
        self._state = PoolState.READY

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        ready: set[int] = set()
        failures: list[Failure] = []
        # no grace period on a failure: the other ranks are blocked in the rendezvous
        while len(ready) < self.world_size and not failures and (now := time.monotonic()) < deadline:
            for event in next_events(self._children.processes, min(POLL_INTERVAL_S, deadline - now)):
                failure = _failure_of(event)
                if failure is not None:
                    failures.append(failure)
                elif isinstance(event, Message) and isinstance(event.message, Ready):
                    got, expected = event.message, event.process.rank
                    if (got.rank, got.world_size) == (expected, self.world_size):
                        ready.add(got.rank)
                    else:
                        failures.append(Failure.mismatch(event.process, got.rank, got.world_size, self.world_size))
        if failures:
            error = failure_error(failures, [], self._context("start"), grace_s=None)
            self._teardown()
            raise error
        if len(ready) < self.world_size:
            missing = sorted(set(range(self.world_size)) - ready)
            stacks = self._dump_stacks(missing)
            self._teardown()
            raise timeout_error(missing, self._start_timeout_s, self._context("start"), stacks)

    def _check_still_alive(self, what: str) -> None:
        # a process that died between calls (OOM killer, a stray os._exit) is reported
        # before the call is sent, as the failure it is
        failures = [f for f in map(_failure_of, next_events(self._children.processes, 0.0)) if f is not None]
        if failures:
            error = failure_error(failures, [], self._context(f"before {what}"), grace_s=None)
            self._teardown()
            raise error

    def _context(self, what: str) -> str:
        return f"WorkerPool({self.platform!r}, world_size={self.world_size}): {what}"

    def _require_ready(self, what: str) -> None:
        if self._state is not PoolState.READY:
            raise RuntimeError(f"WorkerPool.{what}: {self!r} is {self._state.value}; after a failure or close() "
                               "the pool cannot be used again: start a new WorkerPool (PoolCache does)")

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        targets = [w for w in self._children.workers if w.rank in ranks]
        asked = [w for w in targets if w.request_stack_dump()]
        # faulthandler writes thread after thread from the signal handler: a dump is
        # complete once its file is non-empty and has stopped growing
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        sizes = [-1] * len(asked)
        while asked and time.monotonic() < deadline:
            time.sleep(0.1)
            now = [w.stack_dump_size() for w in asked]
            if all(size > 0 for size in now) and now == sizes:
                break
            sizes = now
        return {w.rank: w.read_stack_dump() for w in targets if w.rank is not None}

    def _teardown(self) -> None:
        self._children.destroy()
        self._state = PoolState.BROKEN


class _Children:
    """The processes of one pool and their dump folder. ``destroy`` is idempotent and is
    the pool's finalizer too, so it holds no reference to the pool."""

    def __init__(self) -> None:
        self.processes: list[ChildProcess] = []   # workers in rank order, then the scheduler
        self.dump_dir: Path | None = None

    def add(self, child: ChildProcess) -> None:
        self.processes.append(child)
        self.processes.sort(key=lambda p: (p.role is Role.SCHEDULER, p.rank or 0))

    @property
    def workers(self) -> list[ChildProcess]:
        return [p for p in self.processes if p.role is Role.WORKER]

    @property
    def scheduler(self) -> ChildProcess | None:
        return next((p for p in self.processes if p.role is Role.SCHEDULER), None)

    def destroy(self) -> None:
        # every group is killed before any child is reaped: see [Note: process groups and reaping]
        for process in self.processes:
            process.kill_group()
        for process in self.processes:
            if process.reap(_REAP_TIMEOUT_S) is None:
                _log.warning("hyper_parallel.testing: %s (pid %d) did not die after SIGKILL", process.label,
                             process.pid)
            process.gone = True
            process.release()
        self.processes = []   # a restarted start adds a fresh set
        if self.dump_dir is not None:
            shutil.rmtree(self.dump_dir, ignore_errors=True)
            self.dump_dir = None


def _failure_of(event: Event) -> Failure | None:
    """The failure an event reports, if it reports one."""
    if isinstance(event, Death):
        return Failure.died(event.process, event.exit_code)
    if isinstance(event, ChannelClosed):
        return Failure.channel_closed(event.process)
    if isinstance(event.message, (Raised, StartFailed)):
        return Failure.raised(event.process, event.message.error)
    return None


def _pickle_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    if not callable(fn):
        raise TypeError(f"WorkerPool.run: fn={fn!r} is not callable")
    if getattr(fn, "__module__", None) == "__main__":
        raise TypeError(f"WorkerPool.run: {_qualified_name(fn)} is defined in __main__, which the ranks cannot "
                        "import by name; move it to an importable module")
    try:
        return pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(f"WorkerPool.run: cannot send {_qualified_name(fn)} and its arguments to the ranks ({exc}); "
                        "fn must be a module-level function of an importable module and args must pickle") from exc


def _qualified_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
