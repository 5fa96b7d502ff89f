"""Autograd on MindSpore: custom functions, grad mode, and ``vjp``.

MindSpore records operations only inside a differentiation call (``mindspore.grad``,
``value_and_grad``, ``vjp``) in PyNative mode; there is no ``Tensor.backward`` and
parameters carry no ``.grad``. Core runs every backward through ``vjp`` below.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from hyper_parallel.platform.contract.autograd import AutogradSection, VjpFn
from hyper_parallel.platform.contract.common import CustomFunction
from hyper_parallel.platform.mindspore.selective_checkpoint import selective_contexts
from hyper_parallel.platform.saved_tensor_layers import PASS, LayeredHooks, SavedTensorLayer
from hyper_parallel.platform.contract.validation import check_vjp_part


def native_function(base: type, function: type[CustomFunction]) -> type:
    """A ``mindspore._Function`` subclass whose forward and backward are ``function``'s.

    ``_Function`` follows ``torch.autograd.Function``: ``apply`` runs ``forward(ctx,
    *args)`` with recording off, and autograd calls ``backward(ctx, *grads)`` with one
    gradient per output (zeros for unused outputs); non-tensor arguments pass through
    and take ``None`` gradients.
    """

    def forward(ctx: Any, *args: Any) -> Any:
        return function.forward(ctx, *args)

    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        return function.backward(ctx, *grad_outputs)

    return type(function.__name__, (base,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
        "__module__": function.__module__,
        "__qualname__": f"{function.__qualname__}[mindspore]",
        "__doc__": function.__doc__,
    })


class _Recording:
    """Identity of one ``vjp`` recording (weakly referenced from the live list)."""

    def __init__(self) -> None:
        self.recomputed = False  # its backward ran on a second recording; the first stays on MindSpore's stack
        self.recording = True  # its forward is being recorded
        self.tainted = False  # another thread's backward ran while it recorded: recompute it


class _SavedToken:
    """What ``release_saved_tensors`` stores for a released tensor: source index and shape."""

    __slots__ = ("index", "shape")

    def __init__(self, index: int, shape: tuple[int, ...]) -> None:
        self.index = index
        self.shape = shape


class MindSporeAutograd(AutogradSection):
    """Autograd members of ``MindSporePlatform``.

    Uses the platform's ``_ms``/``_mint`` modules and ``_native_functions`` (the
    ``_Function`` subclass built for each ``CustomFunction`` subclass).
    """

    _ms: Any
    _mint: Any
    _native_functions: dict[type, type]
    _vjp_live: list[weakref.ref]  # MindSpore's stack of recordings not yet backwarded, oldest first
    _vjp_backwards_running: int  # backwards in progress (on any thread)

    def apply_function(self, function: type[CustomFunction], *args: Any) -> Any:
        """``<native _Function subclass>.apply(*args)``; the subclass is built on first use
        and cached on this platform object."""
        if not (isinstance(function, type) and issubclass(function, CustomFunction)):
            raise TypeError(f"apply_function: {function!r} is not a CustomFunction subclass")
        native = self._native_functions.get(function)
        if native is None:
            native = native_function(self._ms._Function, function)
            self._native_functions[function] = native
        return native.apply(*args)

    def no_grad(self) -> AbstractContextManager[None]:
        """``mindspore._no_grad()``: MindSpore's context that turns recording off."""
        return self._ms._no_grad()

    def grad_enabled(self) -> bool:
        """MindSpore's grad-mode flag: False under ``no_grad`` and inside a custom
        function's forward, True otherwise. Like torch's ``is_grad_enabled``, it is True
        at top level even though MindSpore records only inside ``vjp``."""
        from mindspore.graph.api import _pynative_executor

        return bool(_pynative_executor.enable_grad())

    def release_saved_tensors(self, sources: Sequence[Any], reload: Callable[[int], Any], *,
                              offload: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
                              ) -> AbstractContextManager[None]:
        """``mindspore.saved_tensors_hooks``. MindSpore hands the pack hook a new Python
        object for a saved tensor, so a saved tensor is matched to a source by its
        ``data_ptr()`` (read after draining PyNative's queue); the token keeps its shape (a
        same-memory reshape is rebuilt with ``reshape``; MindSpore's transposes are copies
        and are kept as they are). A DTensor forward saves the local pieces (its ops run on
        them), so ``offload``'s ``pack`` sees plain tensors."""
        from mindspore import ops
        from mindspore.graph.api import _pynative_executor

        # PyNative queues kernels: a tensor's data_ptr() is its memory only once the
        # kernel that produces it has run, so drain the queue before reading them.
        _pynative_executor.sync()
        keys = {src.data_ptr(): i for i, src in enumerate(sources) if int(src.numel()) > 0}
        sizes = [int(src.numel()) for src in sources]
        candidate_sizes = set(sizes)

        def take(tensor: Any) -> Any:
            numel = int(tensor.numel())
            if numel == 0 or numel not in candidate_sizes:
                return PASS
            _pynative_executor.sync()  # only for tensors of a source's size: see above
            index = keys.get(tensor.data_ptr())
            if index is None or numel != sizes[index]:
                return PASS
            return _SavedToken(index, tuple(tensor.shape))

        def give(token: _SavedToken) -> Any:
            return reload(token.index).reshape(token.shape)

        catch_all = None
        if offload is not None:
            pack, unpack = offload

            def take_any(tensor: Any) -> Any:
                if int(tensor.numel()) == 0:
                    return PASS
                detached = ops.stop_gradient(tensor)
                stored = pack(detached)
                return PASS if stored is detached else stored

            catch_all = (take_any, unpack)
        return LayeredHooks(SavedTensorLayer((take, give), catch_all), self._ms.saved_tensors_hooks,
                            lambda tensor: tensor)

    def recompute(self, fn: Callable[..., Any], *args: Any,
                  keep: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], bool] | None = None,
                  output_recompute: bool = False) -> Any:
        """``mindspore.recompute(fn, *args, use_reentrant=False)``: the saved-tensor-hooks
        form (any callable; the reentrant form takes Cells only and differentiates the
        Cell's own Parameters, not what a hook substituted for them). It saves the RNG
        state and restores it for the recomputation, and stops it at the last saved
        tensor, as torch does. ``keep`` enters two dispatch modes through its
        ``context_fn`` ([Note: selective checkpointing] in ``platform/selective_checkpoint``).
        ``output_recompute`` is MindSpore's own: the output passes through its
        ``_OutputSaver``, whose saved copy a following recomputed region keeps instead of
        the tensor."""
        from mindspore.common.recompute import recompute

        contexts = {} if keep is None else {"context_fn": lambda: selective_contexts(keep)}
        return recompute(fn, *args, use_reentrant=False, output_recompute=output_recompute, **contexts)

    def vjp(self, fn: Callable[..., Any], inputs: Sequence[Any], params: Sequence[Any] = ()) -> tuple[Any, VjpFn]:
        """``mindspore.vjp(fn, *tensor_inputs, weights=params)``.

        Non-tensor inputs are bound into ``fn`` rather than differentiated (MindSpore
        differentiates positional tensors only) and get ``None`` gradients, as do
        non-floating tensors. ``params`` must be ``mindspore.Parameter``: MindSpore finds
        weights by identity and silently returns zeros for a plain tensor.

        [Note: out-of-order backwards] PyNative keeps recordings on a stack and can run
        the backward of the top one only ("Can not find top cell for backward"
        otherwise); a recording whose backward never runs (dropped, or recomputed as
        below) stays on the stack and blocks every older one. A pipeline's 1F1B runs
        backwards oldest first, so a backward whose recording is not on top re-records
        ``fn`` on the same inputs and runs its backward at once (recompute): the
        forward, its hooks and its collectives run a second time, and ``fn`` must be
        deterministic (no dropout) for the gradients to match the first forward's
        outputs. ``_vjp_live`` mirrors that stack to tell the two cases apart.
        """
        inputs = tuple(inputs)
        params = list(params)
        for index, param in enumerate(params):
            if not isinstance(param, self._ms.Parameter):
                raise TypeError(f"vjp: params[{index}] is {type(param).__name__}, not a mindspore.Parameter; "
                                "make it with make_parameter() or pass it as an input")
        positions = [i for i, value in enumerate(inputs) if isinstance(value, self._ms.Tensor)]

        def call(*tensors: Any) -> Any:
            args = list(inputs)
            for position, tensor in zip(positions, tensors):
                args[position] = tensor
            return fn(*args)

        tensors = tuple(inputs[i] for i in positions)
        # On MindSpore's stack from the moment recording starts (another thread's
        # backward must not take it for the top while it records).
        token = _Recording()  # held by ``backward`` only: its entry dies with it
        token.tainted = self._vjp_backwards_running > 0
        self._vjp_live.append(weakref.ref(token))
        try:
            outputs, native_backward = self._ms.vjp(call, *tensors, weights=params)
        finally:
            token.recording = False
        flat = (outputs,) if isinstance(outputs, self._ms.Tensor) else tuple(outputs)
        state: dict[str, Any] = {"ran": False, "parts": [], "param_grads": ()}

        def backward(grad_outputs: Sequence[Any], part: str = "all") -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            if part in ("all", "input") and state["ran"]:
                # MindSpore would re-run the forward (and its collectives) to go again.
                raise RuntimeError("vjp: backward already ran; it runs once per vjp call")
            check_vjp_part(part, state["parts"])
            if part == "weight":  # computed by the input part (PyNative runs a backward once)
                param_grads, state["param_grads"] = state["param_grads"], ()
                return (), param_grads
            grads = list(grad_outputs)
            if len(grads) != len(flat):
                raise ValueError(f"vjp backward: got {len(grads)} output gradients for {len(flat)} outputs; "
                                 "give one per output (None for an output without a gradient)")
            state["ran"] = True
            sens = [self._mint.zeros(tuple(out.shape), dtype=out.dtype) if grad is None else grad
                    for grad, out in zip(grads, flat)]
            run = native_backward
            # Two threads (comm/compute overlap): a backward that runs while another
            # thread records leaves MindSpore's stack in an order we cannot follow, so
            # that recording recomputes too.
            for ref in self._vjp_live:
                other = ref()
                if other is not None and other.recording:
                    other.tainted = True
            if self._vjp_live and self._vjp_live[-1]() is token and not token.tainted:
                self._vjp_live.pop()
            else:  # see [Note: out-of-order backwards]
                # A new function object: MindSpore caches a recording by its function and
                # would hand back the stale one.
                run = self._ms.vjp(lambda *again: call(*again), *tensors, weights=params)[1]
                token.recomputed = True
            while self._vjp_live and (self._vjp_live[0]() is None or self._vjp_live[0]().recomputed):
                self._vjp_live.pop(0)  # stale, and nothing older is live: it decides nothing
            self._vjp_backwards_running += 1
            try:
                input_grads, param_grads = run(sens[0] if isinstance(outputs, self._ms.Tensor) else tuple(sens))
            finally:
                self._vjp_backwards_running -= 1
            input_grads = (input_grads,) if isinstance(input_grads, self._ms.Tensor) else tuple(input_grads)
            per_input: list[Any] = [None] * len(inputs)
            for position, grad in zip(positions, input_grads):
                per_input[position] = grad if inputs[position].is_floating_point() else None
            if part == "input":
                state["param_grads"] = tuple(param_grads)
                return tuple(per_input), ()
            return tuple(per_input), tuple(param_grads)

        return outputs, backward
