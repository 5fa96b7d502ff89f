"""The entry point of a pool's child processes (rank workers and the MindSpore scheduler).

A child is started by ``hyper_parallel.testing.process`` as
``python -c "...main(fd)"`` with the launcher's variables already in its environment, in
its own session. It then:

1. reads its ``ChildSpec`` from the parent and adopts the parent's ``sys.path``;
2. forks a sentinel that kills its whole process group when the parent is gone
   (the parent may be SIGKILLed and never get to clean up); see [Note: the sentinel];
3. worker: selects the platform and joins the process group, reports ``Ready`` and
   serves ``RunRequest``\\ s until ``CloseRequest`` (leave the group, exit 0) or end of
   file (the parent died: kill the group);
   scheduler: runs ``hyper_parallel.platform.mindspore.run_scheduler()`` until the
   cluster ends.

Failed starts exit through ``os._exit`` after flushing stdio: framework atexit handlers
can block on a half-initialised cluster. A clean close exits normally (see there why).

[Note: the sentinel]
The watcher of the parent is a separate process, not a thread of the child: a thread
needs the GIL, and a framework's C++ code may hold it for as long as it blocks. The
MindSpore scheduler does: ``mindspore.communication.init()`` holds the GIL until the
cluster ends, so a watchdog thread in it stayed frozen in ``time.sleep`` after its
parent was SIGKILLed, and the scheduler outlived the parent by ``MS_NODE_TIMEOUT``
seconds (until it noticed its workers were gone). The sentinel is forked first thing
(no thread and no framework exists yet, so the fork is cheap and safe), stays in the
child's process group, and sleeps in ``select`` on process descriptors (pidfds) of the
parent and of the child: the parent's end kills the group at once; the child's end (a
clean exit) ends the sentinel.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import select
import signal
import sys
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

#: How often the sentinel checks that the parent is alive (seconds) where it cannot
#: sleep on process descriptors (kernels before Linux 5.3, other systems); with them it
#: is woken at once and this is only a safety net.
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
    _start_sentinel(spec.parent_pid, spec.stack_dump_path, fd)
    sys.path[:] = list(spec.sys_path)
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


def _start_sentinel(parent_pid: int, stack_dump_path: str, channel_fd: int) -> None:
    """Fork the process that kills this child's process group once ``parent_pid`` is gone
    (see [Note: the sentinel]); returns in the child, never in the sentinel."""
    parent_fd = _pidfd(parent_pid)
    if os.getppid() != parent_pid:  # already reparented; also: parent_fd may name a new process
        _die_orphaned(stack_dump_path)
    child_pid = os.getpid()
    child_fd = _pidfd(child_pid)
    if os.fork() != 0:
        for pidfd in (parent_fd, child_fd):
            if pidfd is not None:
                os.close(pidfd)
        return
    # the sentinel: it must not keep the channel open (the parent sees end of file
    # when the child dies) nor be mistaken for the child
    try:
        os.close(channel_fd)
        fds = [fd for fd in (parent_fd, child_fd) if fd is not None]
        while True:
            if not _alive(parent_pid, parent_fd):
                _die_orphaned(stack_dump_path)
            if os.getppid() != child_pid or (child_fd is not None and not _alive(child_pid, child_fd)):
                os._exit(0)  # the child is gone: its parent saw the exit and owns the cleanup
            select.select(fds, [], [], _PARENT_POLL_S)
    except BaseException:  # noqa: BLE001 - the sentinel never returns into the child's code
        traceback.print_exc()
        os._exit(1)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux >= 5.3), else ``None``."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _alive(pid: int, pidfd: int | None) -> bool:
    if pidfd is not None:
        return not select.select([pidfd], [], [], 0)[0]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_orphaned(stack_dump_path: str) -> NoReturn:
    """The parent is gone and cannot clean up any more: remove this child's dump file,
    and the pool's folder once it is empty (the last child to get here finds it so), then
    kill this child's process group: itself, its sentinel and anything it started."""
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
