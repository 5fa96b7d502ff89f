"""Selective activation checkpointing's kept outputs, shared by the backends' dispatch
modes (``recompute(fn, *args, keep=)``).

[Note: selective checkpointing]
Both frameworks have a dispatch mode that sees every operation *below* autograd: torch's
``TorchDispatchMode``, MindSpore 2.10's ``mindspore.utils.MsDispatchMode`` (experimental).
The mode runs in place of the kernel, and autograd records the operation and saves its
tensors around whatever the mode returns (checked on MindSpore 2.10 CPU: a
recomputation handed a kept output saves that output for the backward). So, as torch's
``create_selective_checkpoint_contexts`` does:

- the forward of the checkpointed function runs under a *keeping* mode: each operation
  runs, and where ``keep(op, args, kwargs, output)`` says so its output is kept
  (detached), keyed by the operation's name and its call index among operations of that
  name;
- the recomputation runs under a *reusing* mode: an operation with a kept output returns
  it instead of running; every other one runs.

Both modes are entered through the framework's own non-reentrant recomputation's
``context_fn``. A kept output is handed out once and then released, as torch does: a
second backward through the region raises. Three kinds of operations always run and are
not counted: those the recomputation machinery adds (torch's ``detach``, MindSpore's
``StopGradient``), those writing into their inputs (in-place ops, collectives with output
buffers: their effect is the write, which a kept output would skip), and those drawing
random numbers (skipping one would shift the generator for every later draw of the
recomputation). A kept operation is checked to see inputs of the shapes and dtypes it saw
in the forward, so a recomputation that took another path raises instead of getting the
wrong tensor back.

Why not torch's own ``create_selective_checkpoint_contexts``: it requires every
operation of the recomputation to have run in the forward, and fully_shard's hooks on a
unit inside a checkpointed module take another path in the recomputation (they hand over
parameters gathered again, [Note: a unit inside a checkpointed module] in
``core/fully_shard/hsdp_state``). Such bookkeeping runs inside ``unmatched_operations()`` (``platform/contract/autograd``):
neither counted nor kept, in both runs, so the module's own operations are matched alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyper_parallel.platform.contract.autograd import in_unmatched_operations

Keep = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], bool]

_CONSUMED = object()


def signature(value: Any) -> Any:
    """Shapes and dtypes of ``value``'s tensors (nested sequences followed), the type
    names of everything else."""
    if isinstance(value, (list, tuple)):
        return tuple(signature(v) for v in value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return tuple(value.shape), str(value.dtype)
    return type(value).__name__


class KeptOutputs:
    """The outputs one checkpointed call keeps: ``forward`` in the keeping mode,
    ``recompute`` in the reusing one; ``start`` when a mode is entered.

    Args:
        keep: the policy, ``keep(op, args, kwargs, output) -> bool``.
        detach: ``output -> what is kept`` (detached from the forward's graph).
        reuse: ``kept -> output`` handed to the recomputation (torch checks there that
            nothing wrote into the kept tensors).
    """

    def __init__(self, keep: Keep, detach: Callable[[Any], Any], reuse: Callable[[Any], Any]) -> None:
        self._keep, self._detach, self._reuse = keep, detach, reuse
        self._kept: dict[tuple[str, int], Any] = {}
        self._calls: dict[str, int] = {}

    def start(self) -> None:
        self._calls = {}

    def _key(self, name: str) -> tuple[str, int]:
        index = self._calls.get(name, 0)
        self._calls[name] = index + 1
        return name, index

    def forward(self, op: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                run: Callable[[], Any], always_run: bool) -> Any:
        out = run()
        if always_run or in_unmatched_operations():
            return out
        key = self._key(name)
        if self._keep(op, args, kwargs, out):
            self._kept[key] = (signature(args), self._detach(out))
        return out

    def recompute(self, name: str, args: tuple[Any, ...], run: Callable[[], Any], always_run: bool) -> Any:
        if always_run or in_unmatched_operations():
            return run()
        key = self._key(name)
        entry = self._kept.get(key)
        if entry is None:
            return run()
        if entry is _CONSUMED:
            raise RuntimeError(f"selective checkpointing: {name} call {key[1]} was recomputed a second time; its "
                               "kept output was released after the first backward through this region (one "
                               "backward per selectively checkpointed forward, as in torch; a torch zero-bubble "
                               "pipeline schedule walks the graph again in W: checkpoint fully there)")
        kept_signature, out = entry
        if signature(args) != kept_signature:
            raise RuntimeError(f"selective checkpointing: the recomputation called {name} (call {key[1]}) on inputs "
                               f"{signature(args)}, the forward on {kept_signature}; the checkpointed function must "
                               "take the same path when recomputed")
        self._kept[key] = _CONSUMED
        return self._reuse(out)
