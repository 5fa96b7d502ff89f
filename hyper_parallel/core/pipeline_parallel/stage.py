"""One pipeline stage: a submodule, where it sits in the pipeline, and what crosses its
boundaries.

Stages are placed in a loop over the pipeline group: stage ``s`` runs on group rank
``s % group_size`` (one stage per rank, or ``num_stages / group_size`` interleaved
virtual stages per rank), or in a V (ZB-V, DualPipeV): the schedule's placement ([Note:
stage placement]). The shapes of the activations a stage receives are inferred on the
first step from microbatch 0 (the previous stage sends them ahead of the data).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.pipeline_parallel.boundary import Rebuild
from hyper_parallel.core.pipeline_parallel.messages import TensorSpec
from hyper_parallel.core.pipeline_parallel.weight_grad import LinearWeightSplit
from hyper_parallel.platform import Platform, get_platform, mesh_device_types

# [Note: stage placement]
# Which group rank runs stage ``s`` is a fact of the schedule, as in
# torch.distributed.pipelining (whose schedules set ``stage_index_to_group_rank`` from
# their style, "loop" or "v"): each schedule class declares its ``placement``
# (``PipelineSchedule.placement``, listed in ``schedule_table.SCHEDULES``) and, when it
# is built, hands it to every stage (``PipelineStage._bind_placement``), which checks that
# it runs on this rank there. ``PipelineStage(placement=...)`` stays accepted: given, it
# must be the schedule's (a ``ValueError`` names both). Before a schedule takes it, a
# stage built without one has the loop placement, or the V one when only the V puts it
# on this rank (``stage_rank`` answers with that).


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``, running ``submodule`` on this rank.

    ``submodule(*inputs, **kwargs)`` takes the previous stage's outputs (stage 0: one
    microbatch of the step's arguments; with ``run``, every stage also each microbatch's
    keyword arguments) and returns a floating-point tensor or a tuple of them, which are
    sent to the next stage (stage ``num_stages - 1``: passed to the schedule's ``loss_fn``,
    or its loss itself). The tensors crossing a boundary have the same shapes in every
    microbatch (inferred from microbatch 0); a ``DTensor`` crosses as its local piece and
    arrives as a ``DTensor`` ([Note: DTensors between stages] in ``boundary.py``).

    Args:
        submodule: a torch ``nn.Module`` or MindSpore ``Cell``; its parameters are this
            stage's (gradients in ``param_grads()`` after a step).
        stage_index: this stage, ``0 <= stage_index < num_stages``.
        num_stages: stages in the pipeline, a multiple of the pipeline group size
            (``stage_num=``: upstream hyper-parallel's and MindFormers' spelling).
        device: where the stage runs (torch's ``PipelineStage`` argument): ``None``, or a
            device type the platform's meshes take (``"cuda"``, ``torch.device("cuda:0")``;
            on MindSpore ``"npu"``/``"ascend"``, which places tensors by its context).
            Buffers are made on the platform's current device; this checks it agrees.
        group: the pipeline process group (``None``: the world, or ``mesh``'s group).
            Sends and receives use it (``batch_isend_irecv``).
        mesh: the pipeline's 1-D ``DeviceMesh`` (MindFormers passes its ``pp`` mesh);
            its group is the stage's group, kept as ``self.mesh``; its root's submeshes
            are where an incoming ``DTensor``'s mesh is looked up (with the parameters').
        placement: ``"loop"`` (stage ``s`` on group rank ``s % group_size``) or ``"v"``
            (``num_stages = 2 * group_size``; rank ``r`` runs stages ``r`` and
            ``2 * group_size - 1 - r``; ZB-V and DualPipeV). Optional: the schedule the
            stage is handed to sets it ([Note: stage placement]); ``None`` (the default)
            takes the loop placement until then, or the V one for a stage that only fits
            the V. Given, it must agree with the schedule's.

    Attributes:
        input_spec, output_spec: shapes and dtypes of one microbatch's tensors received
            from the previous stage and sent to the next one, known after the first step.
        input_rebuilds, output_rebuilds: per such tensor, the mesh, placements and
            global shape that make its local piece a ``DTensor`` (``None``: a plain tensor),
            known with the specs.
        weight_split: the weight-gradient split of the submodule's linear layers, set up
            by a schedule with ``W`` actions (zero-bubble, DualPipeV); ``None`` before.
            ``weight_split.remove()`` gives the layers their own forward back.

    Raises:
        ValueError: ``stage_index`` outside ``[0, num_stages)``; ``num_stages`` not a
            multiple of the group size; the stage does not belong on this rank under
            ``placement`` (under either placement when it is ``None``); an unknown
            ``placement``; both or neither of ``num_stages`` and ``stage_num``; a
            ``device`` of another type than the platform's; a ``mesh`` that is not 1-D or
            whose group is not ``group``.
    """

    def __init__(self, submodule: Any, stage_index: int, num_stages: int | None = None, device: Any = None, *,
                 group: Any = None, mesh: Any = None, placement: str | None = None,
                 stage_num: int | None = None) -> None:
        platform = get_platform()
        num_stages = _one_count(num_stages, stage_num)
        group = _mesh_group(mesh, group)
        _check_device(platform, device)
        size, rank = platform.world_size(group), platform.rank(group)
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index={stage_index} must be in [0, num_stages={num_stages})")
        if placement not in (None, "loop", "v"):
            raise ValueError(f"PipelineStage: placement={placement!r} must be 'loop', 'v' or None (the schedule's)")
        if placement == "v" and num_stages != 2 * size:
            raise ValueError(f"PipelineStage: placement='v' needs num_stages = 2 x the pipeline group size "
                             f"({2 * size}), got num_stages={num_stages}")
        self.group_size = size
        self.group_rank = rank
        self.stage_index = stage_index
        self.num_stages = num_stages
        if num_stages % size:
            raise ValueError(f"PipelineStage: num_stages={num_stages} is not a multiple of the pipeline group size "
                             f"{size}; each rank runs the same number of stages (e.g. num_stages={size * max(1, num_stages // size)})")
        #: ``"loop"`` or ``"v"``: given, or set by the schedule ([Note: stage placement])
        only_v = num_stages == 2 * size and _rank_of(stage_index, size, "loop") != rank \
            and _rank_of(stage_index, size, "v") == rank
        self.placement: str = placement or ("v" if only_v else "loop")
        self._placement_given = placement is not None
        self._check_rank(self.placement, "PipelineStage")
        self.platform: Platform = platform
        self.submodule = submodule
        self.group = group
        self.mesh = mesh
        self.device = device
        self.input_spec: tuple[TensorSpec, ...] | None = None  # known after the first step
        self.output_spec: tuple[TensorSpec, ...] | None = None
        # per boundary tensor, how a DTensor is rebuilt from its piece (None: a plain
        # tensor); known with the specs ([Note: DTensors between stages] in boundary.py)
        self.input_rebuilds: tuple[Rebuild | None, ...] | None = None
        self.output_rebuilds: tuple[Rebuild | None, ...] | None = None
        self._grads: list[Any] | None = None  # per parameter: this step's accumulated gradient
        self.weight_split: LinearWeightSplit | None = None
        self._step: Any = None  # the schedule's running step (runtime._StepState), during a step

    @property
    def named_params(self) -> list[tuple[str, Any]]:
        """The submodule's ``(name, parameter)`` pairs, read when used: a stage may be built
        before its module is parallelized and materialised (MindFormers' ``apply_pp``
        builds the stages, then tensor-parallelizes and fully_shards the modules, whose
        parameters become other objects; its trainer then materialises them)."""
        return list(self.platform.named_parameters(self.submodule))

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def stage_rank(self, stage_index: int) -> int:
        """The group rank that runs ``stage_index``: ``stage_index % group_size`` (loop
        placement), or the V placement's rank (``schedules.zero_bubble.v_placement``)."""
        return _rank_of(stage_index, self.group_size, self.placement)

    def _check_rank(self, placement: str, who: str) -> None:
        """Raise unless this stage runs on this rank under ``placement``."""
        owner = _rank_of(self.stage_index, self.group_size, placement)
        if owner != self.group_rank:
            size = self.group_size
            rule = f"stage s on rank s % {size}" if placement == "loop" else \
                f"V placement: stage s on rank s, or {2 * size - 1} - s for s >= {size}"
            raise ValueError(f"{who}: stage {self.stage_index} of {self.num_stages} runs on group rank {owner} "
                             f"({rule}), but this is group rank {self.group_rank}; build on each rank the stages "
                             "it runs")

    def _bind_placement(self, placement: str, schedule: str) -> None:
        """Take the placement of the schedule this stage is handed to ([Note: stage
        placement]).

        Raises:
            ValueError: the stage was built with another ``placement=``; the V placement
                with ``num_stages != 2 x group size``; the stage does not run on this rank
                under ``placement``.
        """
        if self._placement_given and placement != self.placement:
            raise ValueError(f"{schedule}: stage {self.stage_index} was built with placement={self.placement!r}, but "
                             f"{schedule} places its stages {placement!r}; leave placement= out (the schedule sets "
                             f"it) or pass placement={placement!r}")
        if placement == "v" and self.num_stages != 2 * self.group_size:
            raise ValueError(f"{schedule}: places 2 x the pipeline group size ({2 * self.group_size}) stages in a V, "
                             f"got stages of num_stages={self.num_stages}")
        self._check_rank(placement, schedule)
        self.placement = placement

    def get_last_stage_sens(self, outputs: Any) -> Any:
        """The backward seed of the last stage's ``outputs`` for one microbatch, for a
        schedule built without ``loss_fn`` (the stage's output is its loss): ones shaped
        like each output (a ``DTensor`` output gets a ``DTensor`` of ones with its mesh and
        placements: one value per replicated loss, as torch's DTensor seeds it). One seed
        per output when ``outputs`` is a tuple or list, else one seed. Subclasses scale it
        (MindFormers' ``ScaledLossPipelineStage`` multiplies by its ``loss_scale``);
        gradients are then summed over microbatches without further scaling.

        Raises:
            ValueError: an output is a ``DTensor`` with a ``Partial`` placement (reduce it
                first: a seed of ones on every rank would count it once per rank).
        """
        if isinstance(outputs, (tuple, list)):
            return [self._ones_like(out) for out in outputs]
        return self._ones_like(outputs)

    def _ones_like(self, out: Any) -> Any:
        if isinstance(out, DTensor):
            if any(placement.is_partial() for placement in out.placements):
                raise ValueError(f"{self!r}: the last stage's output has placements {tuple(out.placements)}; "
                                 "a Partial loss has no seed of ones (reduce it to Replicate in the stage)")
            local = out.to_local()
            ones = self.platform.full(tuple(local.shape), 1.0, local.dtype)
            return DTensor.from_local(ones, out.device_mesh, out.placements)
        return self.platform.full(tuple(out.shape), 1.0, out.dtype)

    def param_grads(self) -> dict[str, Any]:
        """``{fqn: gradient}`` of this stage's parameters from the last ``step``: the sum
        over microbatches of each microbatch loss's gradient, times ``1 / n_microbatches``
        when the schedule scales (its default), so a mean loss matches the unpipelined
        model's gradient. Zeros before any step. (On torch, ``param.grad`` holds the same
        values, accumulated across steps the torch way.)"""
        if self._grads is None:
            return {name: self.platform.zeros(tuple(param.shape), param.dtype) for name, param in self.named_params}
        return {name: grad for (name, _), grad in zip(self.named_params, self._grads)}

    def _split_weight_grads(self) -> None:
        if self.weight_split is None:
            self.weight_split = LinearWeightSplit(self.platform, self.submodule)

    # -- one microbatch inside a running step, for custom step functions ----------------
    # (upstream hyper-parallel's and torch's per-chunk calls; see core/pipeline_parallel/custom_step)

    def _running(self, caller: str) -> Any:
        if self._step is None:
            raise RuntimeError(f"PipelineStage.{caller}: stage {self.stage_index} is not in a running step; call it "
                               "from a function registered with schedule.register_custom_function")
        return self._step

    def forward_one_chunk(self, microbatch_index: int, args: Sequence[Any] | None = None,
                          kwargs: dict[str, Any] | None = None) -> Any:
        """This stage's forward of one microbatch, recorded for its backward, as the
        schedule's ``F`` runs it: the output goes to the next stage (sent by the ``SEND_F``
        that follows). ``args`` are stage 0's inputs (a later stage takes what the
        previous stage sent); ``kwargs`` the microbatch's keyword inputs (``None``: the
        microbatch's own).

        Returns:
            The stage's output, detached (the last stage's: its loss, or its outputs when
            the schedule has no ``loss_fn``).

        Raises:
            RuntimeError: called outside a step.
        """
        return self._running("forward_one_chunk").forward(self.stage_index, microbatch_index, args, kwargs)

    def backward_one_chunk(self, microbatch_index: int, last_backward: bool = False) -> None:
        """This stage's backward of one microbatch, as the schedule's ``B`` runs it (the
        input gradient goes to the previous stage by the following ``SEND_B``; parameter
        gradients add up in the step). ``last_backward`` is upstream's marker of a step's
        last backward; the step here hands gradients over after its last action, so it
        changes nothing.

        Raises:
            RuntimeError: called outside a step.
        """
        del last_backward
        self._running("backward_one_chunk").backward_full(self.stage_index, microbatch_index)

    def recompute_one_chunk(self, microbatch_index: int) -> None:
        """Upstream's early re-run of the forward a backward will need, called by
        MindFormers' overlap step on the main thread before the two overlap threads start.
        Nothing to do here: a recomputation runs inside ``backward_one_chunk``, where the
        sync hooks a forward re-run fires on the backward thread pass through ([Note:
        A/B/C/D rendezvous]: a hook coordinates only on its direction's thread), and the
        forward thread records nothing until the backward reached its first rendezvous.

        Raises:
            RuntimeError: called outside a step.
        """
        self._running("recompute_one_chunk")
        del microbatch_index

    def _reset_grads(self) -> None:
        self._grads = None

    def _accumulate(self, grads: Sequence[Any]) -> None:
        """Add one backward's gradients (per parameter; ``None``: none) to the step's."""
        if self._grads is None:
            self._grads = [self.platform.zeros(tuple(param.shape), param.dtype) if grad is None else grad
                           for grad, (_, param) in zip(grads, self.named_params, strict=True)]
        else:
            self._grads = [acc if grad is None else acc + grad for acc, grad in zip(self._grads, grads, strict=True)]

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, rank {self.group_rank}/{self.group_size})"


