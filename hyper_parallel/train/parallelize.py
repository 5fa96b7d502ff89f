"""The parallel layout of the decoder: one ``DeviceMesh`` for the run and an ordered chain
of ``apply_*`` steps, each given its own submesh (torchtitan's ``parallelize_llama``).

Order of the chain, and why:

1. tensor parallelism (``mesh["tp"]``): it rewrites the linear layers' parameters into
   shards, which every later step must see as they will be trained; then expert
   parallelism (``--ep``, over ``ep`` ranks of the ``dp_shard`` axis): the MoE blocks' routed
   experts become shards too, which fully_shard shards over the rest of ``dp_shard``
   (``expert_parallel_meshes``) or leaves alone (``ep == dp_shard``);
2. context parallelism (``mesh["cp"]``): it wraps attention, which now runs on
   ``heads / tp`` local heads;
3. activation checkpointing: it wraps whole blocks, after the layers inside them are final;
4. fully_shard (``mesh["dp_replicate", "dp_shard"]``, HSDP when both > 1): last, because
   it shards whatever parameters the previous steps left, block by block.

With tensor parallelism, fully_shard runs over the data-parallel submesh and shards each
rank's tensor-parallel shards again (FSDP2's 2-D composition, see docs/fully_shard.md).
With pipeline parallelism (``mesh["pp"]``) the decoder is first cut into stages
(``train/pipeline.py``), and steps 1 to 4 run on each stage module, each over the
submesh of the stage's pipeline coordinate. Step 3 (``--activation-checkpointing``)
checkpoints each decoder block in place (``core/activation_checkpoint``), so fully_shard's
block units are the checkpointed blocks and their gathers and reduce-scatters run around
the recomputation; with ``--pp`` it runs on each stage module too, between CP and
fully_shard, and each microbatch's backward recomputes the stage's blocks.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import numpy as np

from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
from hyper_parallel.core.context_parallel import ContextParallel
from hyper_parallel.core.dtensor import DeviceMesh, Shard, distribute_parameter, init_device_mesh
from hyper_parallel.core.expert_parallel import MoE as ExpertParallelMoE
from hyper_parallel.core.fully_shard import MixedPrecisionPolicy, fully_shard
from hyper_parallel.core.tensor_parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                 parallelize_module)
from hyper_parallel.platform import Platform, get_platform
from hyper_parallel.train.config import Layout
from hyper_parallel.train.moe_model import moe_layers
from hyper_parallel.train.precision import apply_mixed_precision

#: Megatron tensor parallelism of the decoder: q/k/v and the SwiGLU input projections split
#: by output features (whole heads per rank), the output projections by input features,
#: so each block needs one all-reduce in forward and one in backward per sublayer.
#: Embedding, norms and the output head stay replicated. In a mixture-of-experts block
#: (``moe_model``) the shared expert splits like the dense MLP; the router and the routed
#: experts stay replicated over ``tp`` (each TP rank routes the same whole tokens and runs
#: every expert on them: the experts' gradients are the same on every TP rank, with no
#: collective), and fully_shard shards them over the data-parallel ranks like the rest.
#: The per-head query/key norms (``--hf-config`` of a Qwen3-MoE) are replicated and norm
#: each rank's own heads: their gradients are all-reduced over ``tp``, as a
#: sequence-parallel norm's ([Note: per-head query/key norms] in ``model.py``).
TP_PLAN = {
    "layers.*.attention.w[qkv]": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.attention.[qk]_norm": SequenceParallel(),
    "layers.*.feed_forward.w[13]": ColwiseParallel(),
    "layers.*.feed_forward.w2": RowwiseParallel(),
    "layers.*.moe.shared_expert.w[13]": ColwiseParallel(),
    "layers.*.moe.shared_expert.w2": RowwiseParallel(),
}


def build_mesh(p: Platform, layout: Layout) -> DeviceMesh | None:
    """The run's mesh with axes ``pp, dp_replicate, dp_shard, cp, tp`` (``None`` for a
    single-rank layout, which uses no collectives). Collective: creates one group per axis.

    Raises:
        ValueError: the world size is not the layout's.
    """
    if layout.world_size == 1:
        return None
    if p.world_size() != layout.world_size:
        raise ValueError(f"the layout {layout.describe()} needs {layout.world_size} ranks but the world has "
                         f"{p.world_size()}; launch as many ranks as the product of the degrees")
    degrees = layout.degrees()
    return init_device_mesh(p.device_type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))


def tp_plan(model: Any) -> dict[str, Any]:
    """The entries of ``TP_PLAN`` that match a module of ``model``: a decoder whose blocks
    are all MoE has no dense MLP, one without shared experts no shared expert
    (``parallelize_module`` refuses an entry that matches nothing, which catches typos)."""
    names = [name for name, _ in get_platform().named_modules(model) if name]
    return {pattern: style for pattern, style in TP_PLAN.items()
            if any(fnmatch.fnmatchcase(name, pattern) for name in names)}


def apply_tensor_parallel(model: Any, tp_mesh: DeviceMesh) -> None:
    """Shard the decoder's linear layers over ``tp_mesh`` (1-D) with ``TP_PLAN``
    (``tp_plan``). Collective: broadcasts each sharded parameter from the mesh's rank 0."""
    parallelize_module(model, tp_mesh, tp_plan(model))


