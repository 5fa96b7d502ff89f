"""Pipeline parallelism in ``hyper-parallel train`` (``--pp``, ``--pp-schedule``,
``--microbatches``): the decoder cut into stages, each stage parallelized over the other
axes of its pipeline coordinate, a schedule of ``hyper_parallel.core.pipeline_parallel``
running them (the core's schedule table names each ``--pp-schedule``'s class, placement
and stages per rank), and the schedule's forward-only step (``PipelineSchedule.eval``)
for the validation loss.

[Note: pipeline stages and the other axes]
The mesh is ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first), so the ranks of one
pipeline coordinate form a full ``dp_replicate x dp_shard x cp x tp`` mesh, and every stage
module goes through the chain of ``parallelize.py`` on the submeshes of its coordinate:
tensor parallelism over ``mesh["tp"]`` (``TP_PLAN``: the stage's blocks; its embedding,
norm and head stay replicated), context parallelism on each of its blocks' core attention
over the loader's ``cp_mesh`` (1-D, or the 2-D ``(cp_kv, cp_ulysses)`` mesh of the hybrid
mode), then fully_shard over ``fully_shard_mesh``: the ``dp_shard`` axis (merged with
``cp``, whose ranks hold replicated parameters and different tokens), and HSDP on
``(dp_replicate, that)`` with ``--dp-replicate``. The tensors crossing a stage
boundary are plain local tensors: the residual stream ``[microbatch, seq / cp, dim]``
(replicated over tp: the row-parallel projections end in an all-reduce) and the positions
``[microbatch, seq / cp]`` (the load-balanced positions this cp rank holds, so the next
stage indexes the rotary tables with them). Pipeline rank ``r`` sends to rank ``r + 1``
of the same ``(dp_replicate, dp_shard, cp, tp)`` coordinate: the pp group of each
coordinate is its own, and its ranks hold the same shard of the batch and of the heads.
The collectives of one stage (TP all-reduces, CP exchanges, fully_shard's all-gathers and
reduce-scatters) run among ranks of one pipeline coordinate, which all run the same
action list, so they are issued in the same order on every rank of each group (also the
collectives of a forward that MindSpore recomputes for an out-of-order backward, see
below).

[Note: pipeline gradients and loss]
The step's local batch (``batch / dp`` sequences) is cut into ``--microbatches`` equal
microbatches. The last stage's loss of a microbatch is the mean cross-entropy over its
tokens, and the schedule scales each microbatch's loss gradient by ``1 / microbatches``
(``scale_grads``), so the sum over microbatches is the gradient of the mean over this
rank's tokens, the loss of the unpipelined model (with ``--cp``: of its sequence shards,
equal token counts on every cp rank). With ``--dp-shard`` (or ``--cp``, ``--dp-replicate``)
every stage module is fully_sharded (each block, then the stage's root) over the
data-parallel submesh of its pipeline coordinate: each microbatch's backward
reduce-scatters (averages) its gradient over the data-parallel ranks, and the stage adds
the microbatches' shards. That is one
reduce-scatter per microbatch and unit under GPipe and 1F1B; schedules with split or
paired backwards (the zero-bubble ones, ``--ep-overlap``) accumulate the full gradients and
reduce-scatter once per step instead ([Note: one reduction per step] in
``core/pipeline_parallel/gradient_sync.py``); the values are the same sums in another
order. All data-parallel ranks of one pipeline coordinate run the same action list, so
their all-gathers and reduce-scatters are issued in the same order, also where MindSpore
recomputes a forward for an out-of-order backward (``[Note: out-of-order backwards]`` in
``platform/mindspore/autograd.py``: the recomputed forward's all-gathers run on every
data-parallel rank of the stage, in the schedule's order).

The reported loss is the mean of the last stage's microbatch losses, averaged over the
last stage's ranks and handed to every rank by one all-reduce over the world. The
validation loss is computed the same way from ``schedule.eval``, the schedule's forwards in
its order without recording (the same sends and receives of activations as the step's).

[Note: MoE stages]
A mixture-of-experts decoder (``--moe-experts``) is cut like the dense one: each stage holds
its blocks' MoE sublayers, under the decoder's names (``layers.{i}.moe``). With ``--ep``
each stage's routed experts are sharded over the expert-parallel ranks of its pipeline
coordinate (``parallelize.expert_parallel_meshes``: the ``dp_shard`` axis of that
coordinate), between TP and CP as in ``parallelize``; the experts are fully_shard'ed over
the rest of ``dp_shard`` or left out of it (``ep == dp_shard``), and a microbatch's dispatch
and combine all-to-alls run among the ranks of one coordinate, which run the same action
list, so every rank of an expert-parallel group issues them in the same order (also those
of a forward that MindSpore reruns inside an out-of-order backward). The routing counts
are taken in each microbatch's training forward, not in such a rerun ([Note: forwards
inside a stage's backward] in ``core/pipeline_parallel/runtime.py``), and summed after the
step over the data-parallel ranks of every pipeline coordinate (``moe_model.balance_step``,
one all-reduce over ``pp x dp x cp``), so each stage moves its own layers' aux-free biases
by the single process's integers, and every rank reports the stats of all the layers.
``--moe-balance aux-loss`` is refused with ``--pp`` (``TrainConfig``): an earlier stage's
balance loss does not reach the last stage's loss.

[Note: the overlap in the job]
``--ep-overlap`` (with ``--ep`` >= 2 and ``--pp-schedule 1f1b | interleaved-1f1b | dualpipev``: ``TrainConfig``)
builds the schedule with ``overlap_b_f=True``: each steady-state backward is paired with the
next forward (``OVERLAP_B_F``), and ``CommComputeOverlap.run`` runs the two on two threads.
Every MoE layer of a stage calls its expert-parallel dispatch and combine through the
overlap's ``wrap_dispatch`` / ``wrap_combine`` (the stage's last MoE layer with
``is_last_layer``), so the threads meet at the ``A``/``B``/``C``/``D`` hooks ([Note: A/B/C/D
rendezvous] in ``core/pipeline_parallel/hook_coordinator.py``): the dispatch or combine
all-to-all of one microbatch is issued, then the other's expert or attention compute runs
while it is in flight. Two rules keep every rank's collectives in one order, which the
fully_shard units of a stage (one group for their all-gathers, the expert-parallel group
inside it) need:

- the coordinator holds the forward's tail ([Note: serial tails]): each segment of the
  two threads runs alone, in the same order on every rank;
- no reduce-scatter is issued inside a pair: the runtime turns fully_shard's gradient
  sync off for the step and each unit reduce-scatters its summed gradient once, after
  the stage's last backward work ([Note: one reduction per step] in
  ``core/pipeline_parallel/gradient_sync.py``).

``--pp-schedule dualpipev`` brings its own pairs (a forward of one V chunk with a backward
of the other) and split backwards in its warm-up and drain: its ``W`` hands the deferred
weight gradients of the fully_shard'ed linear layers to their units, which reduce them
with the rest ([Note: zero-bubble schedules in train]).

The values are the run without ``--ep-overlap``'s, up to float32 summation order: the
per-microbatch reduce-scatters of that run become one reduce-scatter of the summed
gradient here (the microbatches' routing, losses and everything else are computed by the
same operations on the same tensors). A stage with no MoE block has no hooks: its
pair runs one after the other (the forward waits for the backward to finish).

[Note: zero-bubble schedules in train]
``--pp-schedule zbh1`` runs ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024; ``ScheduleInterleavedZeroBubble`` with one stage per rank, the loop placement of the
other one-stage schedules): each backward is split into ``I`` (input gradients, which the
previous stage waits for) and a deferred ``W`` (the weight gradients), and the stages'
linear layers get the weight-gradient split of ``core/pipeline_parallel/weight_grad.py``
(their ``W`` runs the stored ``grad_y^T @ x`` matmuls). ``--pp-schedule zbv`` runs ZB-V
(``ScheduleZBVZeroBubble``, same paper): ``2 pp`` stages in the V placement, rank ``r``
building stages ``r`` and ``2 pp - 1 - r`` (the schedule gives its stages the V placement:
[Note: stage placement] in ``core/pipeline_parallel/stage.py``), so the last stage's
backward starts on the rank that ran stage 0. ``interleaved-zero-bubble`` runs ZB-H1 on two
loop-placed stages per rank, ``dualpipev`` DualPipeV (``ScheduleDualPipeV``, V-placed like ZB-V;
its forward/backward pairs run on two threads, which meet at no hook in a dense model, so
each pair runs one after the other; with ``--ep-overlap`` an MoE model's dispatch and
combine hook them: [Note: the overlap in the job]). Checkpoints are placement-free (each rank saves its
stages' parameters under the decoder's names), so a ZB-V run resumes like any other. Under
tensor parallelism the split
layers are the TP-hooked projections, whose weights are the local shards, so ``W`` lands
local gradients. With fully_shard (``--dp-shard``, ``--dp-replicate``, ``--cp``) a split
layer computes with the gathered weight, whose gradient fully_shard reduce-scatters in
the backward of its gather, which ``I`` runs before ``W`` computed it: ``W`` hands it to
the layer's unit instead, the runtime keeps gradient sync off for the step, and each unit
reduce-scatters its summed gradient once, after its stage's last ``W`` ([Note: one
reduction per step] in ``core/pipeline_parallel/gradient_sync.py``; torch's pipelining
drives FSDP2 the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor import DeviceMesh
from hyper_parallel.core.fully_shard import MixedPrecisionPolicy
from hyper_parallel.core.pipeline_parallel import (SCHEDULES, CommComputeOverlap, HookCoordinator, PipelineSchedule,
                                                   PipelineStage)
from hyper_parallel.platform import Platform
from hyper_parallel.train.config import TrainConfig
from hyper_parallel.train.model import build_stage, cross_entropy, stage_layers
from hyper_parallel.train.moe_model import moe_layers
from hyper_parallel.train.optim import local_tensor
from hyper_parallel.train.precision import apply_mixed_precision
from hyper_parallel.train.parallelize import (apply_activation_checkpointing, apply_context_parallel,
                                              apply_expert_parallel, apply_fully_shard, apply_tensor_parallel,
                                              expert_parallel_meshes, fully_shard_mesh)


@dataclass
class Pipeline:
    """What one rank holds of the pipeline."""

    p: Platform
    modules: list[Any]          # this rank's stage modules, in stage order
    stages: list[PipelineStage]  # their PipelineStages
    indices: list[int]          # their stage indices
    num_stages: int
    schedule: PipelineSchedule
    group: Any                  # the pipeline process group (this rank's pp axis)
    rank: int                   # this rank's pipeline coordinate (group rank)
    size: int                   # pipeline degree
    placement: str = "loop"     # the schedule's: "loop" (stage s on rank s % size) or "v" (zbv, dualpipev)
    # what the last stage's loss_fn multiplies each microbatch's loss by, so the schedule
    # seeds the backward with it (--dtype fp16: [Note: dynamic loss scaling]); train_step
    # sets it for its step and reports the unscaled mean
    loss_scale: float = 1.0
    overlap: bool = False       # --ep-overlap: [Note: the overlap in the job]

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def parameters(self) -> list[Any]:
        """This rank's parameters: its stages' (sharded when fully_sharded), in stage order."""
        return [param for module in self.modules for _, param in self.p.named_parameters(module)]

    def gradients(self) -> list[Any]:
        """The local piece of the last step's gradient of each ``parameters()`` entry: the
        stages' ``param_grads()`` (already reduced over the data-parallel ranks), in stage
        order."""
        return [local_tensor(grad) for stage in self.stages for grad in stage.param_grads().values()]


def build_pipeline(p: Platform, cfg: TrainConfig, model: Any, mesh: DeviceMesh,
                   cp_mesh: DeviceMesh | None = None, mp_policy: MixedPrecisionPolicy | None = None) -> Pipeline:
    """Cut ``model`` into ``cfg.layout.num_stages`` stages (``model.stage_layers``), keep this
    rank's (the schedule's placement, ``SCHEDULES[--pp-schedule]``: loop, stage ``s`` on pipeline
    rank ``s % pp``; V with ``zbv`` and ``dualpipev``, stages ``r`` and ``2 pp - 1 - r`` on rank
    ``r``), run the layout chain
    of ``parallelize`` on each stage module (tensor parallelism over ``mesh["tp"]``,
    context parallelism on its blocks' attention over ``cp_mesh``, each block checkpointed
    with ``cfg.activation_checkpointing``, fully_shard over the data-parallel (x cp)
    submesh; see ``[Note: pipeline stages and the other axes]``) and
    build the ``--pp-schedule`` over them. An MoE model's experts are sharded over ``--ep``
    ranks of each stage's pipeline coordinate after TP ([Note: MoE stages]); with
    ``--ep-overlap`` the schedule's ``OVERLAP_B_F`` pairs run on two threads hooked to the
    stages' dispatch/combine ([Note: the overlap in the job]). ``mp_policy``: ``--dtype``'s
    mixed precision (``None``: float32), given to fully_shard or hooked by ``apply_mixed_precision`` as
    ``parallelize`` does. ``cp_mesh``: ``context_parallel_mesh(mesh,
    layout)``, the mesh the loader shards sequences over (required when ``cp > 1``).
    Collectives: broadcasts of the tensor-parallel shards, creation of the data-parallel
    groups (through ``fully_shard_mesh``).

    Raises:
        ValueError: ``cp > 1`` without ``cp_mesh``."""
    layout = cfg.layout
    group = mesh["pp"].get_group()
    rank, size = mesh.get_local_rank("pp"), layout.pp
    num_stages = layout.num_stages
    ranges = stage_layers(cfg.model.n_layers, num_stages)
    entry = SCHEDULES[layout.pp_schedule]  # [Note: zero-bubble schedules in train]
    indices = entry.stages_of(size, rank)
    if layout.cp > 1 and cp_mesh is None:
        raise ValueError("build_pipeline: cp > 1 needs cp_mesh, the mesh the loader shards the sequences over "
                         "(context_parallel_mesh(mesh, layout))")
    if cfg.hf_module:  # a Hugging Face model (dense --hf-config): its own stages and plan
        from hyper_parallel.train.hf_model import build_hf_stages

        modules = build_hf_stages(model, ranges, indices, num_stages, mesh, layout, cp_mesh,
                                  cfg.activation_checkpointing)
    else:
        modules = [build_stage(p, cfg.model, model, ranges[s], s == 0, s == num_stages - 1) for s in indices]
        # the chain of parallelize.py (TP -> EP -> CP -> activation checkpointing -> fully_shard),
        # on every stage module; [Note: MoE stages]
        experts: list[Any] | None = None
        experts_mesh = ep_mesh = None
        if layout.ep > 1:  # the groups once, for every stage (a collective: every rank builds them)
            ep_mesh, experts_mesh = expert_parallel_meshes(mesh, layout)
            experts = []
        for module in modules:
            if layout.tp > 1:
                apply_tensor_parallel(module, mesh["tp"])
            if ep_mesh is not None:
                placed = apply_expert_parallel(module, ep_mesh)
                if experts is not None and experts_mesh is None:  # ep == dp_shard: left out of fully_shard
                    experts += placed
            if layout.cp > 1:
                apply_context_parallel(module, cp_mesh, layout)
            if cfg.activation_checkpointing:  # [Note: activation checkpointing in pipeline stages]
                apply_activation_checkpointing(module)
        # --dtype: the policy on each stage as on the whole decoder (parallelize.py), but
        # a stage root never casts its inputs: the positions cross a boundary as float32
        # (model._stage_forward), the residual stream comes in the compute dtype already
        if layout.dp * layout.cp > 1:
            dp_mesh = fully_shard_mesh(mesh, layout)
            for module in modules:
                apply_fully_shard(module, dp_mesh, mp_policy, ignored_params=experts or None,
                                  experts_mesh=experts_mesh, cast_root_inputs=False)
        elif mp_policy is not None:
            for module in modules:
                apply_mixed_precision(p, module, mp_policy)
    # the schedule gives the stages its placement ([Note: stage placement] in core/pipeline_parallel/stage.py)
    stages = [PipelineStage(module, s, num_stages, group=group) for module, s in zip(modules, indices)]

    built: list[Pipeline] = []  # the loss reads the pipeline's scale, set per step

    def loss_fn(logits: Any, targets: Any) -> Any:
        loss = cross_entropy(p, logits, targets)
        scale = built[0].loss_scale
        return loss if scale == 1.0 else loss * scale

    if layout.ep_overlap:
        schedule: PipelineSchedule = _overlapped_schedule(p, entry.schedule_class, modules, stages,
                                                          layout.microbatches, loss_fn)
    else:
        schedule = entry.schedule_class(stages, layout.microbatches, loss_fn)
    built.append(Pipeline(p, modules, stages, indices, num_stages, schedule, group, rank, size, entry.placement,
                          overlap=layout.ep_overlap))
    return built[0]


def _overlapped_schedule(p: Platform, schedule_class: type, modules: list[Any], stages: list[PipelineStage],
                         microbatches: int, loss_fn: Callable[[Any, Any], Any]) -> PipelineSchedule:
    """``schedule_class`` (1F1B, interleaved 1F1B or DualPipeV) with its ``OVERLAP_B_F`` pairs
    run on two threads and the MoE layers of ``modules`` hooked to them ([Note: the overlap
    in the job]); the runtime reduces fully_shard's gradients once per step, after each
    stage's last backward work ([Note: one reduction per step] in
    ``core/pipeline_parallel/gradient_sync``)."""
    overlap = CommComputeOverlap(HookCoordinator(hold_forward_tail=True))
    for module in modules:
        layers = moe_layers(p, module)
        for i, (_, layer) in enumerate(layers):
            assert layer.expert_parallel is not None, "TrainConfig: --ep-overlap needs --ep"
            layer.dispatch = overlap.wrap_dispatch(layer.expert_parallel.dispatch)
            layer.combine = overlap.wrap_combine(layer.expert_parallel.combine, is_last_layer=i == len(layers) - 1)
    if schedule_class.splits_backward:  # DualPipeV: pairs are its own
        return schedule_class(stages, microbatches, loss_fn, overlap=overlap)
    return schedule_class(stages, microbatches, loss_fn, overlap_b_f=True, overlap=overlap)


def train_step(pipe: Pipeline, tensors: list[Any], loss_scale: float = 1.0) -> float | None:
    """Run one step's forwards and backwards over the microbatches of ``tensors``
    (``[tokens, positions, targets]``, this data-parallel rank's ``[batch / dp, seq]``),
    each backward seeded with its loss times ``loss_scale`` (a power of two: the gradients
    come out scaled by it, exactly). Returns the mean of the microbatch losses (unscaled)
    on the rank of the last stage (the mean over this rank's tokens: microbatches are
    equal), ``None`` elsewhere."""
    pipe.loss_scale = loss_scale
    try:
        mean = _mean_loss(pipe, tensors, pipe.schedule.step)
    finally:
        pipe.loss_scale = 1.0
    return None if mean is None else mean / loss_scale


def forward_loss(pipe: Pipeline, tensors: list[Any]) -> float | None:
    """``train_step``'s loss without recording or gradients (validation): the schedule's
    forward-only step (``PipelineSchedule.eval``: its forwards in its order, the
    activations sent and received as in a step)."""
    return _mean_loss(pipe, tensors, pipe.schedule.eval)


def _mean_loss(pipe: Pipeline, tensors: list[Any], run: Callable[..., Any]) -> float | None:
    tokens, positions, targets = tensors
    losses: list[Any] = []
    args = (tokens, positions) if pipe.has_first else ()
    run(*args, target=targets if pipe.has_last else None, losses=losses)
    if not pipe.has_last:
        return None
    return float(np.mean([float(pipe.p.to_numpy(loss)) for loss in losses]))
