"""``--dtype``: the job's mixed precision, and dynamic loss scaling for float16.

[Note: the job's mixed precision]
One policy for every layout: ``MixedPrecisionPolicy(param_dtype=D, reduce_dtype=float32)``
(``mixed_precision_policy``), FSDP2's semantics. The parameters the optimizer steps stay
float32 (the master weights, and AdamW's moments with them); each forward computes with a
copy of them cast to ``D``; each unit's (decoder block's) floating inputs are cast to ``D``;
the gradients come back to the float32 parameters through the cast's backward, and are
summed over the data-parallel ranks in float32.

- Under fully_shard (``--dp-shard``, ``--dp-replicate``, ``--cp``) the policy is handed to
  ``fully_shard`` (``parallelize.apply_fully_shard``): the all-gather casts the float32
  shard to ``D``, the gradient is reduce-scattered in float32 onto the float32 shard.
- Without it (one rank, ``--tp`` alone) ``apply_mixed_precision`` hooks the same units:
  the root's own parameters (embedding, final norm, output head) are read as ``D`` copies
  during the root's forward, each block's parameters during the forward of the layer that
  holds them (so a block's recomputation under activation checkpointing, which runs those
  layers' hooks again, reads ``D`` too; a recomputation stopped early, which skips the
  post-hooks, removes its copies when it ends), and each block's floating inputs are cast to ``D``,
  as fully_shard's ``cast_forward_inputs``. The copies are put in the module's instance
  ``__dict__``, as fully_shard presents its gathered parameters ([Note: parameter
  substitution] in ``core/fully_shard/hsdp_state``); the parameters stay registered. Under
  tensor parallelism the style's hooks (registered first) have put the parameter's local
  piece there already: that piece is what is cast.
- A pipeline stage (``--pp``) gets the same, per stage module (``pipeline.build_pipeline``),
  except that a stage's root never casts its inputs: the positions cross a stage boundary
  as float32 (``model._stage_forward``; bfloat16 rounds integers above 256), the residual
  stream arrives in ``D`` already.

So a run in ``D`` on any of these layouts computes what one process computes in ``D``, up
to the order of floating-point sums (``tests/train/test_precision.py``). The loss is taken
in float32 (``model.cross_entropy``). ``float32`` installs nothing: the float32 job as before.

[Note: dynamic loss scaling]
float16 has 5 exponent bits: gradients below ~6e-8 flush to zero. As
``torch.amp.GradScaler``, the backward is seeded with ``scale`` instead of 1 (the loss
times ``scale``), so the float16 gradients are ``scale`` times larger; the global gradient
norm (one all-reduce over every rank's pieces, ``grad_norm``) tells every rank at once
whether any gradient overflowed (a pipeline: the last stage's loss times ``scale`` seeds
the schedule's backward, ``pipeline.train_step``). If it is not finite the step is skipped (no optimizer
update, AdamW's step count unchanged) and ``scale`` halves; otherwise the optimizer steps
with the gradients multiplied by ``clip / scale`` (unscaled and clipped in one factor) and
after ``GROWTH_INTERVAL`` finite steps in a row ``scale`` doubles. bfloat16 has float32's
exponent range and float32 needs no scaling: their scale is 1 and never changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.activation_checkpoint.region import CheckpointPhase, checkpoint_phase, on_recompute_exit
from hyper_parallel.core.fully_shard import HSDPModule, MixedPrecisionPolicy
from hyper_parallel.core.tensor_ops import dtype_name
from hyper_parallel.platform import Platform

#: ``--dtype`` values and the dtype names (``platform.dtype``) they stand for.
DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: ``--dtype`` when none is given: float32 on a CPU backend (its low-precision kernels are
#: slow or missing), bfloat16 on an accelerator (CUDA, NPU, Ascend), as LLM recipes train.
DEFAULT_CPU, DEFAULT_ACCELERATOR = "fp32", "bf16"

#: Dynamic loss scaling (float16): the first scale, and the finite steps in a row after
#: which it doubles (``torch.amp.GradScaler``'s defaults: 2**16 and 2000).
INITIAL_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000


def resolve_dtype(dtype: str | None, device_type: str) -> str:
    """``--dtype`` as given, or the default of ``device_type`` (``DEFAULT_CPU`` on
    ``"cpu"``, else ``DEFAULT_ACCELERATOR``).

    Raises:
        ValueError: ``dtype`` is not one of ``DTYPES``.
    """
    if dtype is None:
        return DEFAULT_CPU if device_type == "cpu" else DEFAULT_ACCELERATOR
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not a training dtype; use one of {', '.join(DTYPES)} (default: "
                         f"{DEFAULT_CPU} on CPU, {DEFAULT_ACCELERATOR} on an accelerator)")
    return dtype


def mixed_precision_policy(dtype: str) -> MixedPrecisionPolicy | None:
    """The policy of ``--dtype`` ([Note: the job's mixed precision]): compute in ``dtype``,
    reduce gradients in float32 (torchtitan's default: a sum of many low-precision
    gradients loses bits); ``None`` for ``fp32`` (nothing to cast)."""
    if resolve_dtype(dtype, "cpu") == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype="float32")


def _blocks(model: Any) -> list[Any]:
    """The decoder's blocks (a pipeline stage keys them by their index in the decoder)."""
    return list(model.layers.values() if hasattr(model.layers, "values") else model.layers)


def apply_mixed_precision(p: Platform, model: Any, policy: MixedPrecisionPolicy) -> None:
    """Hook ``model`` (the job's decoder, not fully sharded) so that its forward computes
    in ``policy.param_dtype`` while its parameters stay in their dtype (float32): see
    [Note: the job's mixed precision]. Collectives: none. The gradients ``platform.vjp``
    returns for the parameters are in the parameters' dtype (the cast's backward).

    Raises:
        TypeError: ``model`` already holds a fully sharded module (fully_shard applies
            the policy itself: pass it there).
    """
    if any(isinstance(m, HSDPModule) for _, m in p.named_modules(model)):
        raise TypeError("apply_mixed_precision: the model is fully sharded; give the MixedPrecisionPolicy to "
                        "fully_shard instead (parallelize.apply_fully_shard)")
    dtype = p.dtype(policy.param_dtype)
    blocks = _blocks(model)
    in_blocks = {id(param) for block in blocks for _, param in p.named_parameters(block)}

    def cast(value: Any) -> Any:
        floating = p.is_tensor(value) and dtype_name(value.dtype) in ("float16", "bfloat16", "float32", "float64")
        return p.to_dtype(value, dtype) if floating else value

    mine: dict[tuple[int, str], Any] = {}  # (id(owner), name) -> the copy put there

    def withdraw(owners: list[tuple[Any, str]]) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            for owner, name in owners:
                copy = mine.pop((id(owner), name), None)
                if copy is not None and vars(owner).get(name) is copy:
                    del vars(owner)[name]
        return hook

    def present(owners: list[tuple[Any, str]]) -> Any:
        def hook(module: Any, args: Any) -> None:
            # the parameters as registered now, not when hooked: a meta-device build
            # (--init-device meta) and a sharded load replace them by new objects
            registered: dict[int, dict[str, Any]] = {}
            for owner, name in owners:
                if id(owner) not in registered:
                    registered[id(owner)] = dict(_direct_parameters(p, owner))
                param = registered[id(owner)][name]
                # a tensor a hook registered before put there is cast instead (tensor
                # parallelism's local piece of the parameter: its forward computes on it)
                there = vars(owner).get(name)
                source = param if there is None or there is mine.get((id(owner), name)) else there
                vars(owner)[name] = mine[(id(owner), name)] = p.to_dtype(source, dtype)
            if checkpoint_phase() is CheckpointPhase.RECOMPUTE:
                # a recomputation stopped early skips the post-hook: a copy left behind
                # would be read by the next step's forward
                on_recompute_exit(lambda: withdraw(owners)(module, args, None))
        return hook

    def hook_unit(module: Any, owners: list[tuple[Any, str]]) -> None:
        if owners:
            p.register_forward_pre_hook(module, present(owners))
            p.register_forward_hook(module, withdraw(owners))

    # the root unit: every parameter outside the blocks, for the whole forward (a tied
    # output head reads the embedding's weight outside the embedding's own forward)
    root = [(owner, name) for _, owner in p.named_modules(model)
            for name, param in _direct_parameters(p, owner) if id(param) not in in_blocks]
    hook_unit(model, root)
    for block in blocks:
        # each layer inside a block for its own forward: rerun by a recomputation
        for _, owner in p.named_modules(block):
            hook_unit(owner, [(owner, name) for name, _ in _direct_parameters(p, owner)])
        if policy.cast_forward_inputs:
            p.register_forward_pre_hook(block, lambda module, args: tuple(cast(a) for a in args))


def _direct_parameters(p: Platform, module: Any) -> list[tuple[str, Any]]:
    """``module``'s own parameters (not its submodules'): names without a dot."""
    return [(name, param) for name, param in p.named_parameters(module) if "." not in name]


@dataclass
class LossScaler:
    """[Note: dynamic loss scaling]. ``enabled=False`` (bfloat16, float32): ``scale`` stays 1.

    Attributes:
        enabled: float16 training.
        scale: the factor the backward is seeded with (a power of two).
        good_steps: finite steps since the scale last changed.
    """

    enabled: bool
    scale: float = INITIAL_SCALE
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0

    def update(self, norm: float) -> bool:
        """After a backward whose scaled global gradient norm is ``norm``: whether the step
        is taken (the norm is finite); adjust ``scale``."""
        if not self.enabled:
            return True
        if not math.isfinite(norm):
            self.scale /= 2.0
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps >= GROWTH_INTERVAL:
            self.scale *= 2.0
            self.good_steps = 0
        return True
