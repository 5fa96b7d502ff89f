"""The named schedules: each a ``PipelineSchedule`` (``runtime``) with the generator of its
action lists (``schedules/``), as torch.distributed.pipelining names them. Which name
maps to which class, its stage placement and stages per rank is ``schedule_table``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hyper_parallel.core.pipeline_parallel.comm_compute_overlap import CommComputeOverlap
from hyper_parallel.core.pipeline_parallel.runtime import LossFn, PipelineSchedule
from hyper_parallel.core.pipeline_parallel.schedules.actions import Schedule
from hyper_parallel.core.pipeline_parallel.schedules.dualpipe import dualpipe_v
from hyper_parallel.core.pipeline_parallel.schedules.generators import (gpipe, interleaved_1f1b, one_f_one_b,
                                                                       pair_backward_forward)
from hyper_parallel.core.pipeline_parallel.schedules.zero_bubble import interleaved_zero_bubble, zbv_zero_bubble
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage


def _single_stage(name: str, stage: PipelineStage | Sequence[PipelineStage]) -> list[PipelineStage]:
    if isinstance(stage, (list, tuple)) and len(stage) == 1:  # upstream hyper-parallel passes [stage]
        stage = stage[0]
    if not isinstance(stage, PipelineStage):
        raise TypeError(f"{name}: stage is {type(stage).__name__}, not a PipelineStage (interleaved schedules take a "
                        "list of stages)")
    if stage.num_stages != stage.group_size:
        raise ValueError(f"{name}: one stage per rank, but num_stages={stage.num_stages} on a pipeline group of "
                         f"{stage.group_size}; use ScheduleInterleaved1F1B for several stages per rank")
    return [stage]


def _fixed_per_rank(name: str, want: int, generator: Callable[[int, int], Schedule], num_ranks: int,
                    stages_per_rank: int, n_microbatches: int) -> Schedule:
    """``generator(num_ranks, n_microbatches)`` of a schedule with ``want`` stages per rank
    (one in the loop placement, two in the V), after checking ``stages_per_rank``."""
    if stages_per_rank != want:
        what = "two stages per rank in a V" if want == 2 else \
            "one stage per rank (an interleaved schedule runs several)"
        raise ValueError(f"{name}: {what}, got stages_per_rank={stages_per_rank}")
    return generator(num_ranks, n_microbatches)


class ScheduleGPipe(PipelineSchedule):
    """GPipe (Huang et al., 2019): all forwards, then all backwards; holds
    ``n_microbatches`` microbatches of activations on every rank. One stage per rank."""

    placement = "loop"

    @staticmethod
    def generate(num_ranks: int, stages_per_rank: int, n_microbatches: int) -> Schedule:
        """Every rank's compute actions (``schedules.gpipe``); ``stages_per_rank`` must be 1."""
        return _fixed_per_rank("ScheduleGPipe", 1, gpipe, num_ranks, stages_per_rank, n_microbatches)

    def __init__(self, stage: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: LossFn | None = None, *, scale_grads: bool | None = None) -> None:
        stages = _single_stage("ScheduleGPipe", stage)
        super().__init__(stages, n_microbatches, loss_fn, self.generate(stages[0].group_size, 1, n_microbatches),
                         scale_grads=scale_grads)


class Schedule1F1B(PipelineSchedule):
    """1F1B (PipeDream-flush, Narayanan et al., 2021): warm-up forwards, then one forward
    and one backward in turn; holds at most ``num_stages - rank`` microbatches of
    activations. One stage per rank.

    Args:
        overlap_b_f: pair each steady-state backward with the next forward
            (``OVERLAP_B_F``), as ``ScheduleInterleaved1F1B`` does.
        overlap: the ``CommComputeOverlap`` that runs the pairs (default: a new one).
    """

    placement = "loop"

    @staticmethod
    def generate(num_ranks: int, stages_per_rank: int, n_microbatches: int) -> Schedule:
        """Every rank's compute actions (``schedules.one_f_one_b``); ``stages_per_rank`` must be 1."""
        return _fixed_per_rank("Schedule1F1B", 1, one_f_one_b, num_ranks, stages_per_rank, n_microbatches)

    def __init__(self, stage: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: LossFn | None = None, *, scale_grads: bool | None = None, overlap_b_f: bool = False,
                 overlap: CommComputeOverlap | None = None) -> None:
        stages = _single_stage("Schedule1F1B", stage)
        compute = self.generate(stages[0].group_size, 1, n_microbatches)
        if overlap_b_f:
            compute = {rank: pair_backward_forward(actions) for rank, actions in compute.items()}
            overlap = overlap or CommComputeOverlap()
        super().__init__(stages, n_microbatches, loss_fn, compute, scale_grads=scale_grads, overlap=overlap)


