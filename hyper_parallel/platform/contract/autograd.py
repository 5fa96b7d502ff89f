"""Contract section: autograd."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from hyper_parallel.platform.contract.common import CustomFunction

#: What ``vjp`` returns as its backward: ``backward(grad_outputs, part="all")``, output
#: gradients in, (input gradients, parameter gradients) out.
VjpFn = Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]]


#: set while the operations running are bookkeeping that the forward and the
#: recomputation of ``recompute(keep=)`` do differently
_UNMATCHED: contextvars.ContextVar[bool] = contextvars.ContextVar("hyper_parallel_sac_unmatched", default=False)


@contextlib.contextmanager
def unmatched_operations() -> Iterator[None]:
    """Operations run inside are neither kept nor counted by ``recompute(keep=)``: the
    caller's bookkeeping that the forward and the recomputation do differently
    (fully_shard's hooks; [Note: selective checkpointing] in ``platform/selective_checkpoint``).
    Part of the contract of ``recompute``: core marks such operations, every backend's
    selective checkpointing honours the mark (``in_unmatched_operations``)."""
    token = _UNMATCHED.set(True)
    try:
        yield
    finally:
        _UNMATCHED.reset(token)


def in_unmatched_operations() -> bool:
    """True inside ``unmatched_operations()``."""
    return _UNMATCHED.get()


def unmatched(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (a module hook) run inside ``unmatched_operations()``."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        with unmatched_operations():
            return hook(*args, **kwargs)

    return run


class AutogradSection(ABC):
    """Custom functions, grad mode, and a backward both frameworks can run."""

    @abstractmethod
    def apply_function(self, function: type[CustomFunction], *args: Any) -> Any:
        """Apply a backend-neutral ``CustomFunction`` subclass to ``args``: its forward
        runs now, its backward is recorded for autograd (torch ``autograd.Function``,
        MindSpore ``_Function``). The native class is built once per subclass."""

    @abstractmethod
    def no_grad(self) -> AbstractContextManager[None]:
        """A context in which operations are not recorded for autograd."""

    @abstractmethod
    def grad_enabled(self) -> bool:
        """True when operations are being recorded for autograd."""

    @abstractmethod
    def vjp(self, fn: Callable[..., Any], inputs: Sequence[Any], params: Sequence[Any] = ()) -> tuple[Any, VjpFn]:
        """Run ``fn(*inputs)`` recording autograd, and return ``(outputs, backward)``.

        ``backward(grad_outputs)`` takes one gradient per output (a sequence, in the
        order of a flat tuple of outputs; a single tensor output takes a 1-sequence) and
        returns ``(input_grads, param_grads)``: one gradient per input and per param,
        zeros where the output does not depend on it (``None`` for inputs that are not
        floating-point tensors). It runs once. This is how core runs a backward from
        given output gradients (pipeline stages) on both frameworks. ``param_grads``
        are this backward's gradients; torch also accumulates them into ``param.grad``
        (so torch optimizers step as usual), MindSpore keeps no gradient on parameters.
        Per-parameter post-accumulate hooks fire during ``backward`` on both. Several
        recordings may be live at once and their backwards run in any order (a
        pipeline's 1F1B runs them oldest first); a backend that can only run the newest
        one recomputes the forward for the others, so ``fn`` must be deterministic.

        Split backward (zero-bubble pipeline schedules; Qi et al., "Zero Bubble Pipeline
        Parallelism", ICLR 2024): ``backward(grad_outputs, part="input")`` returns
        ``(input_grads, ())`` and a later ``backward(grad_outputs, part="weight")`` with
        the same ``grad_outputs`` returns ``((), param_grads)`` (hooks and torch's
        ``param.grad`` accumulation happen there). ``part="all"`` (default) runs once; the
        two parts run once each, input first; anything else raises ``RuntimeError``, an
        unknown ``part`` ``ValueError``. On torch the input part computes no parameter
        gradient and the weight part re-walks the kept graph for them; MindSpore's
        PyNative runs a recording's backward once, so its input part computes both and
        the weight part hands over the parameter gradients kept from it.
        """

    @abstractmethod
    def release_saved_tensors(self, sources: Sequence[Any], reload: Callable[[int], Any], *,
                              offload: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
                              ) -> AbstractContextManager[None]:
        """A context in which autograd does not keep ``sources`` alive for backward.

        ``sources`` are tensors produced by an operation (not wrapped from outside:
        MindSpore saves a copy of such a tensor, which is not matched). Any tensor
        saved for backward inside the context that shares memory with ``sources[i]``
        (the tensor itself, or on torch a view of it such as the transpose a linear
        layer saves) is stored as a small token instead; when the backward needs
        it, ``reload(i)`` is called and must return a tensor with ``sources[i]``'s shape,
        dtype and values, from which the same view is rebuilt. Once the caller drops its
        own references, the memory of ``sources`` is released after the forward
        (torch ``autograd.graph.saved_tensors_hooks``, MindSpore ``saved_tensors_hooks``).
        fully_shard uses it to free gathered parameters after the forward and re-gather
        them in the backward. ``reload`` runs inside the backward, once per saved use.

        ``offload=(pack, unpack)`` (activation swap, ``core/activation_checkpoint/swap``):
        every *other* tensor saved inside the context is handed to ``pack(tensor)``, whose
        return is stored instead: ``tensor`` itself keeps it as usual, anything else is
        handed to ``unpack(stored)`` when the backward needs it, which returns a tensor of
        the saved one's shape, dtype and values. Swap passes the module's parameters as
        ``sources`` with ``reload=sources.__getitem__``: they are not copied to host.
        Neither does ``pack`` see what another ``release_saved_tensors`` context, entered
        around this one or inside it, takes ([Note: stacked saved-tensor contexts] in
        ``platform/saved_tensor_layers``), nor empty tensors. A DTensor saved by a DTensor
        forward is handed over as its local piece and rewrapped after ``unpack``. Inside
        ``recompute``'s function the recomputation's own hooks take every saved tensor.
        """

    @abstractmethod
    def recompute(self, fn: Callable[..., Any], *args: Any,
                  keep: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], bool] | None = None,
                  output_recompute: bool = False) -> Any:
        """Run ``fn(*args)`` and return its output, keeping none of the tensors that the
        operations inside ``fn`` save for backward; the backward runs ``fn(*args)`` again,
        with recording on, when it first needs one of them, and uses the recomputed ones
        (activation checkpointing: Chen et al., "Training Deep Nets with Sublinear Memory
        Cost", 2016). Non-reentrant, built on saved-tensor hooks: torch
        ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``, MindSpore
        ``mindspore.recompute(fn, *args, use_reentrant=False)``.

        Gradients flow through the graph of the *first* forward, so what ``fn`` reads
        from outside (parameters, captured tensors, a custom function's inputs) receives
        its gradient once, from that graph; the recomputed graph only supplies saved
        values. What is kept from the forward: the tensors in ``args`` (by reference)
        and the framework's random-number state, restored for the recomputation (a
        dropout draws the same mask). What runs twice: everything ``fn`` does up to the
        last tensor the backward needs (module hooks and collectives included;
        recomputation stops there on both frameworks, so every rank must save the same
        tensors in the same order for collectives to match). ``fn`` must read the same
        values in the recomputation (a caller that frees what ``fn`` reads between the
        forward and the backward restores it first: fully_shard does, see
        [Note: recomputation and gathered parameters] in ``core/fully_shard/hsdp_state``).
        Outside recording (``no_grad``; MindSpore outside ``vjp``) ``fn(*args)`` just
        runs. Positional tensors only; bind keyword arguments into ``fn``
        (``functools.partial``). Composes with ``release_saved_tensors``: inside ``fn``
        the innermost saved-tensor hooks (this member's) take every saved tensor.

        ``keep`` (selective activation checkpointing, Korthikanti et al., "Reducing
        Activation Recomputation in Large Transformer Models", 2022): called as
        ``keep(op, args, kwargs, output)`` once for each framework operation the first
        run of ``fn`` dispatches (torch: an ``OpOverload`` such as
        ``torch.ops.aten.mm.default``; MindSpore: the ``OpFunc`` of a primitive, whose
        ``name`` is ``"MatMulExt"``, ``"Dense"``, ...; ``args`` / ``kwargs`` its inputs,
        ``output`` what it returned). ``True`` keeps that output from the forward: the
        recomputation returns it instead of running the operation again (memory: the
        output, held until the backward; time: the operation is not rerun). ``False``
        recomputes it. Operations are matched by name and order of call, as torch's
        ``create_selective_checkpoint_contexts`` does, in dispatch modes below autograd
        (torch ``TorchDispatchMode``, MindSpore ``mindspore.utils.MsDispatchMode``); what
        runs inside ``unmatched_operations()`` (this module) is neither
        kept nor counted ([Note: selective checkpointing] in
        ``platform/selective_checkpoint``). One backward per forward: a second
        recomputation of the region raises.

        ``output_recompute`` (MindSpore's ``recompute(output_recompute=True)``): the
        output is recomputed too. A recomputed region whose input is such an output keeps
        the way to recompute it instead of the tensor, and its recomputation runs the
        first region's first, so two adjacent regions are recomputed as one and the
        tensor between them is not kept. torch has no counterpart: the torch backends
        raise ``NotImplementedError``.

        Raises:
            RuntimeError: from the framework, when the recomputation saves tensors of
                other shapes or dtypes, or fewer, than the forward (``fn`` took another
                path), or, with ``keep``, calls a kept operation on inputs of other
                shapes or dtypes; whatever ``fn`` or ``keep`` raises.
            NotImplementedError: ``output_recompute`` on torch.
        """
