"""The weight-gradient split of linear layers for zero-bubble schedules.

A linear layer ``y = x @ W^T + b`` (``x [..., in]``, ``W [out, in]``, ``b [out]``) has
two backward matmuls: the input gradient ``grad_x = grad_y @ W``, which the previous
stage waits for, and the weight gradient ``grad_W = grad_y^T @ x`` (and
``grad_b = sum(grad_y)``), which nothing waits for. Zero Bubble Pipeline Parallelism
(Qi et al., ICLR 2024) runs the first in ``I`` and defers the second to ``W``, which
fills the bubbles; Megatron-LM does it with its ``WeightGradStore`` (the linear layer's
backward computes ``grad_x`` and queues ``(x, grad_y)``; later the queue is drained into
the weight gradients).

``LinearWeightSplit`` does the same for the linear layers of one stage, found with
``platform.named_modules(linear_only=True)``: each one's forward is replaced
(``register_forward_hook(replace_forward=True)``) by ``platform.apply_function`` of
``_SplitLinear``, whose forward runs the layer's own forward and whose backward:

- in a full backward (``B``), computes ``grad_x``, ``grad_W`` and ``grad_b``: the
  parameter gradients reach the parameters through autograd, as without the split;
- in an ``I`` (the runtime marks the microbatch's ``Capture`` as deferring), computes
  ``grad_x`` only and stores ``(x, grad_y)`` in the capture; the weight gradients it
  returns are ``None``;
- once it deferred, returns ``None`` for the weights again if autograd walks it a second
  time (the torch ``W`` re-walk for parameters outside linear layers, below).

``W`` then computes the stored weight gradients (``weight_grads``) and hands them to the
parameters through one ``platform.vjp`` of ``_LandWeightGrads`` (see [Note: landing
weight gradients]), which puts them where every other gradient goes: torch accumulates
``param.grad`` and fires post-accumulate hooks, MindSpore returns them from the vjp, and
the runtime adds them to the stage's ``param_grads()``.

Parameters outside split linear layers (norms, embeddings, a linear layer's weight tied
to another module) keep ``platform.vjp``'s ``part="weight"`` path: on torch it walks the
kept graph again for them (recomputing activation gradients, the ``grad_x`` of split
linear layers included); on MindSpore ``I`` computed their gradients with the input
gradients. A stage made of linear layers and parameter-free functions only needs no
re-walk: its ``W`` runs the stored weight-gradient matmuls and nothing else.

The forward outside a pipeline step (no capture on this thread: evaluation, the
runtime's shape inference) is the layer's own forward, untouched.
The runtime runs every backward of a microbatch with its capture recording, so a
checkpointed block recomputed inside it takes the split path its forward took.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hyper_parallel.core.activation_checkpoint.region import CheckpointPhase, checkpoint_phase
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.fully_shard.hsdp_state import HSDPState, units_in
from hyper_parallel.platform.base import CustomFunction, Platform, RemovableHandle


class Capture:
    """What the split linear layers of one (stage, microbatch) forward leave for ``W``.

    Attributes:
        deferring: set by the runtime while ``I`` runs: split layers store their weight
            gradients' operands instead of computing them.
        entries: per deferred layer application, ``(layer, x [..., in], grad_y [..., out])``
            with ``layer`` the index in ``LinearWeightSplit.layers``.
        applied: split layer applications recorded (a MindSpore recompute records twice;
            an activation checkpoint's recomputation does not count, see [Note:
            activation checkpointing in pipeline stages] in
            ``core/activation_checkpoint/checkpoint.py``).
        deferred: applications whose backward stored its entry.
    """

    def __init__(self) -> None:
        self.deferring = False
        self.entries: list[tuple[int, Any, Any]] = []
        self.applied = 0
        self.deferred = 0


class _SplitLinear(CustomFunction):
    """``y = forward(x)`` for a linear layer with ``weight [out, in]`` and ``bias [out]``
    (or None); the backward computes ``grad_x`` and, unless deferring, the parameter
    gradients (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Any, weight: Any, bias: Any, forward: Any, split: LinearWeightSplit, capture: Capture,
                layer: int) -> Any:
        ctx.x, ctx.weight, ctx.has_bias = x, weight, bias is not None
        ctx.split, ctx.capture, ctx.layer = split, capture, layer
        ctx.deferred = False
        if checkpoint_phase() is not CheckpointPhase.RECOMPUTE:  # a recomputation's graph never runs backward
            capture.applied += 1
        return forward(x)

    @staticmethod
    def backward(ctx: Any, grad_y: Any) -> Any:
        split, capture = ctx.split, ctx.capture
        grad_x = split._input_grad(grad_y, ctx.weight)
        none = (None, None, None, None)
        if ctx.deferred:  # stored by I; W lands it
            return (grad_x, None, None) + none
        if capture.deferring:
            capture.entries.append((ctx.layer, ctx.x, grad_y))
            capture.deferred += 1
            ctx.deferred = True
            return (grad_x, None, None) + none
        grad_w, grad_b = split._weight_grad(ctx.x, grad_y, ctx.has_bias)
        return (grad_x, grad_w, grad_b) + none