def _stages_list(name: str, stages: Sequence[PipelineStage]) -> list[PipelineStage]:
    stages = list(stages)
    if not stages or not all(isinstance(s, PipelineStage) for s in stages):
        raise TypeError(f"{name}: stages={stages!r} must be a non-empty list of PipelineStage")
    return stages


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B (Narayanan et al., 2021; Megatron-LM): ``v`` stages per rank
    (stage ``s`` on rank ``s % group_size``), which divides the bubble by ``v``.

    Args:
        stages: this rank's stages, ``num_stages / group_size`` of them.
        overlap_b_f: pair each steady-state backward with the next forward
            (``OVERLAP_B_F``), run on two threads by ``overlap`` so that one's MoE
            communication hides under the other's compute.
        overlap: the ``CommComputeOverlap`` whose ``wrap_dispatch``/``wrap_combine`` the
            stages' MoE layers use (default: a new one, in ``self.overlap``).

    Raises:
        ValueError: ``n_microbatches`` not a multiple of the group size; a wrong number
            of stages for this rank.
    """

    placement = "loop"

    @staticmethod
    def generate(num_ranks: int, stages_per_rank: int, n_microbatches: int) -> Schedule:
        """Every rank's compute actions (``schedules.interleaved_1f1b``)."""
        return interleaved_1f1b(num_ranks, stages_per_rank, n_microbatches)

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: LossFn | None = None, *,
                 scale_grads: bool | None = None, overlap_b_f: bool = False,
                 overlap: CommComputeOverlap | None = None) -> None:
        stages = _stages_list("ScheduleInterleaved1F1B", stages)
        size = stages[0].group_size
        compute = self.generate(size, stages[0].num_stages // size, n_microbatches)
        if overlap_b_f:
            compute = {rank: pair_backward_forward(actions) for rank, actions in compute.items()}
            overlap = overlap or CommComputeOverlap()
        super().__init__(stages, n_microbatches, loss_fn, compute, scale_grads=scale_grads, overlap=overlap)


class ScheduleInterleavedZeroBubble(PipelineSchedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) on ``v`` interleaved
    stages per rank (stage ``s`` on rank ``s % group_size``; ``v = 1`` is plain ZB-H1):
    backwards split into ``I`` and ``W`` (``schedules.zero_bubble``), no more activation
    memory than interleaved 1F1B, a smaller bubble. The stages' linear layers get the
    weight-gradient split (``stage.weight_split``, ``weight_grad.LinearWeightSplit``), as
    with ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``.

    Raises:
        TypeError: ``stages`` is not a non-empty list of ``PipelineStage``.
        ValueError: stages built with ``placement="v"``; ``n_microbatches`` not a multiple
            of the group size when ``v > 1``; a wrong number of stages for this rank.
    """

    placement = "loop"
    splits_backward = True

    @staticmethod
    def generate(num_ranks: int, stages_per_rank: int, n_microbatches: int) -> Schedule:
        """Every rank's compute actions (``schedules.interleaved_zero_bubble``)."""
        return interleaved_zero_bubble(num_ranks, stages_per_rank, n_microbatches)

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: LossFn | None = None, *,
                 scale_grads: bool | None = None) -> None:
        stages = _stages_list("ScheduleInterleavedZeroBubble", stages)
        size = stages[0].group_size
        super().__init__(stages, n_microbatches, loss_fn, self.generate(size, stages[0].num_stages // size,
                                                                        n_microbatches), scale_grads=scale_grads)


class ScheduleZBVZeroBubble(PipelineSchedule):
    """ZB-V (Qi et al., ICLR 2024): ``2 * group_size`` stages in a V (rank ``r`` runs
    stages ``r`` and ``2 * group_size - 1 - r``; the schedule gives its stages this
    placement), so the last stage's gradient starts on the rank that ran stage 0; split
    backwards (``I`` and ``W``) within ``2 * group_size`` stage-activations per rank.

    Raises:
        TypeError: ``stages`` is not a non-empty list of ``PipelineStage``.
        ValueError: stages built with ``placement="loop"``; not this rank's two stages.
    """

    placement = "v"
    splits_backward = True

    @staticmethod
    def generate(num_ranks: int, stages_per_rank: int, n_microbatches: int) -> Schedule:
        """Every rank's compute actions (``schedules.zbv_zero_bubble``); ``stages_per_rank`` must be 2."""
        return _fixed_per_rank("ScheduleZBVZeroBubble", 2, zbv_zero_bubble, num_ranks, stages_per_rank, n_microbatches)

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: LossFn | None = None, *,
                 scale_grads: bool | None = None) -> None:
        stages = _stages_list("ScheduleZBVZeroBubble", stages)
        super().__init__(stages, n_microbatches, loss_fn, self.generate(stages[0].group_size, 2, n_microbatches),
                         scale_grads=scale_grads)


class ScheduleDualPipeV(PipelineSchedule):
    """DualPipeV (DeepSeek-V3's DualPipe, V variant; ``schedules.dualpipe``): V-placed
    stages (the schedule gives its stages the V placement, as ZB-V), a forward of one
    chunk paired with a backward of the other in the main phase (``OVERLAP_B_F``, run by
    ``overlap`` on two threads), split backwards in warm-up and drain.

    Args:
        overlap: the ``CommComputeOverlap`` whose ``wrap_dispatch``/``wrap_combine`` the
            stages' MoE layers use (default: a new one, in ``self.overlap``).

    Raises:
        TypeError: ``stages`` is not a non-empty list of ``PipelineStage``.
        ValueError: stages built with ``placement="loop"``; ``n_microbatches < 2 * group_size``.
    """

    placement = "v"
    splits_backward = True

    @staticmethod
    def generate(num_ranks: int, stages_per_rank: int, n_microbatches: int) -> Schedule:
        """Every rank's compute actions (``schedules.dualpipe_v``); ``stages_per_rank`` must be 2."""
        return _fixed_per_rank("ScheduleDualPipeV", 2, dualpipe_v, num_ranks, stages_per_rank, n_microbatches)

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: LossFn | None = None, *,
                 scale_grads: bool | None = None, overlap: CommComputeOverlap | None = None) -> None:
        stages = _stages_list("ScheduleDualPipeV", stages)
        super().__init__(stages, n_microbatches, loss_fn, self.generate(stages[0].group_size, 2, n_microbatches),
                         scale_grads=scale_grads, overlap=overlap or CommComputeOverlap())
