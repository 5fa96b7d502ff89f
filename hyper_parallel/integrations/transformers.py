"""Hugging Face ``transformers`` models, unmodified, under this project's parallelism
(torch backend).

Three pieces, used together (``docs/integrations.md`` has the recipe):

- ``attn_implementation="hyper_parallel"``: an attention function registered in HF's
  ``AttentionInterface`` (its public extension point; ``register_attention``). It takes
  the q/k/v HF's attention layers compute (``[batch, heads, seq, head_dim]``, grouped-query
  K/V as they are) and runs ``hyper_parallel.scaled_dot_product_attention`` on the
  platform's fused kernels: causal, packed documents (``cu_seq_lens_q`` or derived from
  ``position_ids``), and context parallelism when ``parallelize`` gave the layer a
  ``ContextParallel`` core.
- ``parallelize(model, mesh, ...)``: the main job's chain (``train/parallelize.py``) on an
  HF model: tensor parallelism from the model's own ``base_model_tp_plan``, context
  parallelism on every attention call, activation checkpointing and fully_shard per
  decoder layer (the classes named by ``model._no_split_modules``), then the root.
- ``shard_batch(batch, mesh)``: this rank's part of a batch for the ``cp`` axis, labels
  shifted before sharding and the loss normalized by the global number of target tokens.

[Note: what the attention function refuses]
Its kernels take structural masks only (full, causal, packed documents), so everything
else an HF layer may ask for raises instead of being ignored: a padding mask with a zero,
attention dropout while training, logit soft-capping, attention sinks, a sliding window
shorter than the (global) sequence. The checks need no communication, so every rank
raises before the first collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
from hyper_parallel.core.context_parallel import ContextParallel, context_parallel_shard, scaled_dot_product_attention
from hyper_parallel.core.context_parallel.context import Plan
from hyper_parallel.core.context_parallel.load_balance import check_seq_len, shard_positions
from hyper_parallel.core.dtensor import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.core.tensor_parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from hyper_parallel.platform import get_platform

#: The name to pass as ``attn_implementation`` (``from_config``/``from_pretrained``).
ATTN_IMPLEMENTATION = "hyper_parallel"
#: The mesh axes ``parallelize`` and ``shard_batch`` read (any subset, sizes from the mesh).
MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
#: ``cp_mode`` values: K/V passed around a ring, all-gathered once, or Ulysses all-to-all.
CP_MODES = ("ring", "allgather", "ulysses")
#: The attribute of an HF attention layer that holds its ``CoreAttention``.
CORE_ATTR = "hp_core_attention"
IGNORE_INDEX = -100


def _tp_style(style: str) -> ParallelStyle | None:
    """Our style for one of HF's TP style strings (``transformers.distributed.
    tensor_parallel.ALL_PARALLEL_STYLES``); ``None`` where there is none."""
    if style == "colwise":  # output sharded on features: whole heads per rank
        return ColwiseParallel()
    if style == "rowwise":  # input sharded on features, output all-reduced
        return RowwiseParallel()
    if style in ("colwise_gather_output", "colwise_rep"):  # lm_head: the logits all-gathered
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise_rep", "rowwise_split_input"):  # a replicated input, split locally
        return RowwiseParallel(input_layouts=Replicate())
    return None


# -- the attention function -------------------------------------------------------------
class CoreAttention(torch.nn.Module):
    """The parameter-free core of one HF attention layer: BSHD q/k/v in, the attention
    output out, through ``hyper_parallel.scaled_dot_product_attention``. ``parallelize``
    hangs one on each attention layer (attribute ``hp_core_attention``) and hooks it with
    ``ContextParallel``, whose hooks exchange K/V (or all-to-all heads) around this call.

    Attributes:
        plan: the context-parallel plan the hooks run (``None`` without context
            parallelism); the attention function reads its degree.
    """

    def __init__(self) -> None:
        super().__init__()
        self.plan: Plan | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool,
                scale: float | None = None, cu_seqlens: Any = None) -> torch.Tensor:
        """``q`` ``[batch, seq, heads, head_dim]``, ``k``/``v`` ``[batch, seq, kv_heads,
        head_dim]`` -> ``[batch, seq, heads, head_dim]`` in ``q``'s dtype."""
        return scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, cu_seqlens=cu_seqlens)