class _LandWeightGrads(CustomFunction):
    """[Note: landing weight gradients] ``W`` computes the deferred gradients itself;
    to put them where autograd puts gradients on every backend (torch: ``param.grad``
    and post-accumulate hooks; MindSpore: the vjp's parameter gradients), it runs
    ``platform.vjp`` of this function over the parameters: the forward returns a
    ``[1]`` zero placeholder, and the backward hands over the given gradients (the
    gradient of ``<params, grads>``, whose value the placeholder stands for)."""

    @staticmethod
    def forward(ctx: Any, weight: Any, bias: Any, grad_w: Any, grad_b: Any, platform: Platform) -> Any:
        ctx.grads = (grad_w, grad_b)
        return platform.zeros((1,), weight.dtype)

    @staticmethod
    def backward(ctx: Any, _grad: Any) -> Any:
        grad_w, grad_b = ctx.grads
        return grad_w, grad_b, None, None, None


class LinearWeightSplit:
    """The weight-gradient split of the linear layers in ``module`` (module docstring).

    Args:
        platform: the platform whose hooks and autograd are used.
        module: a stage's submodule; its linear layers (``named_modules(linear_only=True)``)
            with tensor weights (DTensor ones included) are split.

    Attributes:
        layers: ``(fqn, module)`` of the split linear layers.
        input_grad_matmuls, weight_grad_matmuls: the backward matmuls of split layers
            run so far (``grad_y @ W``; ``grad_y^T @ x``), counted where they run.
        needs_rewalk: the module has parameters outside the split layers (their
            gradients come from ``vjp``'s ``part="weight"``).

    A layer whose parameters a ``fully_shard`` unit manages computes with the gathered
    weight, whose gradient the unit reduces: ``W`` hands its deferred gradients to the
    unit (``HSDPState.accumulate_grad``) instead of landing them, and the runtime reduces
    them once per step ([Note: one reduction per step] in ``gradient_sync``).
    """

    def __init__(self, platform: Platform, module: Any) -> None:
        self.platform = platform
        self.layers: list[tuple[str, Any]] = [
            (name, layer) for name, layer in platform.named_modules(module, linear_only=True)
            if platform.is_tensor(layer.weight)]
        split_ids = {id(param) for _, layer in self.layers for _, param in platform.named_parameters(layer)}
        # a parameter also owned by another module (tied) takes gradients outside the split too
        other_ids = {id(param) for _, sub in platform.named_modules(module) if all(sub is not l for _, l in self.layers)
                     for name, param in platform.named_parameters(sub) if "." not in name}
        self.needs_rewalk = any(id(param) not in split_ids or id(param) in other_ids
                                for _, param in platform.named_parameters(module))
        self._module = module
        self.input_grad_matmuls = 0
        self.weight_grad_matmuls = 0
        self._local = threading.local()  # .capture: the capture of the forward running on this thread
        self._handles: list[RemovableHandle] = [
            platform.register_forward_hook(layer, self._make_forward(index), replace_forward=True)
            for index, (_, layer) in enumerate(self.layers)]

    def _make_forward(self, index: int) -> Any:
        p = self.platform

        def forward(layer: Any, args: tuple[Any, ...], native: Any) -> Any:
            capture = getattr(self._local, "capture", None)
            if capture is None or len(args) != 1 or not p.grad_enabled():
                return native(*args)
            return p.apply_function(_SplitLinear, args[0], layer.weight, layer.bias, native, self, capture, index)

        return forward

    @contextmanager
    def recording(self, capture: Capture) -> Iterator[None]:
        """Split layers called on this thread inside the context record into ``capture``."""
        previous = getattr(self._local, "capture", None)
        self._local.capture = capture
        try:
            yield
        finally:
            self._local.capture = previous

    def _input_grad(self, grad_y: Any, weight: Any) -> Any:
        self.input_grad_matmuls += 1
        return grad_y @ weight  # [..., out] @ [out, in]

    def _weight_grad(self, x: Any, grad_y: Any, has_bias: bool) -> tuple[Any, Any]:
        self.weight_grad_matmuls += 1
        rows_y = grad_y.reshape(-1, grad_y.shape[-1])  # [tokens, out]
        grad_w = rows_y.transpose(0, 1) @ x.reshape(-1, x.shape[-1])  # [out, in]
        return grad_w, (rows_y.sum(0) if has_bias else None)

    def rewalk_needed(self, capture: Capture) -> bool:
        """``W`` needs ``vjp``'s ``part="weight"``: parameters outside split layers, or a
        split layer whose backward ``I`` did not reach (torch prunes paths that lead to
        no input, as after an embedding)."""
        return self.needs_rewalk or capture.deferred < capture.applied

    def land(self, capture: Capture, params: Sequence[Any]) -> list[Any | None]:
        """``W``: the deferred weight gradients of ``capture`` (summed per parameter),
        landed through ``platform.vjp`` ([Note: landing weight gradients]), or added to
        the fully_shard unit of a fully sharded layer (``HSDPState.accumulate_grad``);
        one entry per ``params`` (``None`` where it got none here)."""
        p = self.platform
        sums: dict[int, tuple[Any, Any]] = {}
        with p.no_grad():
            for layer, x, grad_y in capture.entries:
                has_bias = self.layers[layer][1].bias is not None
                grad_w, grad_b = self._weight_grad(x, grad_y, has_bias)
                if layer in sums:
                    old_w, old_b = sums[layer]
                    grad_w, grad_b = old_w + grad_w, (old_b + grad_b if has_bias else None)
                sums[layer] = (grad_w, grad_b)
        capture.entries.clear()
        sharded = self._fully_sharded()
        landed: list[Any] = []
        grads: list[Any] = []
        for layer in sorted(sums):
            module = self.layers[layer][1]
            for name, grad in zip(("weight", "bias"), sums[layer]):
                if grad is None:
                    continue
                entry = sharded.get((id(module), name))
                if entry is not None:  # reduced once per step: [Note: one reduction per step]
                    entry[0].accumulate_grad(entry[1], grad)
                else:
                    landed.append(getattr(module, name))
                    grads.append(grad)
        if not landed:
            return [None] * len(params)
        by_id = land_gradients(p, landed, grads)
        return [by_id.get(id(param)) for param in params]

    def _fully_sharded(self) -> dict[tuple[int, str], tuple[HSDPState, Any]]:
        """``(id(layer), attribute) -> (unit, HSDPParam)`` for each parameter a fully_shard
        unit in the module manages, found when used (a stage may be fully_shard'ed after
        its schedule is built, as MindFormers' ``apply_pp`` does)."""
        return {(id(owner), name): (state, hp)
                for state in units_in(self._module) for hp in state.params for owner, name in hp.uses}

    def remove(self) -> None:
        """Give the split layers their own forward back."""
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()