def _rank_of(stage_index: int, size: int, placement: str) -> int:
    """The group rank of ``stage_index`` on a group of ``size`` under ``placement``."""
    if placement == "v" and stage_index >= size:
        return 2 * size - 1 - stage_index
    return stage_index % size


def _one_count(num_stages: int | None, stage_num: int | None) -> int:
    if (num_stages is None) == (stage_num is None):
        raise ValueError(f"PipelineStage: give the number of stages once, as num_stages (got {num_stages}) or as "
                         f"stage_num (got {stage_num})")
    return num_stages if num_stages is not None else stage_num  # type: ignore[return-value]


def _mesh_group(mesh: Any, group: Any) -> Any:
    """The stage's group: ``group``, or the 1-D ``mesh``'s (which must agree)."""
    if mesh is None:
        return group
    if mesh.ndim != 1:
        raise ValueError(f"PipelineStage: mesh={mesh} has {mesh.ndim} axes; pass the pipeline's 1-D mesh "
                         "(e.g. world_mesh['pp'])")
    own = mesh.get_group()
    if group is not None and group != own:
        raise ValueError(f"PipelineStage: group={group!r} is not the group of mesh={mesh} ({own!r}); pass one of "
                         "them, or the mesh's own group")
    return own


def _check_device(platform: Platform, device: Any) -> None:
    if device is None:
        return
    kind = str(getattr(device, "type", device)).split(":")[0]
    accepted = mesh_device_types(platform.name)
    if kind not in accepted:
        raise ValueError(f"PipelineStage: device={device!r} is not a device of this platform "
                         f"({platform.name}: {', '.join(accepted)}); pass one of those or None")
