"""How each rank of a launched run ended, and which failure came first.

[Note: the first rank to fail]
When one rank dies, the others fail too, as consequences: their next collective finds the
connection gone (gloo: ``Connection reset by peer``) and raises. A report that lists the
ranks' errors in rank order names a survivor's ``Connection reset`` first and hides the
cause, and a rank killed by a signal (the out-of-memory killer, ``kill -9``, a crash in
native code) leaves no Python traceback at all. So every rank started by ``launch.py``
runs under a supervisor (``supervise``): the rank's process forks before it imports a
framework; the child runs the rank, the parent waits for it and, when it exits non-zero,
writes ``<out>/.ranks/rank_N.exit`` (JSON: exit code or signal, the child's pid, the wall
time of the exit), then exits the same way (the same code, or the same signal), so the
launcher above it (torchrun, or ``launch.py`` for MindSpore) sees what it would have seen.
``report`` orders the ranks by the time they exited: the first is the failure, the others
its consequences. A rank that raised also has ``rank_N.error`` (its traceback, written by
``rank.run_rank``), from which the report takes the last line.

The child dies with its supervisor (``PR_SET_PDEATHSIG``, Linux), so killing either process
of a rank ends both; torchrun's and ``launch.py``'s group kills reach both anyway (one
process group). All ranks of a launch are on this host, so their wall times compare.

[Note: stacks of a hung run]
A run that exceeds ``--timeout`` has no failed rank: every rank waits, most of them in a
collective for one that is somewhere else. Killing them leaves nothing to say where. So
each rank arms faulthandler's watchdog (``stacks_on_timeout``: a native thread, which
writes even while the rank's threads are blocked inside a collective's native code) to
write every thread's Python stack to ``<out>/.ranks/rank_N.stacks`` a few seconds before
the timeout, and the launcher quotes each rank's innermost frames (``hung_report``) before
it kills the group. The watchdog needs no signal from the launcher, so it works the same
under torchrun and msrun.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hyper_parallel.platform.launch import exit_status

#: the folder under ``--out`` with each failed rank's ``rank_N.error`` and ``rank_N.exit``
ERROR_DIR = ".ranks"

#: ``prctl`` option: the signal the calling process gets when its parent exits (linux/prctl.h)
_PR_SET_PDEATHSIG = 1


def exit_path(run_dir: Path, rank: int) -> Path:
    return run_dir / ERROR_DIR / f"rank_{rank}.exit"


def error_path(run_dir: Path, rank: int) -> Path:
    return run_dir / ERROR_DIR / f"rank_{rank}.error"


def stacks_path(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes every thread's Python stack when the run outlives its
    ``--timeout`` ([Note: stacks of a hung run])."""
    return run_dir / ERROR_DIR / f"rank_{rank}.stacks"


#: seconds before ``--timeout`` at which a rank dumps its stacks (at most a tenth of the timeout)
STACK_DUMP_LEAD_S = 10.0


