"""The pipeline schedules by name: one table from which ``hyper-parallel train
--pp-schedule``'s choices, the simulator's comparison (``compare.py``) and
``benchmarks/pipeline.py`` take their names, classes, placements and stages per rank.

| name | class | placement | stages per rank |
|---|---|---|---|
| ``gpipe`` | ``ScheduleGPipe`` | loop | 1 |
| ``1f1b`` | ``Schedule1F1B`` | loop | 1 |
| ``interleaved-1f1b`` | ``ScheduleInterleaved1F1B`` | loop | 2 |
| ``zbh1`` | ``ScheduleInterleavedZeroBubble`` | loop | 1 |
| ``interleaved-zero-bubble`` | ``ScheduleInterleavedZeroBubble`` | loop | 2 |
| ``zbv`` | ``ScheduleZBVZeroBubble`` | v | 2 |
| ``dualpipev`` | ``ScheduleDualPipeV`` | v | 2 |

The placement is the class's (``PipelineSchedule.placement``, which the schedule hands
to its stages: [Note: stage placement] in ``stage.py``); "stages per rank" is what the
name means for classes that take any number (the interleaved ones: ``n_virtual``).
The names ``compare.py`` reported before this table (``interleaved_1f1b``,
``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dualpipe_v``) are accepted by
``schedule_entry`` (``ALIASES``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hyper_parallel.core.pipeline_parallel.named_schedules import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                                                   ScheduleInterleaved1F1B,
                                                                   ScheduleInterleavedZeroBubble,
                                                                   ScheduleZBVZeroBubble)
from hyper_parallel.core.pipeline_parallel.runtime import PipelineSchedule
from hyper_parallel.core.pipeline_parallel.schedules.actions import Schedule
from hyper_parallel.core.pipeline_parallel.schedules.lowering import loop_placement
from hyper_parallel.core.pipeline_parallel.schedules.zero_bubble import v_placement

#: placement -> its ``stage -> rank`` map for a number of ranks
PLACEMENTS: Mapping[str, Callable[[int], Callable[[int], int]]] = MappingProxyType(
    {"loop": loop_placement, "v": v_placement})


@dataclass(frozen=True)
class ScheduleEntry:
    """One schedule of the table.

    Attributes:
        name: the canonical name (kebab-case, ``--pp-schedule``'s spelling).
        schedule_class: the ``PipelineSchedule`` subclass that runs it.
        stages_per_rank: stages each rank holds (``num_stages = ranks x this``).
        description: one line for help texts.

    Raises:
        ValueError: ``stages_per_rank < 1``; a V-placed class with other than 2 stages
            per rank; a class without a placement (the base ``PipelineSchedule``).
    """

    name: str
    schedule_class: type[PipelineSchedule]
    stages_per_rank: int
    description: str

    def __post_init__(self) -> None:
        placement = self.schedule_class.placement
        if placement not in PLACEMENTS:
            raise ValueError(f"ScheduleEntry {self.name!r}: {self.schedule_class.__name__}.placement={placement!r} "
                             f"must be one of {sorted(PLACEMENTS)}")
        if self.stages_per_rank < 1 or (placement == "v" and self.stages_per_rank != 2):
            raise ValueError(f"ScheduleEntry {self.name!r}: stages_per_rank={self.stages_per_rank} must be >= 1 "
                             "(exactly 2 for the V placement)")

    @property
    def placement(self) -> str:
        """``"loop"`` or ``"v"``: the class's placement (given to its stages)."""
        placement = self.schedule_class.placement
        assert placement is not None, "checked in __post_init__"
        return placement

    @property
    def splits_backward(self) -> bool:
        """The schedule splits backwards into ``I`` and ``W`` (zero-bubble, DualPipeV)."""
        return self.schedule_class.splits_backward

    def num_stages(self, num_ranks: int) -> int:
        """Stages of a pipeline of ``num_ranks`` ranks: ``num_ranks x stages_per_rank``."""
        return num_ranks * self.stages_per_rank

    def stage_to_rank(self, num_ranks: int) -> Callable[[int], int]:
        """The ``stage -> rank`` map of the placement over ``num_ranks`` ranks."""
        return PLACEMENTS[self.placement](num_ranks)

    def stages_of(self, num_ranks: int, rank: int) -> list[int]:
        """The stage indices ``rank`` holds, in stage order."""
        place = self.stage_to_rank(num_ranks)
        return [s for s in range(self.num_stages(num_ranks)) if place(s) == rank]

    def generate(self, num_ranks: int, n_microbatches: int, stages_per_rank: int | None = None) -> Schedule:
        """Every rank's compute actions (the class's generator) for ``stages_per_rank``
        (default: the entry's) stages per rank.

        Raises:
            ValueError: a configuration the schedule does not run, with the generator's
                rule (e.g. interleaved 1F1B: ``n_microbatches`` a multiple of the ranks;
                DualPipeV: ``n_microbatches >= 2 x num_ranks``).
        """
        per_rank = self.stages_per_rank if stages_per_rank is None else stages_per_rank
        # every class of the table defines the staticmethod generate (the base class takes its actions)
        return self.schedule_class.generate(num_ranks, per_rank, n_microbatches)  # type: ignore[attr-defined]


SCHEDULES: Mapping[str, ScheduleEntry] = MappingProxyType({entry.name: entry for entry in (
    ScheduleEntry("gpipe", ScheduleGPipe, 1, "GPipe: every forward, then every backward"),
    ScheduleEntry("1f1b", Schedule1F1B, 1, "1F1B (PipeDream-flush)"),
    ScheduleEntry("interleaved-1f1b", ScheduleInterleaved1F1B, 2,
                  "interleaved 1F1B, 2 stages per rank; microbatches a multiple of the ranks"),
    ScheduleEntry("zbh1", ScheduleInterleavedZeroBubble, 1,
                  "zero-bubble ZB-H1, backwards split into input- and weight-gradient passes"),
    ScheduleEntry("interleaved-zero-bubble", ScheduleInterleavedZeroBubble, 2,
                  "ZB-H1 on 2 interleaved stages per rank; microbatches a multiple of the ranks"),
    ScheduleEntry("zbv", ScheduleZBVZeroBubble, 2,
                  "zero-bubble ZB-V, 2 stages per rank in a V: rank r runs stages r and 2 ranks - 1 - r"),
    ScheduleEntry("dualpipev", ScheduleDualPipeV, 2,
                  "DualPipeV, V-placed like ZB-V, forward/backward pairs on two threads; microbatches >= 2 x ranks"),
)})

#: earlier spellings (``compare.py``'s estimate names) -> the canonical name
ALIASES: Mapping[str, str] = MappingProxyType({
    "interleaved_1f1b": "interleaved-1f1b", "interleaved_zero_bubble": "interleaved-zero-bubble",
    "zbv_zero_bubble": "zbv", "dualpipe_v": "dualpipev"})


def schedule_entry(name: str) -> ScheduleEntry:
    """The entry of ``name`` (a canonical name or one of ``ALIASES``).

    Raises:
        ValueError: an unknown name; the message lists the names.
    """
    entry = SCHEDULES.get(ALIASES.get(name, name))
    if entry is None:
        raise ValueError(f"pipeline schedule {name!r} is not known; use one of {', '.join(SCHEDULES)}")
    return entry