def context_parallel_style(layout: Layout) -> ContextParallel:
    """The ``ContextParallel`` of ``--cp-mode``: ``ulysses`` all-to-alls heads for sequence
    over all of ``cp`` (DeepSpeed-Ulysses); ``ring`` and ``allgather`` keep the heads and
    exchange K/V (ring attention, Liu et al. 2023; or one all-gather), with the head-tail
    load-balanced sequence layout that evens out causal work; ``hybrid`` (USP, Fang & Zhao
    2024) all-to-alls over ``ulysses_degree`` ranks, then exchanges K/V
    (``cp_kv_exchange``) over the other ``cp / ulysses_degree``, load-balanced like ring."""
    if layout.cp_mode == "ulysses":
        return ContextParallel(ulysses_degree=None)
    if layout.cp_mode == "hybrid":
        return ContextParallel(ulysses_degree=layout.ulysses_degree, kv_exchange=layout.cp_kv_exchange,
                               load_balance=True)
    return ContextParallel(ulysses_degree=1, kv_exchange=layout.cp_mode, load_balance=True)


def context_parallel_mesh(mesh: DeviceMesh | None, layout: Layout) -> DeviceMesh | None:
    """The mesh the attention hooks and the loader's ``context_parallel_shard`` share
    (``None`` when ``cp == 1``): ``mesh["cp"]``, or for ``--cp-mode hybrid`` the 2-D
    ``(cp_kv, cp_ulysses)`` submesh of a second mesh over the same ranks with the cp axis
    split row-major into ``(cp / ulysses_degree, ulysses_degree)``: Ulysses on the inner
    (closest) ranks, and each rank's flattened index in it is its ``cp`` coordinate, so the
    sequence shards are those of the 1-D layout. Collective when it builds a mesh (groups)."""
    if mesh is None or layout.cp == 1:
        return None
    if layout.cp_mode != "hybrid":
        return mesh["cp"]
    u = layout.ulysses_degree
    assert u is not None, "TrainConfig derives --ulysses-degree for --cp-mode hybrid"
    split = init_device_mesh(mesh.device_type, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp // u, u,
                                                layout.tp),
                             mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp_kv", "cp_ulysses", "tp"))
    return split["cp_kv", "cp_ulysses"]


def apply_context_parallel(model: Any, cp_mesh: DeviceMesh, layout: Layout) -> None:
    """Hook every block's parameter-free core attention (``[batch, seq / cp, heads,
    head_dim]`` q/k/v) with ``context_parallel_style(layout)`` over ``cp_mesh``
    (``context_parallel_mesh``: 1-D, or 2-D ``(cp_kv, cp_ulysses)`` for hybrid).
    Collectives: none here; each forward exchanges K/V (or all-to-alls heads)."""
    style = context_parallel_style(layout)
    # a pipeline stage keys its blocks by their index in the decoder (model.build_stage)
    blocks = model.layers.values() if hasattr(model.layers, "values") else model.layers
    for block in blocks:
        parallelize_module(block.attention.core, cp_mesh, style)