def documents_from_position_ids(position_ids: torch.Tensor) -> np.ndarray | None:
    """The packed documents of ``position_ids`` ``[batch or 1, seq]`` as cumulative
    lengths ``[0, l0, l0 + l1, ..., seq]`` (int64): a document starts wherever a position
    is not its predecessor plus one (as HF's ``find_packed_sequence_indices``). ``None``
    when every row is one run. Copies ``position_ids`` to the host.

    Raises:
        ValueError: rows with different documents (the kernels take one document layout
            for the whole batch: pack each batch into one row, as HF's
            ``DataCollatorWithFlattening`` does).
    """
    pos = position_ids.detach().cpu().numpy().reshape(-1, position_ids.shape[-1])
    starts = [np.flatnonzero(np.diff(row) != 1) + 1 for row in pos]
    if any(not np.array_equal(starts[0], s) for s in starts[1:]):
        raise ValueError("attn_implementation='hyper_parallel': the rows of position_ids pack different documents; "
                         "the kernels take one document layout per batch: pack the documents into one row "
                         "(batch size 1, as DataCollatorWithFlattening does) or pass cu_seq_lens_q")
    if not len(starts[0]):
        return None
    return np.concatenate([[0], starts[0], [pos.shape[1]]]).astype(np.int64)


def _cu_seqlens(kwargs: Mapping[str, Any], where: str) -> Any:
    """``cu_seq_lens_q`` of a call (HF's flash-attention keyword for packed documents);
    ``cu_seq_lens_k`` must agree (self-attention)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or not np.array_equal(np.asarray(_host(cu_q)), np.asarray(_host(cu_k))):
        raise ValueError(f"{where}: cu_seq_lens_q and cu_seq_lens_k must both be given and equal (self-attention "
                         "over packed documents)")
    return cu_q


def _host(x: Any) -> Any:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


def _check_no_padding(attention_mask: Any, where: str) -> None:
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 and bool(attention_mask.all()):
        return
    shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
    raise ValueError(f"{where}: attention_mask {shape} masks some tokens, but the fused kernels of "
                     "attn_implementation='hyper_parallel' take structural masks only (causal, packed documents). "
                     "Pack the sequences instead of padding them (position_ids restarting at 0 per document, or "
                     "cu_seq_lens_q), or right-pad with labels -100 and pass attention_mask=None")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature (``AttentionInterface``), on fused kernels.

    Args:
        module: the HF attention layer (its ``is_causal``; its ``hp_core_attention``, if
            ``parallelize`` gave it one, runs the call under its context parallelism).
        query: ``[batch, heads, seq, head_dim]``.
        key, value: ``[batch, kv_heads, seq, head_dim]``, ``heads`` divisible by
            ``kv_heads`` (grouped-query attention, never repeated).
        attention_mask: HF's 2-D mask ``[batch, seq]``, all ones, or ``None``.
        scaling: multiplies ``q k^T`` (default ``head_dim ** -0.5``).
        dropout: must be 0 while training.
        kwargs: ``cu_seq_lens_q``/``cu_seq_lens_k`` (packed documents of the whole
            sequence), ``position_ids`` (documents derived where they restart, without
            context parallelism), ``is_causal``, ``sliding_window``; others are ignored.

    Returns:
        ``([batch, seq, heads, head_dim]`` in ``query``'s dtype, ``None``) — no attention
        weights (no score matrix exists).

    Raises:
        ValueError: what [Note: what the attention function refuses] lists.
    """
    where = f"attn_implementation='hyper_parallel' in {type(module).__name__}"
    if dropout and module.training:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported by the fused kernels; set the "
                         "config's attention_dropout to 0")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: {name} is not supported by the fused kernels; use another attn_implementation")
    core = getattr(module, CORE_ATTR, None)
    cp = core.plan.cp if core is not None and core.plan is not None else 1
    window = kwargs.get("sliding_window")
    if window is not None and int(query.shape[2]) * cp > int(window):
        raise ValueError(f"{where}: sliding_window={window} is shorter than the sequence ({int(query.shape[2]) * cp} "
                         "tokens); the fused kernels attend over the whole causal prefix: train on sequences of at "
                         "most sliding_window tokens")
    if attention_mask is not None:
        _check_no_padding(attention_mask, where)
    cu_seqlens = _cu_seqlens(kwargs, where)
    if cu_seqlens is None and cp == 1 and kwargs.get("position_ids") is not None:
        cu_seqlens = documents_from_position_ids(kwargs["position_ids"])
    is_causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BNSD -> BSHD views, no copy
    if core is not None:
        out = core(q, k, v, is_causal=is_causal, scale=scaling, cu_seqlens=cu_seqlens)
    else:
        out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scaling, cu_seqlens=cu_seqlens)
    return out, None


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                   **kwargs: Any) -> None:
    """HF's mask-function signature (``AttentionMaskInterface``): no mask tensor is ever
    built; causal order and packed documents reach the kernels structurally. Registered
    because HF drops the user's padding mask without a word for an attention
    implementation that has no mask function.

    Returns:
        ``None`` (nothing to mask).

    Raises:
        ValueError: ``attention_mask`` masks a token (padding).
    """
    if attention_mask is not None:
        _check_no_padding(attention_mask, "attn_implementation='hyper_parallel'")


