"""``CheckpointPolicy`` and activation swapping: the names of selective checkpointing and
of offloading saved activations to host memory, which this project does not run yet.

[Note: what is refused in activation checkpointing]
``checkpoint_wrapper`` recomputes a whole module. Selective checkpointing (a
``policy_fn`` choosing a ``CheckpointPolicy`` per op, torch's
``create_selective_checkpoint_contexts``) and swapping (``MUST_SWAP``: saved activations
copied to host memory in the forward and back before the backward) are not built: the
functions that would run them raise ``NotImplementedError`` naming the supported path,
so code that only imports them (MindFormers imports all three at module level) loads,
and code that calls them fails before anything runs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

_SWAP = ("activation swap (saved activations offloaded to host memory, CheckpointPolicy.MUST_SWAP) is not "
         "supported yet; recompute the module instead with checkpoint_wrapper(module)")


class CheckpointPolicy(enum.Enum):
    """What to do with one op's output under selective checkpointing (torch's
    ``torch.utils.checkpoint.CheckpointPolicy`` values, plus MindSpore's ``MUST_SWAP``)."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4


def swap_wrapper(module: Any, policy_fn: Callable[..., Any] | None = None) -> Any:
    """Swap ``module``'s saved activations to host memory: not supported yet.

    Raises:
        NotImplementedError: always (see [Note: what is refused in activation checkpointing]).
    """
    raise NotImplementedError(f"swap_wrapper: {_SWAP}")


class SwapManager:
    """The prefetch order of swapped layers: not supported yet (see [Note: what is refused
    in activation checkpointing]).

    Raises:
        NotImplementedError: on construction.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"SwapManager: {_SWAP}")