def expert_parallel_meshes(mesh: DeviceMesh, layout: Layout) -> tuple[DeviceMesh, DeviceMesh | None]:
    """``(ep_mesh, experts_fsdp_mesh)`` of ``--ep``: the ``dp_shard`` axis split row-major
    into ``(dp_shard / ep, ep)`` (a second mesh over the same ranks, ``ep`` on the inner,
    closest ranks, as torchtitan borrows it), so that each rank's ``dp_shard`` coordinate
    is ``outer * ep + inner`` and its data share is unchanged. The routed experts are
    sharded over ``ep`` and fully_shard'ed over every other rank that holds the same
    experts and sees other tokens: the outer ``dp_shard / ep`` ranks and, with ``--cp``,
    the context-parallel ranks (the other parts of the same sequences), merged into one
    shard axis ``experts_shard`` so that the experts' gradients are averaged over ``dp_shard
    x cp`` like every other parameter's; with ``--dp-replicate`` on the 2-D
    ``(dp_replicate, experts_shard)`` mesh (HSDP: the replicas all-reduce the experts'
    gradients). ``None`` when ``ep == dp_shard`` without replicas or ``--cp`` (no other
    rank holds the same experts). With ``--tp`` both are per tensor-parallel coordinate.
    Collective: builds the groups."""
    if layout.ep == layout.dp_shard and layout.dp_replicate == 1 and layout.cp == 1:
        return mesh["dp_shard"], None
    outer = layout.dp_shard // layout.ep
    ranks = np.arange(layout.world_size).reshape(layout.pp, layout.dp_replicate, outer, layout.ep, layout.cp,
                                                 layout.tp)
    # the outer dp_shard and cp axes are not adjacent in the job's row-major order (ep lies
    # between): move them last and merge them into one axis of their ranks
    ranks = ranks.transpose(0, 1, 3, 5, 2, 4).reshape(layout.pp, layout.dp_replicate, layout.ep, layout.tp,
                                                      outer * layout.cp)
    split = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "dp_replicate", "ep", "tp", "experts_shard"))
    if layout.dp_replicate > 1:  # HSDP for the experts too: replicas all-reduce their gradients
        return split["ep"], split["dp_replicate", "experts_shard"]
    return split["ep"], split["experts_shard"]


def apply_expert_parallel(model: Any, ep_mesh: DeviceMesh) -> list[Any]:
    """Shard every MoE block's routed experts (``w1``/``w2``/``w3``, ``[experts, ...]``) on
    dim 0 over ``ep_mesh`` (1-D, ``expert_parallel_meshes``), ``experts / ep`` whole
    experts per rank, and hand the block core's ``MoE`` over the mesh's group for dispatch
    and combine; returns the expert parameters ([Note: expert-parallel gradients] in
    ``moe_model``). Collective: broadcasts each expert parameter from the mesh's rank 0
    (``distribute_parameter``)."""
    p = get_platform()
    placed = []
    for _, layer in moe_layers(p, model):
        for name in ("w1", "w2", "w3"):
            placed.append(distribute_parameter(layer.experts, name, ep_mesh, [Shard(0)]))
        layer.expert_parallel = ExpertParallelMoE(layer.num_experts, layer.top_k, group=ep_mesh.get_group())
        layer.ep_grad_scale = 1.0 / ep_mesh.size()
    return placed


def apply_activation_checkpointing(model: Any) -> None:
    """Checkpoint every decoder block in place (``checkpoint_wrapper``): a block keeps only
    its input ``[batch, seq / cp, dim]`` (and the rotary tables it is handed) for the
    backward, which runs the block's forward again, tensor- and context-parallel hooks
    and their collectives included, before its gradients. Collectives: none here."""
    blocks = model.layers.values() if hasattr(model.layers, "values") else model.layers
    for block in blocks:
        checkpoint_wrapper(block)


