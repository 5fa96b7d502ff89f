"""Exceptions raised by the harness in the parent process."""

from __future__ import annotations

from typing import Any


class RankError(RuntimeError):
    """A rank process failed: it raised, died, or (``RankTimeout``) did not answer.

    The message names the first failing rank and, when it raised, ends with its remote
    traceback. After a ``RankError`` the pool that raised it has been torn down.

    Attributes:
        rank: the first failing rank; ``None`` when the failing process has no rank
            (MindSpore's scheduler).
        remote_traceback: the formatted traceback from the rank process when it raised,
            else ``None``.
        exit_code: the process's exit status when it died (negative: killed by that
            signal number), else ``None``.
    """

    def __init__(self, message: str, *, rank: int | None, remote_traceback: str | None = None,
                 exit_code: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only fields would be lost by BaseException's default (args-only) pickling
        return _rebuild, (type(self), str(self), dict(self.__dict__))


class RankTimeout(RankError):
    """The call (or the pool start) did not finish within its timeout; every process of
    the pool was killed.

    Attributes:
        ranks: the ranks that had not answered, ascending; ``rank`` is the first of them.
        timeout_s: the timeout that expired, in seconds.
        stacks: rank -> the Python stacks faulthandler dumped from that rank just before
            it was killed (empty string when the rank could not dump).
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...], timeout_s: float,
                 stacks: dict[int, str] | None = None) -> None:
        super().__init__(message, rank=ranks[0] if ranks else None)
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.stacks = dict(stacks or {})


def _rebuild(cls: type[RankError], message: str, state: dict[str, Any]) -> RankError:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, message)
    error.__dict__.update(state)
    return error
