"""Messages between a ``WorkerPool`` (the parent) and its rank processes (the children).

Every message is a small frozen dataclass sent with ``multiprocessing.connection``. The
user's function, its arguments and its return value travel as *pickled bytes* inside
them, so that a pickling failure is reported as the failure of one call, never as a
broken channel.

This module is imported by the children before anything else: no framework (``Role``
comes from ``platform/launch.py``, which imports none).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.platform.launch import Role



# ---- parent -> child -------------------------------------------------------------

@dataclass(frozen=True)
class ChildSpec:
    """First message to every child: how to bootstrap.

    Launcher variables (``RANK``, ``MS_ROLE``, ...) are not here: they are in the child's
    environment from exec on, because a framework reads them when it is imported.
    """

    role: Role
    rank: int | None                 # None for the scheduler
    platform: str                    # as given to ``hyper_parallel.platform.init``
    sys_path: tuple[str, ...]        # the parent's, so ``fn`` resolves by the same names
    parent_pid: int                  # the child kills its process group when this one is gone
    stack_dump_path: str             # faulthandler writes stacks here (on a fatal signal or on request)
    collective_timeout_s: float      # passed to ``init_process_group(timeout_s=...)``


@dataclass(frozen=True)
class RunRequest:
    """Run ``fn(*args)``; ``payload`` is ``pickle.dumps((fn, args))``."""

    call_id: int
    payload: bytes


@dataclass(frozen=True)
class CloseRequest:
    """Leave the process group and exit 0."""


# ---- child -> parent -------------------------------------------------------------

@dataclass(frozen=True)
class RemoteError:
    """An exception raised in a child, flattened to text (exceptions may not pickle)."""

    type_name: str
    message: str
    traceback: str

    def summary(self, limit: int = 300) -> str:
        """``"ValueError: boom"``, cut to ``limit`` characters."""
        text = f"{self.type_name}: {self.message}" if self.message else self.type_name
        return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Ready:
    """The worker joined the process group; ``rank``/``world_size`` are the platform's answers."""

    rank: int
    world_size: int
    pid: int


@dataclass(frozen=True)
class StartFailed:
    """Bootstrap (platform selection, ``init_process_group``, the scheduler) raised."""

    error: RemoteError


@dataclass(frozen=True)
class Result:
    """``fn`` returned; ``data`` is ``pickle.dumps(value)``."""

    call_id: int
    data: bytes


@dataclass(frozen=True)
class Raised:
    """``fn`` raised (or its arguments or return value did not pickle)."""

    call_id: int
    error: RemoteError


ToChild = ChildSpec | RunRequest | CloseRequest
ToParent = Ready | StartFailed | Result | Raised
