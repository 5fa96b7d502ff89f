"""Where a checkpointed forward is running: the first forward or its recomputation.

A ``contextvars.ContextVar`` (the pattern of [Note: where the active context lives] in
``core/context_parallel/context``): set by ``checkpoint`` around each run of the
checkpointed function and reset after it, per thread, immutable values, nothing kept
between calls. Hooks that must behave differently inside a checkpointed region read it
(fully_shard refuses a unit there). Kept apart from ``checkpoint`` so that fully_shard
can import it without importing the wrapper, which imports fully_shard.
"""

from __future__ import annotations

import contextvars
import enum


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