def register_attention() -> None:
    """Register ``attention_forward`` in HF's ``AttentionInterface`` and
    ``attention_mask`` in its ``AttentionMaskInterface`` as ``"hyper_parallel"``
    (idempotent), so that ``from_config(config, attn_implementation="hyper_parallel")``
    finds them. ``parallelize`` calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)


# -- parallelize ------------------------------------------------------------------------
def _degrees(mesh: DeviceMesh, where: str, pipelined: bool = False) -> dict[str, int]:
    """``{axis: size}`` for every axis of ``MESH_AXES`` (1 where the mesh has none).
    ``pipelined``: a ``pp`` axis of any size is allowed (the main job's pipeline stages,
    each parallelized over the other axes of its pipeline coordinate).

    Raises:
        ValueError: an unnamed mesh, an axis name outside ``MESH_AXES``, or a mesh that
            is not the whole world.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if not names or any(n not in MESH_AXES and mesh.size(n) > 1 and not (pipelined and n == "pp") for n in names):
        raise ValueError(f"{where}: the mesh's axes {names} must be named from {MESH_AXES} (other axes of size 1 "
                         "are ignored), e.g. init_device_mesh(device, (2, 2), mesh_dim_names=('dp_shard', 'tp'))")
    world = get_platform().world_size()
    if mesh.size() != world:
        raise ValueError(f"{where}: the mesh holds {mesh.size()} ranks but the world has {world}; build it over "
                         "every rank (init_device_mesh)")
    return {axis: mesh.size(axis) if axis in names else 1 for axis in MESH_AXES}


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def tensor_parallel_plan(model: Any, prefixed: bool = True) -> dict[str, ParallelStyle]:
    """The model's own TP plan as ``{module_fqn_pattern: our style}``: the config's
    ``base_model_tp_plan`` under the base model's prefix, and the head's entries of the
    class's ``_tp_plan`` (``lm_head``) unless the head is tied to the embedding (a tied
    head stays replicated over ``tp``, so the two stay one parameter). ``prefixed=False``:
    the base entries without the prefix (for a module that holds the base model's layers
    as ``layers``, as the main job's pipeline stages do).

    Raises:
        ValueError: the model has no plan, or an entry whose style has no counterpart
            here (the message names the entry and the styles that map).
    """
    base = getattr(_text_config(model), "base_model_tp_plan", None) or {}
    if not base:
        raise ValueError(f"parallelize: {type(model).__name__}'s config has no base_model_tp_plan; tensor "
                         "parallelism needs one (drop the 'tp' axis, or set config.base_model_tp_plan)")
    prefix = getattr(model, "base_model_prefix", "") if prefixed else ""
    plan = {f"{prefix}.{k}" if prefix and getattr(model, prefix, None) is not None else k: v for k, v in base.items()}
    tied = bool(getattr(_text_config(model), "tie_word_embeddings", False))
    for key, style in (getattr(type(model), "_tp_plan", None) or {}).items():
        if not (tied and key == "lm_head"):
            plan[key] = style
    styles = {}
    for key, style in plan.items():
        ours = _tp_style(style)
        if ours is None:
            raise ValueError(f"parallelize: the TP plan entry {key!r}: {style!r} has no hyper_parallel style; the "
                             "styles that map are 'colwise', 'rowwise', 'colwise_gather_output', 'colwise_rep', "
                             "'rowwise_rep', 'rowwise_split_input' (drop the entry from config.base_model_tp_plan to "
                             "keep that module replicated)")
        styles[key] = ours
    return styles


