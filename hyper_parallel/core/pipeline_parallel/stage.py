"""One pipeline stage: a submodule, where it sits in the pipeline, and what crosses its
boundaries.

Stages are placed in a loop over the pipeline group: stage ``s`` runs on group rank
``s % group_size`` (one stage per rank, or ``num_stages / group_size`` interleaved
virtual stages per rank). The shapes of the activations a stage receives are inferred on
the first step from microbatch 0 (the previous stage sends them ahead of the data).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.pipeline_parallel.messages import TensorSpec
from hyper_parallel.core.pipeline_parallel.weight_grad import LinearWeightSplit
from hyper_parallel.platform import Platform, get_platform


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``, running ``submodule`` on this rank.

    ``submodule(*inputs, **kwargs)`` takes the previous stage's outputs (stage 0: one
    microbatch of the step's arguments) and returns a floating-point tensor or a tuple of
    them, which are sent to the next stage (stage ``num_stages - 1``: passed to the
    schedule's ``loss_fn``). Every tensor crossing a boundary keeps dim 0 as the batch
    dim of the microbatch.

    Args:
        submodule: a torch ``nn.Module`` or MindSpore ``Cell``; its parameters are this
            stage's (gradients in ``param_grads()`` after a step).
        stage_index: this stage, ``0 <= stage_index < num_stages``.
        num_stages: stages in the pipeline, a multiple of the pipeline group size.
        group: the pipeline process group (``None``: the world). Sends and receives use
            it (``batch_isend_irecv``).
        placement: ``"loop"`` (stage ``s`` on group rank ``s % group_size``) or ``"v"``
            (``num_stages = 2 * group_size``; rank ``r`` runs stages ``r`` and
            ``2 * group_size - 1 - r``; for ``ScheduleZBVZeroBubble``).

    Attributes:
        input_spec, output_spec: shapes and dtypes of one microbatch's tensors received
            from the previous stage and sent to the next one, known after the first step.
        weight_split: the weight-gradient split of the submodule's linear layers, set up
            by a schedule with ``W`` actions (zero-bubble, DualPipeV); ``None`` before.
            ``weight_split.remove()`` gives the layers their own forward back.

    Raises:
        ValueError: ``stage_index`` outside ``[0, num_stages)``; ``num_stages`` not a
            multiple of the group size; the stage does not belong on this rank under
            ``placement``; an unknown ``placement``.
    """

    def __init__(self, submodule: Any, stage_index: int, num_stages: int, *, group: Any = None,
                 placement: str = "loop") -> None:
        platform = get_platform()
        size, rank = platform.world_size(group), platform.rank(group)
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index={stage_index} must be in [0, num_stages={num_stages})")
        if placement not in ("loop", "v"):
            raise ValueError(f"PipelineStage: placement={placement!r} must be 'loop' or 'v'")
        if placement == "v" and num_stages != 2 * size:
            raise ValueError(f"PipelineStage: placement='v' needs num_stages = 2 x the pipeline group size "
                             f"({2 * size}), got num_stages={num_stages}")
        self.placement = placement
        self.group_size = size
        if num_stages % size:
            raise ValueError(f"PipelineStage: num_stages={num_stages} is not a multiple of the pipeline group size "
                             f"{size}; each rank runs the same number of stages (e.g. num_stages={size * max(1, num_stages // size)})")
        if self.stage_rank(stage_index) != rank:
            rule = f"stage s on rank s % {size}" if placement == "loop" else \
                f"V placement: stage s on rank s, or {2 * size - 1} - s for s >= {size}"
            raise ValueError(f"PipelineStage: stage {stage_index} of {num_stages} runs on group rank "
                             f"{self.stage_rank(stage_index)} ({rule}), but this is group rank {rank}; "
                             "build on each rank the stages it runs")
        self.platform: Platform = platform
        self.submodule = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.group_rank = rank
        self.input_spec: tuple[TensorSpec, ...] | None = None  # known after the first step
        self.output_spec: tuple[TensorSpec, ...] | None = None
        self.named_params: list[tuple[str, Any]] = list(platform.named_parameters(submodule))
        self._grads: list[Any] | None = None  # per parameter: this step's accumulated gradient
        self.weight_split: LinearWeightSplit | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def stage_rank(self, stage_index: int) -> int:
        """The group rank that runs ``stage_index``: ``stage_index % group_size`` (loop
        placement), or the V placement's rank (``schedules.zero_bubble.v_placement``)."""
        size = self.group_size
        if self.placement == "v" and stage_index >= size:
            return 2 * size - 1 - stage_index
        return stage_index % size

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

    def _reset_grads(self) -> None:
        self._grads = None

    def _accumulate(self, grads: Sequence[Any]) -> None:
        if self._grads is None:
            self._grads = list(grads)
        else:
            self._grads = [acc + grad for acc, grad in zip(self._grads, grads)]

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, rank {self.group_rank}/{self.group_size})"
