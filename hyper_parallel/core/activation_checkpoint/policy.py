"""``CheckpointPolicy``: what to do with one op's output under selective checkpointing
(torch's names) or with one saved tensor under activation swap (MindSpore's
``MUST_SWAP``, see [Note: activation swap] in ``swap``); and the translation of a
selective-checkpointing ``policy_fn`` into the platform's ``recompute(keep=)``.

[Note: what is refused in activation checkpointing]
``checkpoint_wrapper(output_recompute=True)`` (MindSpore's merging of adjacent
recomputed blocks, whose output is then not kept by the next one) runs where the platform
has ``Capability.OUTPUT_RECOMPUTE`` (MindSpore, whose ``recompute`` does it) and raises
``NotImplementedError`` at wrap time elsewhere (torch's checkpoint has no counterpart). A
selective policy answering ``MUST_SWAP`` for an op is refused: swapping is per saved
tensor, ``swap_wrapper``'s policy.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any


class CheckpointPolicy(enum.Enum):
    """What to do with one op's output under selective checkpointing (torch's
    ``torch.utils.checkpoint.CheckpointPolicy`` values: ``*_SAVE`` keeps the output from
    the forward, ``*_RECOMPUTE`` recomputes it; ``MUST`` and ``PREFER`` act the same
    outside a compiler), or with one saved tensor under activation swap (``MUST_SWAP``:
    copied to host; ``MUST_SAVE`` / ``PREFER_SAVE``: kept on the device)."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4


@dataclasses.dataclass(frozen=True)
class SelectiveCheckpointContext:
    """What a selective-checkpointing ``policy_fn`` is told besides the op and its
    inputs (torch's ``SelectiveCheckpointContext``): ``op_output`` is what the op
    returned. The policy is consulted in the forward only, so ``is_recompute`` is always
    ``False`` (kept for torch's signature)."""

    is_recompute: bool
    op_output: Any = None


def check_policy_fn(policy_fn: Any, caller: str) -> None:
    """Raises ``TypeError`` naming ``caller`` when ``policy_fn`` is neither ``None`` nor callable."""
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"{caller}: policy_fn={policy_fn!r} is not callable; pass a function "
                        "(ctx, op, *args, **kwargs) -> CheckpointPolicy")


_SAVE = frozenset({"MUST_SAVE", "PREFER_SAVE"})
_RECOMPUTE = frozenset({"MUST_RECOMPUTE", "PREFER_RECOMPUTE"})


def keep_outputs(policy_fn: Callable[..., Any]) -> Callable[[Any, tuple[Any, ...], dict[str, Any], Any], bool]:
    """The platform's ``recompute(keep=)`` for ``policy_fn(ctx, op, *args, **kwargs)``:
    ``True`` where the policy answers a ``*_SAVE`` policy (ours, torch's enum of the same
    names, or ``True`` as torch reads a bool), ``False`` for ``*_RECOMPUTE`` (or
    ``False``).

    Raises (when an op is dispatched):
        ValueError: the policy answered ``MUST_SWAP`` (an op's output is saved or
            recomputed; swap per saved tensor with ``swap_wrapper``), or anything but a
            policy or a bool.
    """

    def keep(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> bool:
        decision = policy_fn(SelectiveCheckpointContext(is_recompute=False, op_output=output), op, *args, **kwargs)
        if isinstance(decision, bool):
            return decision
        name = getattr(decision, "name", None) if isinstance(decision, enum.Enum) else None
        if name in _SAVE:
            return True
        if name in _RECOMPUTE:
            return False
        if name == "MUST_SWAP":
            raise ValueError(f"checkpoint policy_fn: answered MUST_SWAP for {op}; a checkpointed op's output is "
                             "either kept (MUST_SAVE / PREFER_SAVE) or recomputed (MUST_RECOMPUTE / "
                             "PREFER_RECOMPUTE). To copy saved tensors to host, use swap_wrapper(module, "
                             "policy_fn=...) on a module that is not checkpointed")
        # ValueError, not TypeError: torch turns a TypeError inside ``a * b`` into NotImplemented
        raise ValueError(f"checkpoint policy_fn: answered {decision!r} for {op}; answer a CheckpointPolicy "
                        "(MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE, PREFER_RECOMPUTE) or a bool (True keeps the "
                        "output)")

    return keep
