"""This project's saved-tensor contexts, stacked on the framework's one hook.

[Note: stacked saved-tensor contexts]
torch (``autograd.graph.saved_tensors_hooks``) and MindSpore (``saved_tensors_hooks``)
call only the innermost pack hook for each tensor an operation saves for backward. This
project pushes two kinds of context, and they nest either way round:

- ``release_saved_tensors`` (fully_shard): tensors that share memory with given sources
  (the gathered parameters) are stored as tokens and rebuilt from a re-gather;
- ``offload_saved_tensors`` (activation swap): every other activation may be stored in
  host memory and copied back for the backward.

A swapped decoder layer holds fully sharded norms (the norm's release context is inside
the swap context), and a fully sharded layer may be swapped (the swap context is inside
the unit's release context). Each of our contexts is a ``SavedTensorLayer`` in a
per-thread stack (a ``ContextVar``, the pattern of [Note: where the active context
lives] in ``core/context_parallel/context``), and each pushes the framework's hooks with
the same pack, which offers the tensor to the layers entered here: the *specific* ones
first (a release context takes only its sources, and must take them wherever it sits:
a swap context inside it would otherwise copy the gathered parameters to host), then the
catch-all ones, innermost first within each kind. The first layer that takes the tensor
packs it and gets it back in the unpack; a tensor no layer takes gets the backend's
default packing. A framework context pushed inside ours (a checkpoint's recomputation
hooks) takes every tensor saved inside it, as before.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

#: What a layer's take returns for a tensor it does not take.
PASS = object()

#: ``(take, give)``: ``take(tensor)`` returns the stored form of a tensor or ``PASS``;
#: ``give(stored)`` returns the tensor again.
Taker = tuple[Callable[[Any], Any], Callable[[Any], Any]]


class SavedTensorLayer:
    """One of our saved-tensor contexts: a ``specific`` taker (tensors it was given,
    asked before every catch-all taker) and/or a ``catch_all`` one."""

    __slots__ = ("specific", "catch_all")

    def __init__(self, specific: Taker | None = None, catch_all: Taker | None = None) -> None:
        self.specific = specific
        self.catch_all = catch_all


class _Packed:
    __slots__ = ("give", "value")

    def __init__(self, give: Callable[[Any], Any], value: Any) -> None:
        self.give = give
        self.value = value


#: The layers entered in this thread, outermost first.
_LAYERS: contextvars.ContextVar[tuple[SavedTensorLayer, ...]] = contextvars.ContextVar(
    "hyper_parallel_saved_tensor_layers", default=())


def _unpack(packed: Any) -> Any:
    return packed.give(packed.value) if isinstance(packed, _Packed) else packed


class LayeredHooks(AbstractContextManager[None]):
    """Enter ``layer`` and the framework's hooks (``native(pack, unpack)``, a context
    manager); ``default(tensor)`` packs what no entered layer takes. Entered and exited
    once; exits may come in another order than the entries (a fully_shard unit enters
    its context in its forward pre-hook and leaves it in its post-hook)."""

    def __init__(self, layer: SavedTensorLayer, native: Callable[[Callable[[Any], Any], Callable[[Any], Any]], Any],
                 default: Callable[[Any], Any]) -> None:
        self._layer = layer
        self._native = native
        self._default = default
        self._hooks: Any = None

    def __enter__(self) -> None:
        _LAYERS.set(_LAYERS.get() + (self._layer,))
        self._hooks = self._native(self._pack, _unpack)
        self._hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._hooks.__exit__(*exc)
        finally:
            _LAYERS.set(tuple(layer for layer in _LAYERS.get() if layer is not self._layer))

    def _pack(self, tensor: Any) -> Any:
        layers = _LAYERS.get()
        for kind in ("specific", "catch_all"):
            for layer in reversed(layers):
                taker = getattr(layer, kind)
                if taker is not None:
                    stored = taker[0](tensor)
                    if stored is not PASS:
                        return _Packed(taker[1], stored)
        return self._default(tensor)
