"""One child process of a pool, seen from the parent: spawn, talk, watch, kill, reap.

[Note: process groups and reaping]
Every child is started in its own session (``start_new_session=True``), so its process
group id is its pid and ``os.killpg`` also reaches anything it started (a framework's
helper processes, a test's subprocess). A group is only signalled while its leader is
known not to be reaped: a dead-but-unreaped child is a zombie whose pid (and so group
id) cannot be reused. That is why exit status is read with ``waitid(WNOWAIT)``, which
leaves the zombie in place, and the child is reaped only by ``reap()``, after
``kill_group()``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import hyper_parallel
from hyper_parallel.platform.launch import ProcessPlan
from hyper_parallel.testing.protocol import ChildSpec, Role, ToChild, ToParent

#: The child's command line: argv[1] is the fd of its end of the socket pair.
_BOOTSTRAP = "import sys; from hyper_parallel.testing.worker import main; main(int(sys.argv[1]))"

#: Sent to a hung rank to make faulthandler dump its Python stacks before it is killed.
STACK_DUMP_SIGNAL = signal.SIGUSR1


class ChildProcess:
    """A rank process or a scheduler, with its message channel and exit notification."""

    def __init__(self, plan: ProcessPlan, popen: subprocess.Popen[bytes], conn: Connection,
                 pidfd: int | None, stack_dump_path: Path) -> None:
        self.plan = plan
        self.popen = popen
        self.conn: Connection | None = conn   # None once closed
        self.pidfd = pidfd                     # readable when the process exits; None: kernel without pidfd
        self.stack_dump_path = stack_dump_path
        self.gone = False                      # its death has been reported to the pool

    # ---- creation --------------------------------------------------------------

    @classmethod
    def spawn(cls, plan: ProcessPlan, spec: ChildSpec) -> ChildProcess:
        """Start the child and send it ``spec``.

        The environment is the parent's, plus ``plan.env``, plus a ``PYTHONPATH`` that
        makes this ``hyper_parallel`` importable before ``spec.sys_path`` is applied.
        """
        env = dict(os.environ)
        env.update(plan.env)
        # the directory the parent imported hyper_parallel from (symlinks kept: same package, same path)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(hyper_parallel.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        parent_end, child_end = socket.socketpair()
        with child_end:
            popen = subprocess.Popen(  # noqa: S603 - our own interpreter and bootstrap, no shell
                [sys.executable, "-c", _BOOTSTRAP, str(child_end.fileno())],
                env=env, pass_fds=(child_end.fileno(),), start_new_session=True, stdin=subprocess.DEVNULL,
            )
        # a socket pair is exactly what multiprocessing.Pipe(duplex=True) builds on POSIX
        conn = Connection(parent_end.detach())
        child = cls(plan, popen, conn, _open_pidfd(popen.pid), Path(spec.stack_dump_path))
        child.send(spec)
        return child

    # ---- identity --------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def rank(self) -> int | None:
        return self.plan.rank

    @property
    def role(self) -> Role:
        return self.plan.role

    @property
    def label(self) -> str:
        """``"rank 2"`` or ``"the scheduler"``."""
        return self.plan.label

    # ---- messages --------------------------------------------------------------

    def send(self, message: ToChild) -> bool:
        """Send ``message``; False when the channel is closed or broken (the child is gone)."""
        if self.conn is None:
            return False
        try:
            self.conn.send(message)
        except (OSError, EOFError, ValueError):
            return False
        return True

    def receive_available(self) -> tuple[list[ToParent], bool]:
        """Every message already readable, and whether the channel reached end of file.

        Never blocks on an idle channel; a message that is being written is read to its end.
        """
        messages: list[ToParent] = []
        if self.conn is None:
            return messages, True
        try:
            while self.conn.poll(0):
                messages.append(self.conn.recv())
        except (EOFError, OSError):
            self.close_channel()
            return messages, True
        return messages, False

    def close_channel(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    # ---- exit ------------------------------------------------------------------

    def exit_code(self) -> int | None:
        """The exit status if the process has ended (negative: killed by that signal),
        else ``None``. Does not reap (see the note at the top of this module)."""
        if self.popen.returncode is not None:
            return self.popen.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by someone else: ask Popen, which may know
            return self.popen.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def wait_exit(self, timeout_s: float) -> int | None:
        """Block up to ``timeout_s`` seconds for the process to end; its status or ``None``."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.exit_code()
            remaining = deadline - time.monotonic()
            if code is not None or remaining <= 0:
                return code
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], remaining)
            else:
                time.sleep(min(0.1, remaining))

    def request_stack_dump(self) -> bool:
        """Ask the (hung) process to write its Python stacks to ``stack_dump_path``."""
        if self.exit_code() is not None:
            return False
        try:
            os.kill(self.pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            return False
        return True

    def stack_dump_size(self) -> int:
        """Bytes written to ``stack_dump_path`` so far."""
        try:
            return self.stack_dump_path.stat().st_size
        except OSError:
            return 0

    def read_stack_dump(self) -> str:
        """What faulthandler wrote (a fatal signal or a requested dump); ``""`` if nothing."""
        try:
            return self.stack_dump_path.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            return ""

    def kill_group(self) -> None:
        """SIGKILL the process and everything in its process group, if not yet reaped."""
        if self.popen.returncode is not None:
            return  # reaped: its pid may already belong to another process
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
                kill(self.pid, signal.SIGKILL)

    def reap(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` seconds for the exit status and release the pid."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def release(self) -> None:
        """Close the channel and the pidfd (after ``reap``)."""
        self.close_channel()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _open_pidfd(pid: int) -> int | None:
    # Linux >= 5.3: a descriptor that becomes readable when the process exits, so the
    # pool sleeps in one wait() on channels and exits together instead of polling.
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
