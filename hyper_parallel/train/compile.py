"""``--compile``: each decoder block's local compute run by the framework's compiler
(``Platform.compile_module``), the collectives and hooks at its edges.

[Note: what --compile compiles]
The job's step stays the PyNative / eager step (``loop._train_step``: forward and backward
through ``Platform.vjp``, the global gradient norm, AdamW); ``--compile`` compiles decoder
blocks inside it, after the layout chain (``parallelize``), as torchtitan compiles each
TransformerBlock:

- torch (``Capability.COMPILE_AROUND_HOOKS``): each whole block, by ``torch.compile``. Its
  own hooks (fully_shard's unit: all-gather before, reduce-scatter after) run eagerly
  around it; the hooks inside it (the tensor-parallel styles on its linear layers) run
  eagerly between compiled pieces, collectives included ([Note: hooks stay eager under
  torch.compile] in ``platform/torch/compile.py``). Single rank, ``--tp``,
  ``--dp-shard``, ``--dp-replicate`` and their compositions.
- MindSpore (no such capability: ``mindspore.jit`` traces submodules' hooks): each dense
  block's math in two parameter-free modules of the block (``train/model.py``), MindSpore
  operations alone, as functions of the weights: ``attention_inputs`` (``attention_norm``,
  the q/k/v projections, the per-head norms, RoPE) and ``block_outputs`` (the output
  projection and residual, ``ffn_norm``, the SwiGLU MLP and residual). The block's forward
  is replaced (``register_forward_hook(replace_forward=True)``: the block's own hooks,
  fully_shard's unit, still run around it) by ``_through_block_math``, which reads the
  weights in PyNative and hands them in, and runs the core attention between the two
  compiled graphs in PyNative: core's ``scaled_dot_product_attention``, the platform's
  fused kernel with its own backward (an autograd function, which the bytecode capture
  cannot trace: ``Unsupported function``; traced whole, the block crashed MindSpore 2.10,
  a segmentation fault; on CPU the platform runs a small call's kernel as its own graph
  each way, [Note: MindSpore CPU attention in one graph]). So what the compiler sees are its inputs, whatever put them in
  the parameters' place: fully_shard's gathered weights (``--dp-shard``,
  ``--dp-replicate``) take their whole gradient, which they did not when a compiled
  forward read the substituted attributes itself (seen: the dp-shard 2 job's gradient
  norm 2.0785 against PyNative's 2.0814). The compiled math is straight-line code on
  tensors: MindSpore 2.10's bytecode capture handles it, but not everything Python
  allows. Seen, each on the ``small`` block's ``attention_inputs``: ``x[..., :half]``
  aborts the capture ("must be call"; the math runs in PyNative, so RoPE uses
  ``narrow``); projections handed in as functions (lambdas, or a module-level function
  as an argument) ran 7-300x slower than the same operations written inline (2.8 ms a
  call inline, about 0.9 s with lambdas). The linear layers' own forwards, and so the
  tensor-parallel styles' hooks on them, do not run on that path: ``--tp`` stays refused on
  MindSpore (``check_compile_layout``). One rank, ``--dp-shard`` and ``--dp-replicate``.

What neither compiles (refused by ``check_compile`` before any rank starts, naming the flag,
the layout and the fix): ``--cp`` and ``--pp`` (their hooks and stages are not checked under a compiler),
mixture-of-experts blocks (routing reads token counts on the host), ``--hf-config``
models, and ``--activation-checkpointing`` (a compiled forward inside the recomputed
region is not checked). The single-process reference of ``--check-parity`` runs eagerly,
so it checks the compiled run against PyNative / eager.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform import Capability, Platform

#: The parts of a dense block MindSpore compiles (parameter-free modules of its math: see
#: [Note: what --compile compiles]).
MINDSPORE_PARTS = ("attention_inputs", "block_outputs")


def check_compile(layout: Any, *, moe: bool, hf_config: bool, activation_checkpointing: bool) -> None:
    """Refuse ``--compile`` where the job compiles on neither framework ([Note: what
    --compile compiles]); ``layout`` is the run's ``config.Layout``. Runs in
    ``TrainConfig``, before any rank starts (what depends on the platform's compiler:
    ``check_compile_layout``).

    Raises:
        ValueError: naming ``--compile``, the layout or flag it cannot take, why, and the fix.
    """
    if hf_config:
        raise ValueError("--compile compiles the job's decoder blocks; a --hf-config model's layers are Hugging "
                         "Face's, not checked under a compiler: drop --compile or --hf-config")
    if moe:
        raise ValueError("--compile cannot compile mixture-of-experts blocks (--moe-experts): their routing reads "
                         "token counts back to the host each step, which breaks a compiled graph; drop --compile or "
                         "train a dense model")
    if activation_checkpointing:
        raise ValueError("--compile cannot be combined with --activation-checkpointing yet: a compiled block inside "
                         "the recomputed region is not checked; drop one of them")
    for flag, degree, why in (("--pp", layout.pp, "pipeline stages are not compiled"),
                              ("--cp", layout.cp, "context parallelism's attention hooks are not checked under a "
                                                  "compiler")):
        if degree > 1:
            raise ValueError(f"--compile cannot be combined with {flag}={degree} (layout {layout.describe()}): {why}; "
                             f"drop --compile or {flag}")


def check_compile_layout(p: Platform, layout: Any) -> None:
    """Refuse ``--compile`` with ``--tp`` where the platform's compiler traces the hooks
    inside what it compiles (no ``Capability.COMPILE_AROUND_HOOKS``: MindSpore's jit; the
    compiled block math bypasses the linear layers and so the tensor-parallel styles'
    hooks on them: [Note: what --compile compiles]). Runs on every rank at the start of
    ``loop.setup``, before the first collective: the capability is the platform's, which
    the launching process does not build.

    Raises:
        ValueError: naming ``--compile``, the platform, the layout and the fix.
    """
    if layout.tp > 1 and Capability.COMPILE_AROUND_HOOKS not in p.capabilities():
        raise ValueError(f"--compile on {p.name} cannot take --tp={layout.tp} (layout {layout.describe()}): its "
                         "compiler traces the tensor-parallel hooks of the block's linear layers, so the job compiles "
                         "the block's math around them, which tensor parallelism needs to run; drop --compile or --tp "
                         "(--compile runs with --nproc 1, --dp-shard and --dp-replicate there), or use a platform "
                         "whose compiler runs hooks eagerly: torch")


def compiled_parts(p: Platform, model: Any) -> list[Any]:
    """The modules ``apply_compile`` compiles in ``model`` (a parallelized decoder):
    every block on a platform with ``Capability.COMPILE_AROUND_HOOKS``, else each block's
    ``attention_inputs`` and ``block_outputs`` ([Note: what --compile compiles])."""
    blocks = list(model.layers)
    if Capability.COMPILE_AROUND_HOOKS in p.capabilities():
        return blocks
    return [getattr(block, part) for block in blocks for part in MINDSPORE_PARTS]


def _through_block_math(block: Any, args: tuple[Any, ...], native: Any) -> Any:
    """A dense block's forward as its weights, read here (fully_shard's gathered ones where
    its hooks put them), handed to its (compiled) ``attention_inputs`` and
    ``block_outputs``, the core attention (``attention.core``: the platform's fused
    attention) run between them; a call with a KV cache runs the block's own forward."""
    if len(args) != 3:
        return native(*args)
    x, cos, sin = args
    attention, ffn = block.attention, block.feed_forward
    qk_norms = (attention.q_norm.weight, attention.k_norm.weight) if attention.qk_norm else ()
    q, k, v = block.attention_inputs(x, cos, sin, block.attention_norm.weight, attention.wq.weight,
                                     attention.wk.weight, attention.wv.weight, *qk_norms)
    return block.block_outputs(x, attention.core(q, k, v), attention.wo.weight, block.ffn_norm.weight,
                               ffn.w1.weight, ffn.w2.weight, ffn.w3.weight)


def apply_compile(p: Platform, model: Any) -> list[Any]:
    """Compile ``compiled_parts(p, model)`` in place (``Platform.compile_module``), and on a
    platform without ``COMPILE_AROUND_HOOKS`` route each block through its compiled math
    (``_through_block_math``); returns the handles (``remove()`` in reverse order restores the eager
    forwards). Compilation itself happens in the first step. No communication."""
    handles = [p.compile_module(module) for module in compiled_parts(p, model)]
    if Capability.COMPILE_AROUND_HOOKS not in p.capabilities():
        handles += [p.register_forward_hook(block, _through_block_math, replace_forward=True)
                    for block in model.layers]
    return handles
