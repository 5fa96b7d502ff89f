"""Turning what the children reported into one ``RankError``/``RankTimeout`` message.

A message reads, e.g.::

    WorkerPool('torch-cpu', world_size=4): run of tests.harness.test_pool.raise_on: rank 2 of 4 raised
    ValueError: bad input on rank 2
    also: rank 0 raised ValueError: ...
    ranks [1, 3] had not answered 3.0 s after the first failure
    The pool was torn down.

    --- remote traceback (rank 2) ---
    Traceback (most recent call last):
      ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hyper_parallel.platform.launch import describe_exit
from hyper_parallel.testing.errors import RankError, RankTimeout
from hyper_parallel.testing.process import ChildProcess
from hyper_parallel.testing.protocol import RemoteError

#: Other failures quoted in the message beyond the first (the rest are counted).
_MAX_OTHERS = 8
#: Characters of a dumped stack kept per rank in a message (the end: the innermost frames).
_MAX_STACK_CHARS = 4000


@dataclass(frozen=True)
class Failure:
    """One process's failure: what happened (``summary``) and the evidence."""

    process: ChildProcess
    summary: str                            # "raised ValueError: boom", "exited with code 3"
    remote_traceback: str | None = None     # when it raised
    exit_code: int | None = None            # when it died
    stack_dump: str = ""                    # faulthandler's output when it died of a fatal signal

    @classmethod
    def raised(cls, process: ChildProcess, error: RemoteError) -> Failure:
        return cls(process, f"raised {error.summary()}", remote_traceback=error.traceback)

    @classmethod
    def died(cls, process: ChildProcess, exit_code: int) -> Failure:
        return cls(process, f"(pid {process.pid}) {describe_exit(exit_code)}", exit_code=exit_code,
                   stack_dump=process.read_stack_dump())

    @classmethod
    def channel_closed(cls, process: ChildProcess) -> Failure:
        return cls(process, f"(pid {process.pid}) closed its channel to the parent without exiting")

    @classmethod
    def mismatch(cls, process: ChildProcess, rank: int, world_size: int, expected_world_size: int) -> Failure:
        return cls(process, f"joined as rank {rank} of {world_size}, expected rank {process.rank} of "
                            f"{expected_world_size}: the launcher environment did not reach the framework")


def failure_error(failures: Sequence[Failure], unanswered: Sequence[int], context: str,
                  grace_s: float | None) -> RankError:
    """The error for ``failures[0]`` (the first failure), quoting the others."""
    first = failures[0]
    world = _world_size(first.process)
    who = f"{first.process.label} of {world}" if first.process.rank is not None else f"{first.process.label}"
    lines = [f"{context}: {who} {first.summary}"]
    for other in failures[1:_MAX_OTHERS + 1]:
        lines.append(f"also: {other.process.label} {other.summary}")
    if len(failures) > _MAX_OTHERS + 1:
        lines.append(f"and {len(failures) - _MAX_OTHERS - 1} more failures")
    if unanswered and grace_s is not None:
        lines.append(f"ranks {list(unanswered)} had not answered {grace_s:.1f} s after the first failure")
    lines.append("The pool was torn down.")
    if first.remote_traceback:
        lines.append(f"\n--- remote traceback ({first.process.label}) ---\n{first.remote_traceback.rstrip()}")
    elif first.stack_dump:
        lines.append(f"\n--- Python stacks of {first.process.label} when it died ---\n"
                     f"{_tail(first.stack_dump)}")
    return RankError("\n".join(lines), rank=first.process.rank, remote_traceback=first.remote_traceback,
                     exit_code=first.exit_code)


def timeout_error(unanswered: Sequence[int], timeout_s: float, context: str,
                  stacks: dict[int, str]) -> RankTimeout:
    """The error for ranks that had not answered within ``timeout_s`` seconds."""
    lines = [f"{context}: ranks {list(unanswered)} had not answered after {timeout_s:.1f} s; "
             "every process of the pool was killed."]
    for rank in unanswered:
        if stacks.get(rank):
            lines.append(f"\n--- Python stacks of rank {rank} before it was killed ---\n{_tail(stacks[rank])}")
    return RankTimeout("\n".join(lines), ranks=tuple(unanswered), timeout_s=timeout_s, stacks=stacks)


def _world_size(process: ChildProcess) -> str:
    env = process.plan.env
    return env.get("WORLD_SIZE") or env.get("MS_WORKER_NUM") or "?"


def _tail(text: str) -> str:
    return text if len(text) <= _MAX_STACK_CHARS else "...\n" + text[-_MAX_STACK_CHARS:]
