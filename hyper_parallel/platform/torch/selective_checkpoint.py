"""Selective activation checkpointing on torch: the two ``TorchDispatchMode`` modes of
``recompute(fn, *args, keep=)`` ([Note: selective checkpointing] in
``platform/selective_checkpoint``, which says why not torch's own
``create_selective_checkpoint_contexts``).

Always run: torch's ``SAC_IGNORED_OPS`` (``detach`` and the like, which the
recomputation adds), operations whose schema mutates an input, and those tagged
``nondeterministic_seeded`` (random draws; the attention kernels only with a non-zero
``dropout_p``). A kept output is detached and its version
counter recorded; handing it to the recomputation after an in-place write raises, as
torch's own selective checkpointing does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from hyper_parallel.platform.selective_checkpoint import Keep, KeptOutputs


def _always_run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    schema = getattr(func, "_schema", None)
    return (func in torch.utils.checkpoint.SAC_IGNORED_OPS or (schema is not None and schema.is_mutable)
            or _draws_random(func, schema, args, kwargs))


def _draws_random(func: Any, schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Tagged ``nondeterministic_seeded``, unless a ``dropout_p`` argument is 0 (the
    attention kernels carry the tag for their dropout; without it they draw nothing)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    for index, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "dropout_p":
            value = args[index] if index < len(args) else kwargs.get("dropout_p", argument.default_value)
            return bool(value)
    return True


class _Versioned:
    """A kept tensor, detached, with its version counter when kept."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor.detach(), tensor._version

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError("selective checkpointing: a kept output was modified in place between the forward "
                               "and the backward; keep (MUST_SAVE) only outputs nothing writes into, or recompute "
                               "the op that writes")
        return self.tensor


def _detach(value: Any) -> Any:
    return tree_map(lambda t: _Versioned(t) if isinstance(t, torch.Tensor) else t, value)


def _reuse(value: Any) -> Any:
    return tree_map(lambda t: t.get() if isinstance(t, _Versioned) else t, value)


def selective_contexts(keep: Keep) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """The (forward, recomputation) dispatch modes of one checkpointed call, sharing its
    kept outputs: ``torch.utils.checkpoint.checkpoint``'s ``context_fn`` result."""
    kept = KeptOutputs(keep, _detach, _reuse)

    class _Keeping(TorchDispatchMode):
        def __enter__(self) -> Any:
            kept.start()
            return super().__enter__()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            return kept.forward(func, str(func), tuple(args), kwargs, lambda: func(*args, **kwargs),
                                _always_run(func, args, kwargs))

    class _Reusing(_Keeping):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            return kept.recompute(str(func), tuple(args), lambda: func(*args, **kwargs),
                                  _always_run(func, args, kwargs))

    return _Keeping(), _Reusing()