def _local_piece(tensor: Any) -> Any:
    """A DTensor parameter's differentiable local tensor; anything else as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def land_gradients(platform: Platform, params: Sequence[Any], grads: Sequence[Any]) -> dict[int, Any]:
    """Hand ``grads[i]`` to ``params[i]`` where autograd puts gradients ([Note: landing
    weight gradients]): one ``platform.vjp`` over the parameters (torch: ``param.grad``
    accumulated, post-accumulate hooks fired). A DTensor parameter takes its local
    piece's gradient (``grads[i]`` is local) through the differentiable ``to_local``.
    A parameter listed twice (tied) takes the sum. Returns ``{id(param): gradient}``
    as the vjp reports it (what the runtime adds to the stage's ``param_grads()``).
    No collective."""
    p = platform
    pairs = list(zip(params, grads, strict=True))

    def placeholders() -> Any:
        total = None
        for param, grad in pairs:
            out = p.apply_function(_LandWeightGrads, _local_piece(param), None, grad, None, p)
            total = out if total is None else total + out
        return total

    unique = list({id(param): param for param in params}.values())
    total, backward = p.vjp(placeholders, [], unique)
    _, found = backward([p.full((1,), 1.0, total.dtype)])
    return {id(param): grad for param, grad in zip(unique, found)}
