"""Waiting on a pool's children: one blocking ``wait()`` on every channel and exit
descriptor, turned into an ordered list of events.

[Note: which failure comes first]
When a rank dies inside a collective, its peers' collectives fail a moment later and
they report exceptions that only echo the death. Within one batch of events (and within
``TIE_WINDOW_S`` after a reported exception) a death therefore comes before messages
from other processes, so the dead rank is named as the first failure. A process's own
messages still come before its own death: they were sent while it was alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait

from hyper_parallel.testing.process import ChildProcess
from hyper_parallel.testing.protocol import Raised, StartFailed, ToParent

#: Longest single wait (seconds). Events wake the pool at once; this only bounds how
#: late a deadline is noticed and how often exits are polled without pidfds.
POLL_INTERVAL_S = 0.25
#: After an exception is reported, deaths are awaited this long (seconds) before the
#: exception is taken as the first failure (see the note above).
TIE_WINDOW_S = 0.05
#: A channel at end of file: how long (seconds) to wait for the exit that usually follows,
#: so that the failure is reported with its exit status.
EXIT_AFTER_EOF_S = 1.0


@dataclass(frozen=True)
class Message:
    """A message from ``process``."""

    process: ChildProcess
    message: ToParent


@dataclass(frozen=True)
class Death:
    """``process`` exited; reported once per process (then ``process.gone`` is set)."""

    process: ChildProcess
    exit_code: int


@dataclass(frozen=True)
class ChannelClosed:
    """``process`` closed its channel but had not exited ``EXIT_AFTER_EOF_S`` later (or
    the caller did not wait); its exit is still watched and reported as a ``Death``."""

    process: ChildProcess


Event = Message | Death | ChannelClosed


def next_events(processes: Sequence[ChildProcess], timeout_s: float,
                exit_after_eof_s: float = EXIT_AFTER_EOF_S) -> list[Event]:
    """Block up to ``timeout_s`` seconds for messages, closed channels or exits of
    ``processes``; the events in the order of the note above, ``[]`` on timeout.

    ``exit_after_eof_s``: seconds to wait for the exit after an end of file (0 when
    exits are expected, as in ``close``).
    """
    events = _collect(processes, timeout_s, exit_after_eof_s)
    if any(isinstance(e, Message) and isinstance(e.message, (Raised, StartFailed)) for e in events) \
            and not any(isinstance(e, Death) for e in events):
        events = [*events, *_collect(processes, TIE_WINDOW_S, exit_after_eof_s, exits_only=True)]
    return _order(events)


def _collect(processes: Sequence[ChildProcess], timeout_s: float, exit_after_eof_s: float,
             exits_only: bool = False) -> list[Event]:
    watched: dict[int, ChildProcess] = {}
    for process in processes:
        if process.gone:
            continue
        if process.conn is not None and not exits_only:
            watched[process.conn.fileno()] = process
        if process.pidfd is not None:
            watched[process.pidfd] = process
    ready = wait(list(watched), timeout=max(0.0, timeout_s)) if watched else []
    touched = {id(watched[fd]): watched[fd] for fd in ready if isinstance(fd, int)}  # only ints were passed
    # without pidfds an exit is only seen by polling (or by the channel's end of file)
    for process in processes:
        if not process.gone and process.pidfd is None and process.exit_code() is not None:
            touched[id(process)] = process
    events: list[Event] = []
    for process in touched.values():
        had_channel = process.conn is not None
        messages, eof = process.receive_available()
        events.extend(Message(process, m) for m in messages)
        code = process.exit_code()
        if code is None and eof and had_channel and exit_after_eof_s > 0:
            code = process.wait_exit(exit_after_eof_s)
        if code is not None:
            process.gone = True
            process.close_channel()
            events.append(Death(process, code))
        elif eof and had_channel:
            events.append(ChannelClosed(process))
    return events


def _order(events: list[Event]) -> list[Event]:
    talked = {id(e.process) for e in events if isinstance(e, Message)}

    def rank(event: Event) -> int:
        return 0 if isinstance(event, Death) and id(event.process) not in talked else 1

    return sorted(events, key=rank)  # stable: each process's own events keep their order
