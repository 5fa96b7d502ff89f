"""Where a checkpointed forward is running: the first forward or its recomputation.

A ``contextvars.ContextVar`` (the pattern of [Note: where the active context lives] in
``core/context_parallel/context``): set by ``checkpoint`` around each run of the
checkpointed function and reset after it, per thread, immutable values, nothing kept
between calls. Hooks that must behave differently inside a checkpointed region read it
(fully_shard refuses a unit there). Kept apart from ``checkpoint`` so that fully_shard
can import it without importing the wrapper, which imports fully_shard.

A recomputation may be stopped early by the framework (torch stops once the last saved
tensor the backward needs is recomputed), skipping the forward post-hooks of the modules
it was in. Code that puts something in place for a recomputation and must take it away
registers that with ``on_recompute_exit``; ``checkpoint`` runs the callbacks when the
recomputation ends, however it ends. The list lives in a ContextVar set per recomputation.
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Callable


class CheckpointPhase(enum.Enum):
    """What a checkpointed function is doing: ``FORWARD`` (the forward, saving nothing
    for backward) or ``RECOMPUTE`` (its second run, inside the backward)."""

    FORWARD = "forward"
    RECOMPUTE = "recompute"


#: The phase of the innermost checkpointed function running in this thread/task.
_PHASE: contextvars.ContextVar[CheckpointPhase | None] = contextvars.ContextVar("hyper_parallel_checkpoint_phase",
                                                                                default=None)


def checkpoint_phase() -> CheckpointPhase | None:
    """The phase of the innermost checkpointed function running now in this thread, or
    ``None`` outside every checkpointed region."""
    return _PHASE.get()


#: How many checkpointed forwards (``FORWARD`` phases) have begun in this thread/task.
_FORWARDS: contextvars.ContextVar[int] = contextvars.ContextVar("hyper_parallel_checkpoint_forwards", default=0)


def checkpointed_forwards() -> int:
    """How many checkpointed forwards have begun in this thread so far: code that runs
    before and after a call (a module's hooks) learns from the difference whether a
    region ran inside it, so it will be recomputed in the backward."""
    return _FORWARDS.get()


#: The callbacks to run when the innermost recomputation running here ends.
_EXIT: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "hyper_parallel_recompute_exit", default=None)


def on_recompute_exit(callback: Callable[[], None]) -> None:
    """Run ``callback()`` when the recomputation running now ends (normally, or stopped
    early by the framework, which skips forward post-hooks).

    Raises:
        RuntimeError: no recomputation is running here.
    """
    callbacks = _EXIT.get()
    if callbacks is None:
        raise RuntimeError("on_recompute_exit: called outside a recomputation; check "
                           "checkpoint_phase() is CheckpointPhase.RECOMPUTE first")
    callbacks.append(callback)