def _check_heads(model: Any, tp: int) -> None:
    config = _text_config(model)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % tp or kv_heads % tp:
        raise ValueError(f"parallelize: tp={tp} must divide num_attention_heads={heads} and "
                         f"num_key_value_heads={kv_heads} (whole heads per rank); choose a tp that divides both")


def make_context_parallel(cp_mode: str, load_balance: bool, ulysses_degree: int | None) -> ContextParallel:
    """The attention layers' ``ContextParallel`` for ``parallelize``'s arguments (BSHD)."""
    if cp_mode == "ulysses":
        return ContextParallel(ulysses_degree=None)
    # hybrid when 1 < ulysses_degree < cp: all-to-all over ulysses_degree ranks, K/V exchanged over the rest
    return ContextParallel(ulysses_degree=ulysses_degree or 1, kv_exchange=cp_mode, load_balance=load_balance)


def _attention_layers(model: Any) -> list[torch.nn.Module]:
    """The modules that call HF's attention interface: those with the attributes HF's
    attention layers set (``is_causal``, ``scaling``) and q/k/v projections or a config."""
    return [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "scaling") and hasattr(m, "config")]


def decoder_layers(model: Any, within: Any = None) -> list[torch.nn.Module]:
    """The modules of ``within`` (default ``model``) whose class ``model._no_split_modules``
    names, in order.

    Raises:
        ValueError: the model names none, or none is found.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in (model if within is None else within).modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"parallelize: {type(model).__name__}._no_split_modules={sorted(names)} names no module of "
                         "the model; fully_shard and activation checkpointing need the decoder-layer class there")
    return layers


def _fully_shard_mesh(mesh: DeviceMesh, deg: dict[str, int]) -> DeviceMesh:
    """``dp_shard`` (x ``cp``: parameters are replicated over ``cp``, so their gradients
    are averaged over it too), with ``dp_replicate`` first for HSDP. Collective where it
    builds a group."""
    names = mesh.mesh_dim_names
    shard = [a for a in ("dp_shard", "cp") if a in names and deg[a] > 1]
    replicate = "dp_replicate" in names and deg["dp_replicate"] > 1
    if len(shard) < 2:
        axes = (["dp_replicate"] if replicate else []) + (shard or ["dp_shard"])
        return mesh[tuple(axes)]
    if not replicate:
        return mesh["dp_shard", "cp"].flatten("dp_shard_cp")
    i = names.index("dp_shard")
    if names[i + 1:i + 2] != ("cp",):
        raise ValueError(f"parallelize: HSDP with context parallelism needs the 'cp' axis right after 'dp_shard' "
                         f"in the mesh (got {names}); order the axes as {MESH_AXES}")
    shape = mesh.shape[:i] + (deg["dp_shard"] * deg["cp"],) + mesh.shape[i + 2:]
    merged = DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape),
                        mesh_dim_names=names[:i] + ("dp_shard_cp",) + names[i + 2:])
    return merged["dp_replicate", "dp_shard_cp"]


@dataclass(frozen=True)
class _RootInputs:
    """The root forward pre-hook ``parallelize`` registers: it checks a call's inputs
    once per step, on every rank and before fully_shard's first all-gather, and turns
    ``position_ids`` into documents once instead of per layer.

    Attributes:
        plan: the context-parallel plan (``None`` without ``cp``).
    """

    plan: Plan | None

    def __call__(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        where = "parallelize: the model's inputs"
        kwargs = dict(kwargs)
        if self.plan is not None and (kwargs.get("use_cache") or kwargs.get("cache") is not None):
            raise ValueError(f"{where}: a KV cache holds only this rank's part of the sequence under context "
                             "parallelism; call the model with use_cache=False (generate without the cp axis)")
        if _module.training or self.plan is not None:
            # a cache made in the forward would be appended to again by a checkpointed layer's recomputation
            kwargs.setdefault("use_cache", False)
        if kwargs.get("attention_mask") is not None:
            _check_no_padding(kwargs["attention_mask"], where)
            kwargs["attention_mask"] = None  # all ones: nothing to mask, and no check per layer
        cu = _cu_seqlens(kwargs, where)
        position_ids = kwargs.get("position_ids")
        if self.plan is None:
            if cu is None and position_ids is not None:
                docs = documents_from_position_ids(position_ids)
                if docs is not None:
                    kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = torch.from_numpy(docs)
            return args, kwargs
        if position_ids is None:
            raise ValueError(f"{where}: under context parallelism each rank holds part of the sequence, so the model "
                             "needs position_ids (the global positions of this rank's tokens, for RoPE and the "
                             "masks): pass the batch through shard_batch(batch, mesh)")
        self._check_positions(position_ids, cu)
        return args, kwargs

    def _check_positions(self, position_ids: torch.Tensor, cu: Any) -> None:
        """``position_ids`` must be the positions (within their documents) of the global
        tokens the plan gives this rank: a batch sharded with another layout than the
        attention's would mask the wrong keys without an error."""
        plan = self.plan
        assert plan is not None
        local = position_ids.detach().cpu().numpy().reshape(-1, position_ids.shape[-1])
        seq_len = local.shape[1] * plan.cp
        check_seq_len(seq_len, plan.cp, plan.load_balance, "parallelize: the model's inputs")
        held = shard_positions(seq_len, plan.cp, plan.cp_index, plan.load_balance)
        expected = held
        if cu is not None:
            cu_np = np.asarray(_host(cu), dtype=np.int64).reshape(-1)
            expected = held - cu_np[np.searchsorted(cu_np, held, side="right") - 1]
        if not all(np.array_equal(row, expected) for row in local):
            raise ValueError(f"parallelize: position_ids on context-parallel rank {plan.cp_index} are "
                             f"{local[0][:8].tolist()}..., not the positions {expected[:8].tolist()}... of the tokens "
                             f"ContextParallel(load_balance={plan.load_balance}) assigns it; shard the batch with "
                             f"shard_batch(batch, mesh, load_balance={plan.load_balance}) (the same load_balance as "
                             "parallelize)")


