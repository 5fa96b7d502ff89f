"""Process checks for the harness tests, without psutil."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable


def process_exists(pid: int) -> bool:
    """Whether ``pid`` is a running process. A zombie counts as gone: it has exited and
    only waits for its (new) parent to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Poll (0.1 s) until none of ``pids`` exists or ``timeout_s`` seconds pass; the survivors."""
    deadline = time.monotonic() + timeout_s
    alive = [pid for pid in pids if process_exists(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if process_exists(pid)]
    return alive
