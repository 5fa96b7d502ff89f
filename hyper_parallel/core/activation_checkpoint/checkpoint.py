"""Activation checkpointing: a block's activations are not kept for backward but
recomputed there (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016).

The API follows torch's (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``'s ``checkpoint_wrapper``
and ``apply_activation_checkpointing``) with MindSpore's in-place ``Cell.recompute()``
semantics: a module is checkpointed where it is, its forward replaced on the instance
(``platform.register_forward_hook(replace_forward=True)``), so parameter names,
checkpoints and tensor-parallel plans are unchanged and the module's own hooks still run
around the checkpointed forward. The recomputation is the framework's own,
non-reentrant one (``platform.recompute``).

[Note: composing activation checkpointing with the other layouts]
Order: tensor parallelism, context parallelism, activation checkpointing, fully_shard
(torchtitan's ``parallelize_llama``). What runs where:

- Hooks of modules *inside* a checkpointed module run in the forward and again in the
  recomputation. Tensor-parallel styles and ``ContextParallel`` are such hooks: they
  redistribute activations with differentiable collectives and push the attention's
  context frame on entry (popped on exit), so the recomputation issues the same
  collectives in the same order on every rank and finds its frame the same way.
  Recomputation stops after the last tensor the backward needs, at the same point on
  every rank; a collective after it (a block's final row-parallel all-reduce) runs once.
- Hooks of the checkpointed module itself and of its ancestors run once. fully_shard
  belongs there: apply it to the checkpointed block (or an ancestor) *after*
  checkpointing. Its forward hooks gather the parameters and hand the module the
  gathered tensors; the checkpointed forward saves nothing, so the unit's gathered
  parameters are freed after the forward as usual. Its backward pre-hook gathers them
  again, and its hooks on the modules that hold them hand them to the recomputation
  ([Note: recomputation and gathered parameters] in ``core/fully_shard/hsdp_state``);
  gradients flow through the first forward's graph, so each parameter's gradient is
  reduce-scattered once.
- A fully_shard unit *inside* a checkpointed module (MindFormers shards the norms of the
  layers it checkpoints: checkpoint the layer, then fully_shard the norms, then the
  layer) runs its hooks in the forward and again in the recomputation: see [Note: a
  unit inside a checkpointed module] in ``core/fully_shard/hsdp_state``. The order
  matters: ``checkpoint_wrapper`` refuses a module that already holds a unit.

[Note: activation checkpointing in pipeline stages]
A pipeline stage (``core/pipeline_parallel``) records each microbatch's forward ``F``
under ``platform.vjp`` and runs its backward later, out of order across microbatches
(1F1B, interleaved) and, on zero-bubble schedules, split into ``I`` (input gradients)
and ``W`` (weight gradients). Checkpointed blocks inside a stage keep only their inputs
per microbatch; each ``checkpoint`` call of a forward is its own recomputation, fed by
that microbatch's kept inputs, so a backward recomputes its own microbatch whatever the
order. The recomputation runs inside that microbatch's ``B`` or ``I``:

- The I/W split replaces the stage's linear layers by a custom function
  (``weight_grad._SplitLinear``) that keeps its operands on its context, not as saved
  tensors. The recomputation must take the forward's path, since the frameworks match
  recomputed saved tensors to the forward's by order (a native linear layer saves its
  input and weight where the split one saved nothing; torch reports the mismatch,
  MindSpore does not check). So the runtime runs every backward of a stage (``B``,
  ``I``, ``W``) with the split layers recording into that microbatch's ``Capture``:
  recomputed, they are split layers too, and count in no ``Capture.applied`` (that
  graph never runs backward). Gradients flow through the first forward's split layers:
  in ``I`` each stores ``(x, grad_y)``, its input from the forward and the output
  gradient the recomputed activations produced, and ``W`` lands them, once.
- torch's ``W`` walks the kept graph again for the parameters outside split layers
  (norm gains): autograd asks for the blocks' saved tensors again and torch recomputes
  once per backward pass, so the blocks run a third time, their collectives on every
  rank of the stage's groups at the same action; the split layers that deferred in
  ``I`` return no weight gradient in that walk, so none is counted twice. MindSpore's
  ``I`` computes every gradient in one backward (``W`` hands them out): one
  recomputation. MindSpore's out-of-order backwards re-record the stage's forward
  ([Note: out-of-order backwards] in ``platform/mindspore/autograd.py``): the blocks run
  in that recording as a forward and again as its recomputation.
- fully_shard composes as above: each microbatch's backward of a unit gathers the
  parameters for the recomputation and reduce-scatters the gradient once.

The gradients equal the un-checkpointed pipeline's bit for bit on every schedule
(``tests/pipeline_parallel/test_activation_checkpoint_stages.py``). Memory: split
linear layers keep their inputs until ``W`` with or without checkpointing.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from hyper_parallel.core.activation_checkpoint.policy import check_policy_fn, keep_outputs
from hyper_parallel.core.activation_checkpoint.region import _EXIT, _FORWARDS, _PHASE, CheckpointPhase
from hyper_parallel.core.module_attrs import FULLY_SHARDED_ATTR
from hyper_parallel.platform import Capability, get_platform

#: ``context_fn() -> (forward_context, recompute_context)``, torch's ``checkpoint`` hook.
ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

#: The attribute of a checkpointed module that holds its forward replacement's handle.
CHECKPOINT_ATTR = "_checkpoint_handle"


def checkpoint(fn: Callable[..., Any], *args: Any, context_fn: ContextFn | None = None,
               policy_fn: Callable[..., Any] | None = None, output_recompute: bool = False) -> Any:
    """``fn(*args)`` without keeping its intermediate activations: the tensors its
    operations save for backward are dropped after the forward and recomputed, by
    running ``fn(*args)`` again, when the backward first needs one (torch
    ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``, MindSpore
    ``mindspore.recompute(fn, *args, use_reentrant=False)``).

    Memory: instead of every saved activation of ``fn`` (for a decoder block
    ``[batch, seq, hidden]``-sized tensors, a dozen or more), only ``args`` and the
    output are kept until the backward. Time: one more forward of ``fn`` in the
    backward, with its collectives (see [Note: composing activation checkpointing with
    the other layouts]). Gradients are those of ``fn(*args)`` without checkpointing, bit
    for bit on a deterministic ``fn`` (the random-number state is restored for the
    recomputation, so dropout draws the same mask). ``checkpoint_phase()`` tells code
    inside ``fn`` which run it is in.

    Args:
        fn: deterministic given the random-number state; it must take the same path
            (the same saved tensors in the same order) when run again.
        *args: positional inputs (tensors are kept by reference); bind keyword
            arguments into ``fn`` (``functools.partial``).
        context_fn: called once per ``checkpoint`` call, returns two context managers
            ``(forward_context, recompute_context)``: the forward runs inside the first,
            the recomputation inside the second (torch's ``context_fn``; e.g. to skip a
            side effect such as logging in the recomputation).
        policy_fn: selective checkpointing (torch's ``create_selective_checkpoint_contexts``
            policy; Korthikanti et al. 2022): ``policy_fn(ctx, op, *op_args, **op_kwargs)``
            is called for each framework operation of the forward (``op`` is torch's
            ``OpOverload``, e.g. ``torch.ops.aten.mm.default``, or MindSpore's ``OpFunc``,
            ``op.name == "MatMulExt"``; ``ctx`` a ``SelectiveCheckpointContext`` with the
            op's output) and answers a ``CheckpointPolicy``: ``MUST_SAVE`` /
            ``PREFER_SAVE`` keep the op's output from the forward (the recomputation
            reuses it: memory for time, typically matmuls and collectives),
            ``MUST_RECOMPUTE`` / ``PREFER_RECOMPUTE`` recompute it; a bool is read as
            torch reads it (``True`` saves). ``None``: everything is recomputed. The
            region then takes one backward only (a second one raises). The same policy
            on every rank keeps collectives matched.
        output_recompute: MindSpore's ``recompute(output_recompute=True)``: the output
            is recomputed too, so a checkpointed region that takes it as input keeps the
            way to recompute it rather than the tensor, and the two are recomputed
            together (the first before the second). MindSpore only.

    Returns:
        What ``fn(*args)`` returns.

    Raises:
        RuntimeError: from the framework, when the recomputation saves tensors of other
            shapes or dtypes, or fewer, than the forward; with ``policy_fn``, when a kept
            op is recomputed on inputs of other shapes, or a second backward runs.
        TypeError: ``policy_fn`` is not callable.
        ValueError: it answered ``MUST_SWAP`` (use ``swap_wrapper``) or something else
            than a ``CheckpointPolicy`` or a bool (raised at that op).
        NotImplementedError: ``output_recompute`` where the platform lacks
            ``Capability.OUTPUT_RECOMPUTE`` (torch: no counterpart in
            ``torch.utils.checkpoint``), before anything runs.
    """
    p = get_platform()
    check_policy_fn(policy_fn, "checkpoint")
    _check_output_recompute(output_recompute, "checkpoint")
    runs = 0
    contexts = context_fn() if context_fn is not None else None
    if context_fn is not None and not (isinstance(contexts, tuple) and len(contexts) == 2):
        raise TypeError(f"checkpoint: context_fn returned {contexts!r}; return a tuple of two context managers "
                        "(forward_context, recompute_context)")

    def run(*inputs: Any) -> Any:
        nonlocal runs
        phase = CheckpointPhase.FORWARD if runs == 0 else CheckpointPhase.RECOMPUTE
        runs += 1
        if phase is CheckpointPhase.FORWARD:
            _FORWARDS.set(_FORWARDS.get() + 1)
        token = _PHASE.set(phase)
        exits: list[Callable[[], None]] = []
        exit_token = _EXIT.set(exits if phase is CheckpointPhase.RECOMPUTE else None)
        try:
            if contexts is None:
                return fn(*inputs)
            with contexts[0] if phase is CheckpointPhase.FORWARD else contexts[1]:
                return fn(*inputs)
        finally:
            _EXIT.reset(exit_token)
            _PHASE.reset(token)
            for callback in exits:  # see on_recompute_exit: also after an early stop
                callback()

    options: dict[str, Any] = {"output_recompute": True} if output_recompute else {}
    if policy_fn is not None:
        options["keep"] = keep_outputs(policy_fn)
    return p.recompute(run, *args, **options)


def checkpoint_wrapper(module: Any, *, context_fn: ContextFn | None = None, policy_fn: Callable[..., Any] | None = None,
                       output_recompute: bool = False) -> Any:
    """Checkpoint ``module`` in place: each call runs its forward through ``checkpoint``
    (its intermediate activations are recomputed in the backward). The module stays
    where it is, with its parameter names and its hooks (which run once, around the
    checkpointed forward; hooks of its submodules run again in the recomputation).
    ``remove_checkpoint_wrapper`` undoes it. Any other callable (an operator a layer
    holds, such as its activation function: MindFormers' ``select`` recompute) is
    returned wrapped, each call checkpointed.

    Args:
        module: a torch ``nn.Module`` / MindSpore ``Cell`` whose forward is
            deterministic, or a deterministic callable taking and returning tensors.
        context_fn: as ``checkpoint``'s, called once per forward of ``module``.
        policy_fn: selective checkpointing, a ``CheckpointPolicy`` per op (``checkpoint``'s).
        output_recompute: ``checkpoint``'s (MindSpore only).

    Returns:
        ``module``, or the wrapped callable.

    Raises:
        ValueError: ``module`` is checkpointed already, or ``module`` or a submodule is
            fully sharded (apply activation checkpointing first, then fully_shard, see
            [Note: composing activation checkpointing with the other layouts]).
        TypeError: ``policy_fn`` or ``module`` is not callable.
        NotImplementedError: ``output_recompute=True`` on torch.
    """
    check_policy_fn(policy_fn, "checkpoint_wrapper")
    if not callable(module):
        raise TypeError(f"checkpoint_wrapper: module={module!r} is not callable; pass a module or an operator")
    _check_output_recompute(output_recompute, "checkpoint_wrapper")
    options = {"context_fn": context_fn, "policy_fn": policy_fn, "output_recompute": output_recompute}
    if is_module(module):
        _check_wrappable(module, "checkpoint_wrapper", type(module).__name__)
    wrapped, handle = wrap_calls(module, lambda fn, args, owner: checkpoint(fn, *args, **options))
    if handle is not None:
        vars(module)[CHECKPOINT_ATTR] = handle
    return wrapped


def is_module(obj: Any) -> bool:
    """True for a torch ``nn.Module`` / MindSpore ``Cell`` (what has submodules)."""
    try:
        next(iter(get_platform().named_modules(obj)))
    except (AttributeError, TypeError):
        return False
    return True


def wrap_calls(module: Any, run: Callable[[Callable[..., Any], tuple[Any, ...], Any], Any]) -> tuple[Any, Any]:
    """Route every call of ``module`` through ``run(fn, args, owner)`` (``fn(*args)`` is the
    original call). A module's forward is replaced in place
    (``platform.register_forward_hook(replace_forward=True)``; ``owner`` is the module)
    and ``(module, hook handle)`` returned; any other callable is returned wrapped, its
    keyword arguments bound into ``fn`` and ``owner`` ``None``: ``(wrapper, None)``.
    Shared by ``checkpoint_wrapper`` and ``swap_wrapper``."""
    if not is_module(module):
        @functools.wraps(module)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return run(functools.partial(module, **kwargs), args, None)

        return wrapped, None

    def forward(owner: Any, args: tuple[Any, ...], original: Callable[..., Any]) -> Any:
        return run(original, args, owner)

    return module, get_platform().register_forward_hook(module, forward, replace_forward=True)


def _check_output_recompute(output_recompute: bool, caller: str) -> None:
    p = get_platform()
    if output_recompute and Capability.OUTPUT_RECOMPUTE not in p.capabilities():
        raise NotImplementedError(f"{caller}: output_recompute=True is MindSpore's merging of adjacent recomputed "
                                  f"regions; {p.name} has no counterpart (not in its capabilities()): use "
                                  "output_recompute=False")


def is_checkpointed(module: Any) -> bool:
    """True when ``checkpoint_wrapper`` checkpoints ``module``."""
    return CHECKPOINT_ATTR in vars(module)


def remove_checkpoint_wrapper(module: Any) -> Any:
    """Restore the forward ``checkpoint_wrapper`` replaced and return ``module``.

    Raises:
        ValueError: ``module`` is not checkpointed.
        RuntimeError: another forward replacement of ``module`` made after the wrapper
            is still in place (remove that first).
    """
    handle = vars(module).get(CHECKPOINT_ATTR)
    if handle is None:
        raise ValueError(f"remove_checkpoint_wrapper: {type(module).__name__} is not checkpointed")
    handle.remove()
    del vars(module)[CHECKPOINT_ATTR]
    return module


def apply_activation_checkpointing(model: Any, check_fn: Callable[[Any], bool] | None = None, *,
                                   fqns: list[str] | None = None) -> list[str]:
    """Checkpoint, in place, every submodule of ``model`` for which ``check_fn(module)``
    is true (torch's ``apply_activation_checkpointing(model, check_fn=...)``), or the
    submodules named in ``fqns`` (dotted names from ``model``, ``""`` for ``model``).
    A module below one already selected is skipped: its outer module recomputes it.

    Typical use, one checkpoint per transformer block, before fully_shard:
    ``apply_activation_checkpointing(model, fqns=[f"layers.{i}" for i in range(n)])``.

    Returns:
        The dotted names of the modules checkpointed, outermost first.

    Raises:
        ValueError: neither or both of ``check_fn`` and ``fqns`` given; a name in ``fqns``
            that is not a submodule (the message lists the nearest); and what
            ``checkpoint_wrapper`` raises. Checked for every module before any is wrapped.
    """
    p = get_platform()
    if (check_fn is None) == (fqns is None):
        raise ValueError("apply_activation_checkpointing: give exactly one of check_fn (a predicate on modules) "
                         "and fqns (dotted submodule names)")
    modules = list(p.named_modules(model))
    if fqns is not None:
        names = {name for name, _ in modules}
        missing = [fqn for fqn in fqns if fqn not in names]
        if missing:
            near = difflib.get_close_matches(missing[0], sorted(names), n=3)
            raise ValueError(f"apply_activation_checkpointing: no submodule {missing[0]!r} in "
                             f"{type(model).__name__}; nearest: {near}")
        wanted = set(fqns)
        selected = [(name, sub) for name, sub in modules if name in wanted]
    else:
        selected = [(name, sub) for name, sub in modules if check_fn(sub)]
    chosen: list[tuple[str, Any]] = []
    for name, sub in selected:  # named_modules lists a parent before its children
        if not any(name == outer or outer == "" or name.startswith(outer + ".") for outer, _ in chosen):
            chosen.append((name, sub))
    for name, sub in chosen:  # every module checked before any is wrapped: nothing is half-applied
        _check_wrappable(sub, "apply_activation_checkpointing", name or "<model>")
    for _, sub in chosen:
        checkpoint_wrapper(sub)
    return [name for name, _ in chosen]


def _check_wrappable(module: Any, caller: str, name: str) -> None:
    if CHECKPOINT_ATTR in vars(module):
        raise ValueError(f"{caller}: {name} is already checkpointed")
    sharded = [sub_name or "<itself>" for sub_name, sub in get_platform().named_modules(module)
               if FULLY_SHARDED_ATTR in vars(sub)]
    if sharded:
        raise ValueError(f"{caller}: {name} holds fully sharded modules {sharded[:3]}; apply activation "
                         "checkpointing before fully_shard (the chain is tensor parallel, context parallel, "
                         "activation checkpointing, fully_shard), then fully_shard the checkpointed module or an "
                         "ancestor")
