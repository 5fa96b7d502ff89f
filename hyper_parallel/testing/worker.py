"""The entry point of a pool's child processes (rank workers and the MindSpore scheduler).

A child is started by ``hyper_parallel.testing.process`` as
``python -c "...main(fd)"`` with the launcher's variables already in its environment, in
its own session. It then:

1. reads its ``ChildSpec`` from the parent and adopts the parent's ``sys.path``;
2. starts a watchdog that kills its whole process group when the parent is gone
   (the parent may be SIGKILLed and never get to clean up);
3. worker: selects the platform and joins the process group, reports ``Ready`` and
   serves ``RunRequest``\\ s until ``CloseRequest`` (leave the group, exit 0) or end of
   file (the parent died: kill the group);
   scheduler: runs ``hyper_parallel.platform.mindspore.run_scheduler()`` until the
   cluster ends.

Failed starts exit through ``os._exit`` after flushing stdio: framework atexit handlers
can block on a half-initialised cluster. A clean close exits normally (see there why).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import IO, Any, NoReturn

from hyper_parallel.testing.protocol import (
    ChildSpec,
    CloseRequest,
    Raised,
    Ready,
    RemoteError,
    Result,
    Role,
    RunRequest,
    StartFailed,
)

#: How often the watchdog checks that the parent is alive (seconds).
_PARENT_POLL_S = 0.5
#: Same signal as ``process.STACK_DUMP_SIGNAL``; not imported from there to keep this
#: module's imports to the protocol alone.
_STACK_DUMP_SIGNAL = signal.SIGUSR1


def main(fd: int) -> NoReturn:
    """Run a child; ``fd`` is its end of the socket pair to the parent."""
    conn = Connection(fd)
    # a process this child starts must not inherit the channel: the parent would then
    # never see end of file when this child dies
    os.set_inheritable(fd, False)
    spec = conn.recv()
    if not isinstance(spec, ChildSpec):
        raise TypeError(f"hyper_parallel.testing.worker: expected a ChildSpec first, got {type(spec).__name__}")
    sys.path[:] = list(spec.sys_path)
    _start_parent_watchdog(spec.parent_pid, spec.stack_dump_path)
    dump_file = open(spec.stack_dump_path, "w", encoding="utf-8")  # noqa: SIM115 - open for the process lifetime
    _enable_stack_dumps(dump_file)
    if spec.role is Role.SCHEDULER:
        _scheduler_main(conn, spec)
    _worker_main(conn, spec, dump_file)


def _scheduler_main(conn: Connection, spec: ChildSpec) -> NoReturn:
    try:
        from hyper_parallel.platform import BACKENDS
        from hyper_parallel.platform.mindspore import run_scheduler

        # "mindspore-ascend" -> "ascend"; a bare "mindspore" lets the framework decide
        run_scheduler(BACKENDS[spec.platform][1] if spec.platform in BACKENDS else None)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        _send_quietly(conn, StartFailed(_remote_error(exc)))
        _exit(1)
    _exit(0)


def _worker_main(conn: Connection, spec: ChildSpec, dump_file: IO[str]) -> NoReturn:
    try:
        from hyper_parallel.platform import init

        platform = init(spec.platform)
        platform.init_process_group(timeout_s=spec.collective_timeout_s)
        rank, world_size = platform.rank(), platform.world_size()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        _send_quietly(conn, StartFailed(_remote_error(exc)))
        _exit(1)
    # the framework may have installed its own handler for the dump signal while initialising
    _enable_stack_dumps(dump_file)
    conn.send(Ready(rank=rank, world_size=world_size, pid=os.getpid()))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            # the parent died (a pool it tears down is killed before its channel closes)
            _die_orphaned(spec.stack_dump_path)
        if isinstance(request, RunRequest):
            conn.send(_execute(request))
        elif isinstance(request, CloseRequest):
            try:
                platform.destroy_process_group()
            except BaseException:  # noqa: BLE001 - exiting anyway; the parent sees the exit code
                traceback.print_exc()
                _exit(1)
            # a normal interpreter exit, not os._exit: MindSpore unregisters the node from
            # its scheduler in finalizers, and the scheduler only ends once every node has
            # (else it waits out the heartbeat timeout and exits 1). close() bounds the wait.
            sys.exit(0)
        else:
            raise TypeError(f"hyper_parallel.testing.worker: unexpected request {type(request).__name__}")


def _execute(request: RunRequest) -> Result | Raised:
    try:
        fn, args = pickle.loads(request.payload)
    except BaseException as exc:  # noqa: BLE001 - e.g. fn's module is not importable here
        return Raised(request.call_id, _remote_error(exc, context="could not unpickle fn and its arguments"))
    try:
        value = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: a test's sys.exit() is a failure to report
        return Raised(request.call_id, _remote_error(exc))
    try:
        return Result(request.call_id, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # noqa: BLE001
        return Raised(request.call_id, _remote_error(
            exc, context=f"{_name(fn)} returned a {type(value).__name__} that cannot be pickled; return plain "
                         "values or numpy arrays"))


def _remote_error(exc: BaseException, context: str = "") -> RemoteError:
    message = str(exc)
    if context:
        message = f"{context}: {message}" if message else context
    return RemoteError(type_name=type(exc).__qualname__, message=message,
                       traceback="".join(traceback.format_exception(exc)))


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _enable_stack_dumps(dump_file: IO[str]) -> None:
    # fatal signals (segfault, abort) and the parent's request on a timeout both write
    # every thread's Python stack into the file, which the parent quotes in its error
    faulthandler.enable(file=dump_file, all_threads=True)
    faulthandler.register(_STACK_DUMP_SIGNAL, file=dump_file, all_threads=True, chain=False)


def _start_parent_watchdog(parent_pid: int, stack_dump_path: str) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        _die_orphaned(stack_dump_path)  # reparented: the parent is gone

    threading.Thread(target=watch, name="hyper_parallel-parent-watchdog", daemon=True).start()


def _die_orphaned(stack_dump_path: str) -> NoReturn:
    """The parent is gone and cannot clean up any more: remove this child's dump file,
    and the pool's folder once it is empty (the last child to get here finds it so), then
    kill this child's process group: itself and anything it started (the killing thread
    needs no GIL from a main thread that may be stuck in C)."""
    with contextlib.suppress(OSError):
        os.unlink(stack_dump_path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(stack_dump_path))
    os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(1)  # not reached: SIGKILL is delivered to this process too

def _send_quietly(conn: Connection, message: StartFailed) -> None:
    with contextlib.suppress(OSError, EOFError):  # the parent is gone: nobody to tell
        conn.send(message)


def _exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to save
            stream.flush()
    os._exit(code)