def parallelize(model: Any, mesh: DeviceMesh, *, cp_mode: str = "ring", load_balance: bool = True,
                ulysses_degree: int | None = None, activation_checkpointing: bool = False,
                cp_mesh: DeviceMesh | None = None) -> Any:
    """Parallelize an HF causal LM in place over ``mesh`` and return it; build the
    optimizer after (fully_shard replaces the parameters).

    The chain, in the main job's order (``hyper_parallel.train.parallelize``):

    1. tensor parallelism over ``mesh["tp"]`` from ``tensor_parallel_plan(model)``: q/k/v
       and the MLP input projections column-parallel (whole heads per rank), the output
       projections row-parallel (one all-reduce per sublayer, forward and backward);
    2. context parallelism over ``mesh["cp"]``: every attention layer gets a
       ``CoreAttention`` hooked with ``ContextParallel`` (``cp_mode``: ring attention,
       one K/V all-gather, or Ulysses all-to-all; ``ulysses_degree`` between 1 and ``cp``
       for the hybrid 2-D mode), and the model's ``attn_implementation`` becomes
       ``"hyper_parallel"``;
    3. activation checkpointing of every decoder layer (``activation_checkpointing``);
    4. fully_shard of every decoder layer, then the root, over ``dp_shard`` (x ``cp``,
       over which the parameters are replicated), HSDP with ``dp_replicate``.

    Args:
        model: a ``transformers`` model (``PreTrainedModel``) whose attention layers call
            HF's attention interface; the same weights on every rank.
        mesh: over the whole world, axes named from ``("dp_replicate", "dp_shard", "cp",
            "tp")`` (any subset; put ``cp`` right after ``dp_shard`` for HSDP with cp).
        cp_mode: ``"ring"``, ``"allgather"`` or ``"ulysses"``.
        load_balance: the head-tail sequence layout (ring and allgather; Ulysses is
            balanced already and ignores it). Pass the same value to ``shard_batch``.
        ulysses_degree: with ``"ring"``/``"allgather"``, the ranks of an inner Ulysses
            all-to-all (hybrid; needs the ``cp`` axis to be the whole world).
        activation_checkpointing: recompute each decoder layer in the backward.
        cp_mesh: the mesh of the attention hooks, when not ``mesh["cp"]``: the 2-D
            ``(exchange, ulysses)`` mesh of the hybrid mode over the same ranks (as the
            main job's ``context_parallel_mesh`` builds it); ``shard_batch`` must then cut
            the batch over it too (ranks in row-major order, as over ``mesh["cp"]``).

    Returns:
        ``model``, whose forward takes the batches ``shard_batch`` makes.

    Collectives: broadcasts of the tensor-parallel parameters from the tp axis's first
    rank, group creation for the fully_shard mesh.

    Raises:
        ValueError: a mesh axis outside those names, a ``cp_mode`` or ``ulysses_degree``
            that does not fit, heads not divisible by ``tp``, a TP plan entry with no
            counterpart, no decoder-layer class (all before any collective).
    """
    deg = _degrees(mesh, "parallelize")
    if cp_mode not in CP_MODES:
        raise ValueError(f"parallelize: cp_mode={cp_mode!r}; use one of {CP_MODES}")
    if ulysses_degree is not None and (cp_mode == "ulysses" or deg["cp"] % ulysses_degree):
        raise ValueError(f"parallelize: ulysses_degree={ulysses_degree} (hybrid) needs cp_mode 'ring' or "
                         f"'allgather' and must divide cp={deg['cp']}")
    styles = tensor_parallel_plan(model) if deg["tp"] > 1 else {}
    if deg["tp"] > 1:
        _check_heads(model, deg["tp"])
    use_attention(model)
    cp_style = None
    if deg["cp"] > 1:
        cp_style = make_context_parallel(cp_mode, load_balance and cp_mode != "ulysses", ulysses_degree)
    plan = apply_layout(model, model, mesh, tp_plan=styles, cp_style=cp_style, cp_mesh=cp_mesh,
                        activation_checkpointing=activation_checkpointing)
    # prepend: the checks run before fully_shard's root all-gather
    model.register_forward_pre_hook(_RootInputs(plan), with_kwargs=True, prepend=True)
    return model