@contextlib.contextmanager
def stacks_on_timeout(run_dir: Path, rank: int, timeout_s: float) -> Iterator[None]:
    """While inside, a rank still running shortly before ``timeout_s`` (seconds from now)
    writes every thread's Python stack to ``stacks_path`` ([Note: stacks of a hung run])."""
    path = stacks_path(run_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        dump = path.open("w")
    except OSError:  # an unwritable --out fails the run later, with its own message
        yield
        return
    with dump:
        faulthandler.dump_traceback_later(max(timeout_s - min(STACK_DUMP_LEAD_S, timeout_s / 10), 1.0),
                                          file=dump, exit=False)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            path.unlink()
            path.parent.rmdir()  # only when empty: a failed rank's files stay


#: ``"exit code 1"`` / ``"killed by signal 9 (SIGKILL)"`` (the harness's wording: ``platform/launch``)
describe_exit = exit_status


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the supervisor) exits."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def supervise(run_dir: Path, rank: int) -> None:
    """Fork (see [Note: the first rank to fail]). Returns in the child, which then runs the
    rank; the parent never returns: it waits for the child, records a non-zero exit in
    ``exit_path(run_dir, rank)`` and ends the same way.

    Call it before any framework is imported: the process must be single-threaded to fork.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with_parent()
        if os.getppid() != parent:  # the supervisor died before the request took effect
            os._exit(1)
        return
    # A SIGINT meant for the group reaches the child too; the supervisor outlives it to
    # record how it ended. SIGTERM (torchrun and launch.py stopping the run) ends both.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        record = {"rank": rank, "pid": child, "exit_code": code, "how": describe_exit(code), "time": time.time()}
        path = exit_path(run_dir, rank)
        with contextlib.suppress(OSError):  # an unwritable --out must not hide the exit status
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".exit.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)  # the launcher never reads half a record
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP take no handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)


@dataclass(frozen=True)
class RankExit:
    """How one rank ended, as far as its files under ``<out>/.ranks`` tell."""

    rank: int
    time: float | None  # wall time of the exit (seconds since the epoch); None: not recorded
    how: str | None  # describe_exit of its exit status; None: not recorded
    error: str | None  # the last line of its traceback; None: it left none
    traceback: Path | None


def rank_exits(run_dir: Path) -> list[RankExit]:
    """The failed ranks found under ``<run_dir>/.ranks``, the first to exit first (ranks
    without an exit record, whose supervisor was killed too, after the others, by the
    time of their traceback)."""
    folder = run_dir / ERROR_DIR
    if not folder.is_dir():
        return []
    records: dict[int, dict[str, object]] = {}
    for path in folder.glob("rank_*.exit"):
        with contextlib.suppress(OSError, ValueError):
            records[int(path.stem.split("_")[1])] = json.loads(path.read_text())
    errors = {int(path.stem.split("_")[1]): path for path in folder.glob("rank_*.error")}
    exits = []
    for rank in sorted(set(records) | set(errors)):
        record, error = records.get(rank, {}), errors.get(rank)
        last = None
        if error is not None:
            lines = [line for line in error.read_text().strip().splitlines() if line.strip()]
            last = lines[-1] if lines else None
        when = record.get("time")
        exits.append(RankExit(rank, float(when) if isinstance(when, (int, float)) else None,
                              str(record["how"]) if "how" in record else None, last, error))
    never = float("inf")
    return sorted(exits, key=lambda e: (e.time is None, e.time if e.time is not None else
                                        (e.traceback.stat().st_mtime if e.traceback else never), e.rank))


def _line(e: RankExit) -> str:
    if e.error is None:
        return (f"rank {e.rank} failed: {e.how or 'it ended'} without a Python error (a kill, the out-of-memory "
                "killer, or a crash in native code)")
    parts = [part for part in (e.how, f"traceback: {e.traceback}" if e.traceback else None) if part]
    return f"rank {e.rank} failed: {e.error}" + (f" ({'; '.join(parts)})" if parts else "")


def _innermost(dump: str, frames: int = 4) -> list[str]:
    """The innermost ``frames`` frames of each thread in a faulthandler dump (it writes the
    innermost first), as ``thread: frame <- frame ...`` lines in the dump's order."""
    lines, thread, taken = [], "", []
    for line in [*dump.splitlines(), ""]:
        if not line.startswith("  "):
            if thread and taken:
                lines.append(f"{thread} {' <- '.join(taken)}")
            thread, taken = line.strip().rstrip(":").replace(" (most recent call first)", ""), []
        elif len(taken) < frames:
            taken.append(line.strip().removeprefix("File "))
    return lines


def hung_report(run_dir: Path) -> str:
    """Where each rank was when the run timed out: the innermost frames of every thread,
    from the stacks the ranks wrote ([Note: stacks of a hung run]); ``""`` if none did."""
    parts = []
    folder = run_dir / ERROR_DIR
    paths = folder.glob("rank_*.stacks") if folder.is_dir() else []
    for path in sorted(paths, key=lambda path: int(path.stem.split("_")[1])):
        rank = int(path.stem.split("_")[1])
        dump = ""
        with contextlib.suppress(OSError):
            dump = path.read_text()
        if dump.strip():
            parts.append(f"rank {rank} ({path}):\n" + "\n".join(f"  {line}" for line in _innermost(dump)))
    return "where the ranks were at the timeout (innermost frame first):\n" + "\n".join(parts) if parts else ""


def report(run_dir: Path) -> str:
    """The failed ranks of the run in ``run_dir``: the first to exit, then the others as
    its consequences (``""`` if no rank left a record)."""
    exits = rank_exits(run_dir)
    if not exits:
        return ""
    first, rest = exits[0], exits[1:]
    text = f"first failure: {_line(first)}"
    if rest:
        text += f"\nthen, as consequences of rank {first.rank}'s failure:\n" + "\n".join(f"  {_line(e)}" for e in rest)
    return text