def fully_shard_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh fully_shard shards over: 1-D ``dp_shard`` when there is no replication,
    else the 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP). With ``tp > 1`` it is a submesh
    (one per tensor-parallel coordinate), over which fully_shard shards the TP-local
    parameters. With ``cp > 1``: the ``(dp_shard, cp)`` axes flattened into one shard axis,
    so that the gradients of the parameters, replicated over ``cp``, are averaged over the
    cp ranks too (``(dp_replicate, dp_shard x cp)`` for HSDP: a second mesh over the same
    ranks with the two axes merged, as row-major order keeps them adjacent; one submesh
    per tensor-parallel coordinate with ``tp > 1``). Collective when it builds a group."""
    if layout.cp > 1 and layout.dp_replicate > 1:
        merged = init_device_mesh(mesh.device_type, (layout.pp, layout.dp_replicate, layout.dp_shard * layout.cp,
                                                     layout.tp),
                                  mesh_dim_names=("pp", "dp_replicate", "dp_shard_cp", "tp"))
        return merged["dp_replicate", "dp_shard_cp"]
    if layout.cp > 1:
        return mesh["dp_shard", "cp"].flatten("dp_shard_cp")
    if layout.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def apply_fully_shard(model: Any, fsdp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
                      ignored_params: list[Any] | None = None, experts_mesh: DeviceMesh | None = None, *,
                      cast_root_inputs: bool = True) -> None:
    """FSDP2 order: each decoder block is a unit (its parameters all-gathered around its
    forward and backward, gradients reduce-scattered), then the root takes the rest
    (embedding, final norm, output head; a tied head shares the root unit with the
    embedding). Every rank holds the same initial weights (``build_model`` seeds them), as
    fully_shard requires. Collectives: none here; the all-gathers / reduce-scatters run in
    each step. ``mp_policy``: ``--dtype``'s (``precision.mixed_precision_policy``; ``None``:
    float32 throughout). ``ignored_params``: left as they are, unsharded and unreduced (the
    expert-parallel experts when ``ep == dp_shard``: ``apply_expert_parallel``);
    ``experts_mesh``: with ``ep < dp_shard``, each MoE block's experts are a unit over it
    first (``expert_parallel_meshes``), their gradients reduce-scattered over those ranks.
    ``cast_root_inputs=False``: the root unit leaves its inputs as they come (a pipeline
    stage's: the positions cross a stage boundary as float32, exact there, and a bfloat16
    cast would round them above 256; its residual stream arrives in the compute dtype
    already), the blocks still cast theirs."""
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if experts_mesh is not None:  # bottom-up: the experts are their own units, which the blocks' skip
        for _, layer in moe_layers(get_platform(), model):
            fully_shard(layer.experts, mesh=experts_mesh, mp_policy=policy)
    # a pipeline stage keys its blocks by their index in the decoder (model.build_stage)
    blocks = model.layers.values() if hasattr(model.layers, "values") else model.layers
    for block in blocks:
        fully_shard(block, mesh=fsdp_mesh, mp_policy=policy, ignored_params=ignored_params)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy if cast_root_inputs else
                dataclasses.replace(policy, cast_forward_inputs=False), ignored_params=ignored_params)


def parallelize(model: Any, mesh: DeviceMesh | None, layout: Layout, cp_mesh: DeviceMesh | None = None,
                activation_checkpointing: bool = False, mp_policy: MixedPrecisionPolicy | None = None) -> Any:
    """Apply the layout chain (see the module doc) to ``model`` in place and return it.
    Build the optimizer (and take ``named_parameters``) after: fully_shard replaces the
    parameters by their shards. ``cp_mesh``: ``context_parallel_mesh(mesh, layout)`` when
    the caller built it already (it must shard the data over the same mesh); else built here.
    ``activation_checkpointing``: step 3, also on a single rank (``mesh`` ``None``).
    ``mp_policy``: ``--dtype``'s mixed precision (``None``: float32), given to fully_shard,
    or hooked by ``precision.apply_mixed_precision`` where there is none (last, as
    fully_shard: [Note: the job's mixed precision])."""
    if mesh is None:
        if activation_checkpointing:
            apply_activation_checkpointing(model)
        if mp_policy is not None:
            apply_mixed_precision(get_platform(), model, mp_policy)
        return model
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    experts, experts_mesh = None, None
    if layout.ep > 1:
        ep_mesh, experts_mesh = expert_parallel_meshes(mesh, layout)
        placed = apply_expert_parallel(model, ep_mesh)
        experts = placed if experts_mesh is None else None
    if layout.cp > 1:
        apply_context_parallel(model, cp_mesh if cp_mesh is not None else context_parallel_mesh(mesh, layout), layout)
    if activation_checkpointing:  # after TP and CP: their hooks sit inside the blocks and run again
        apply_activation_checkpointing(model)
    if layout.dp * layout.cp > 1:
        apply_fully_shard(model, fully_shard_mesh(mesh, layout), mp_policy, ignored_params=experts,
                          experts_mesh=experts_mesh)
    elif mp_policy is not None:
        apply_mixed_precision(get_platform(), model, mp_policy)
    return model


def data_parallel_coordinate(mesh: DeviceMesh | None) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: this rank's index among the ranks that take different
    samples (``dp_replicate x dp_shard``), and their number."""
    if mesh is None:
        return 0, 1
    replicate, shard = mesh.size("dp_replicate"), mesh.size("dp_shard")
    return mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard"), replicate * shard