def use_attention(model: Any) -> None:
    """Switch ``model`` (and its sub-configs: a text config inside a multimodal one) to
    ``attn_implementation="hyper_parallel"`` (``register_attention`` first)."""
    register_attention()
    model.config._attn_implementation = ATTN_IMPLEMENTATION  # noqa: SLF001 - HF's documented switch
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTN_IMPLEMENTATION  # noqa: SLF001


def apply_layout(module: Any, model: Any, mesh: DeviceMesh, *, tp_plan: dict[str, ParallelStyle],
                 cp_style: ContextParallel | None, cp_mesh: DeviceMesh | None,
                 activation_checkpointing: bool) -> Plan | None:
    """Steps 1-4 of ``parallelize`` on ``module``: the whole ``model``, or a pipeline stage
    module holding some of its layers (the main job's ``--pp``), whose names the plan's
    patterns are matched against (entries that match nothing in it are skipped).

    Args:
        tp_plan: ``{pattern: style}`` over ``module``'s names (``{}``: no tensor parallelism).
        cp_style: the attention layers' ``ContextParallel`` (``None``: no context parallelism).
        cp_mesh: its mesh (default ``mesh["cp"]``).

    Returns:
        The context-parallel plan (``None`` without ``cp_style``).

    Collectives: the TP parameters' broadcasts; group creation for the fully_shard mesh.
    """
    import fnmatch

    deg = _degrees(mesh, "parallelize", pipelined=module is not model)
    names = [name for name, _ in module.named_modules() if name]
    present = {k: v for k, v in tp_plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
    if present:
        parallelize_module(module, mesh["tp"], present)
    plan = None
    if cp_style is not None:
        cp_mesh = mesh["cp"] if cp_mesh is None else cp_mesh
        plan = cp_style.resolve(cp_mesh)  # the same for every layer: resolved once for the cores to read
        for layer in _attention_layers(module):
            core = CoreAttention()
            setattr(layer, CORE_ATTR, core)
            cp_style.apply(core, cp_mesh)
            core.plan = plan
    layers = decoder_layers(model, within=module)
    if activation_checkpointing:
        for layer in layers:
            checkpoint_wrapper(layer)
    if deg["dp_replicate"] * deg["dp_shard"] * deg["cp"] > 1:
        fsdp_mesh = _fully_shard_mesh(mesh, deg)
        for layer in layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(module, mesh=fsdp_mesh)
    return plan


# -- batches ----------------------------------------------------------------------------
def shard_batch(batch: Mapping[str, Any], mesh: DeviceMesh, *, load_balance: bool = True,
                ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    """This rank's part of a batch, for a model ``parallelize`` prepared over ``mesh``.

    Each data-parallel rank passes its own batch (the ranks of a ``cp`` or ``tp`` group
    the same one). The labels are shifted over the whole sequence first (HF's
    ``shift_labels``: position ``i`` predicts token ``i + 1``), so no target is lost at a
    chunk edge, then every sequence tensor is cut for the ``cp`` axis in the layout of
    ``ContextParallel`` (``context_parallel_shard``; head-tail with ``load_balance``).
    Packed documents (``position_ids`` restarting) become ``cu_seq_lens_q``/``_k`` of the
    whole sequence. ``num_items_in_batch`` makes HF's loss ``sum / (N / R)`` on each rank
    (``N`` target tokens over every data-parallel rank, ``R = dp_replicate x dp_shard x
    cp`` ranks whose gradients fully_shard averages), so the averaged gradient is that of
    the mean over all ``N`` targets, as in one process; the mean of the ranks' losses over
    those ``R`` ranks is the global loss.

    Args:
        batch: ``input_ids`` ``[batch, seq]`` (required); ``labels``, ``position_ids``
            (``[batch or 1, seq]``, default ``0 .. seq - 1``), ``attention_mask`` (all
            ones) optional; other entries are passed through.
        mesh: the mesh given to ``parallelize``.
        load_balance: the value given to ``parallelize`` (``False`` for Ulysses).
        ignore_index: the label that is not a target.

    Returns:
        A new dict: ``input_ids``, ``position_ids``, and with labels ``labels`` and
        ``shift_labels`` (both the shifted labels) and ``num_items_in_batch`` (a float
        tensor); ``cu_seq_lens_q``/``cu_seq_lens_k`` for packed documents; every sequence
        tensor ``[batch, seq / cp]``.

    Collective: with labels, one all-reduce of a scalar over the world (the target count).

    Raises:
        ValueError: a sequence not divisible for the layout, padding, no target token
            anywhere (every rank alike), a mesh ``parallelize`` does not take.
    """
    deg = _degrees(mesh, "shard_batch")
    if "input_ids" not in batch:
        raise ValueError(f"shard_batch: the batch needs input_ids [batch, seq]; got keys {sorted(batch)}")
    out = dict(batch)
    ids = batch["input_ids"]
    seq_len = int(ids.shape[1])
    if deg["cp"] > 1:
        check_seq_len(seq_len, deg["cp"], load_balance, "shard_batch")
    if out.get("attention_mask") is not None:
        _check_no_padding(out.pop("attention_mask"), "shard_batch")
    position_ids = out.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=ids.device).unsqueeze(0)
    if _cu_seqlens(out, "shard_batch") is None:
        docs = documents_from_position_ids(position_ids)
        if docs is not None:
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = torch.from_numpy(docs)
    sequences = {"input_ids": ids, "position_ids": position_ids.expand(ids.shape[0], -1)}
    labels = batch.get("labels")
    if labels is not None:
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
        p = get_platform()
        count = (shifted != ignore_index).sum().to(torch.float64).reshape(1)
        # every rank of a cp/tp group counted the same batch: divide those copies out
        total = float(p.to_numpy(p.all_reduce(count, "sum").wait())[0]) * deg["dp_replicate"] * deg["dp_shard"]
        targets = total / mesh.size()
        if targets == 0:
            raise ValueError("shard_batch: no label differs from ignore_index on any rank: there is nothing to train "
                             "on; check the labels")
        ranks = deg["dp_replicate"] * deg["dp_shard"] * deg["cp"]
        out["num_items_in_batch"] = torch.tensor(targets / ranks, dtype=torch.float64)
        sequences["labels"] = shifted
    if deg["cp"] > 1:
        names = list(sequences)
        parts = context_parallel_shard([sequences[n] for n in names], [1] * len(names), mesh["cp"],
                                       load_balance=load_balance)
        sequences = dict(zip(names, parts))
    out.update(sequences)
    if labels is not None:
        out["shift_labels"] = out["labels"]
    return out
