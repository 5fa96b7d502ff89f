"""Selective activation checkpointing on MindSpore: the two ``MsDispatchMode`` modes of
``recompute(fn, *args, keep=)`` ([Note: selective checkpointing] in
``platform/selective_checkpoint``).

MindSpore labels the primitives that write into their inputs (in-place ops, the
``DistComm*`` collectives with output buffers) ``side_effect_mem`` and those drawing
random numbers ``side_effect_hidden`` (``op_labels`` of its generated primitive table);
both always run. Not checked: an in-place write to a kept output between the forward and
the backward (torch compares version counters; MindSpore 2.10's ``Tensor._version`` does
not move on in-place ops).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from hyper_parallel.platform.selective_checkpoint import Keep, KeptOutputs

#: what MindSpore's recomputation hooks call on every tensor they save (not in the forward)
_MACHINERY = frozenset({"StopGradient"})


def selective_contexts(keep: Keep) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """The (forward, recomputation) dispatch modes of one checkpointed call, sharing its
    kept outputs: ``mindspore.recompute``'s ``context_fn`` result."""
    from mindspore import ops
    from mindspore.ops.auto_generate.cpp_create_prim_instance_helper import op_labels
    from mindspore.utils import MsDispatchMode

    def always_run(name: str) -> bool:
        labels = op_labels.get(name, {})
        return name in _MACHINERY or bool(labels.get("side_effect_mem") or labels.get("side_effect_hidden"))

    def detach(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(detach(v) for v in value)
        return ops.stop_gradient(value) if hasattr(value, "shape") else value

    kept = KeptOutputs(keep, detach, lambda value: value)

    def call(func: Any, args: Any, kwargs: dict[str, Any] | None) -> Any:
        return func(*args, **kwargs) if kwargs else func(*args)

    class _Keeping(MsDispatchMode):
        def __enter__(self) -> Any:
            kept.start()
            return super().__enter__()

        def __ms_dispatch__(self, func: Any, args: Any, kwargs: dict[str, Any] | None = None) -> Any:
            return kept.forward(func, func.name, tuple(args), dict(kwargs or {}), lambda: call(func, args, kwargs),
                                always_run(func.name))

    class _Reusing(_Keeping):
        def __ms_dispatch__(self, func: Any, args: Any, kwargs: dict[str, Any] | None = None) -> Any:
            return kept.recompute(func.name, tuple(args), lambda: call(func, args, kwargs), always_run(func.name))

    return _Keeping(), _Reusing()
