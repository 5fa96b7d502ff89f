"""The action vocabulary of pipeline schedules and its compact text form.

``Action(stage_index, type, microbatch_index)`` prints as ``"2F0"``: stage 2, forward,
microbatch 0 (the notation of torch.distributed.pipelining). Communication actions print
their type in full: ``"1SEND_F3"``. A schedule is ``{rank: [Action, ...]}``, executed in
list order by each rank.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from dataclasses import dataclass

#: rank -> the actions that rank runs, in order
Schedule = dict[int, list["Action"]]


class ActionType(enum.Enum):
    """What one step of a rank does for one (stage, microbatch)."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  input-gradient half of a split backward (zero-bubble)
    W = "W"  # weight-gradient half of a split backward
    SEND_F = "SEND_F"  # send the forward activation to the next stage
    RECV_F = "RECV_F"  # receive the forward activation from the previous stage
    SEND_B = "SEND_B"  # send the input gradient to the previous stage
    RECV_B = "RECV_B"  # receive the output gradient from the next stage
    OVERLAP_B_F = "OVERLAP_B_F"  # a B and an F of two microbatches run together (comm/compute overlap)

    @property
    def is_compute(self) -> bool:
        return self in (ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_B_F)


_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_OVERLAP = re.compile(r"^\((\d+B\d+);(\d+F\d+)\)OVERLAP_B_F$")


@dataclass(frozen=True, order=True)
class Action:
    """One step: ``type`` for ``microbatch_index`` on ``stage_index``.

    ``OVERLAP_B_F`` carries its two halves in ``sub_actions`` (a ``B`` and an ``F`` on the
    same rank, run together by ``CommComputeOverlap``); its own stage and microbatch
    are the ``B``'s. Build it with ``Action.overlap(b, f)``; it prints as
    ``"(2B1;3F4)OVERLAP_B_F"``.
    """

    stage_index: int
    type: ActionType
    microbatch_index: int
    sub_actions: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if self.stage_index < 0 or self.microbatch_index < 0:
            raise ValueError(f"Action: stage_index={self.stage_index} and microbatch_index={self.microbatch_index} "
                             "must be non-negative")
        if (self.type is ActionType.OVERLAP_B_F) != bool(self.sub_actions):
            raise ValueError(f"Action: {self.type.name} takes sub_actions={self.sub_actions!r} only for OVERLAP_B_F "
                             "(use Action.overlap(b, f))")

    @property
    def micro_index(self) -> int:
        """Upstream hyper-parallel's name for ``microbatch_index`` (MindFormers' custom
        step function reads it)."""
        return self.microbatch_index

    @property
    def sub_steps(self) -> tuple[Action, ...]:
        """Upstream hyper-parallel's name for ``sub_actions``: ``(B, F)`` of an
        ``OVERLAP_B_F``."""
        return self.sub_actions

    @staticmethod
    def overlap(backward: Action, forward: Action) -> Action:
        """``OVERLAP_B_F`` of ``backward`` (type ``B``) and ``forward`` (type ``F``).

        Raises:
            ValueError: the halves are not a ``B`` and an ``F``.
        """
        if backward.type is not ActionType.B or forward.type is not ActionType.F:
            raise ValueError(f"Action.overlap: needs a B and an F, got {backward} and {forward}")
        return Action(backward.stage_index, ActionType.OVERLAP_B_F, backward.microbatch_index, (backward, forward))

    def __str__(self) -> str:
        if self.sub_actions:
            return f"({self.sub_actions[0]};{self.sub_actions[1]}){self.type.value}"
        return f"{self.stage_index}{self.type.value}{self.microbatch_index}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> Action:
        """``"2F0"`` -> ``Action(2, ActionType.F, 0)``.

        Raises:
            ValueError: text not of the form ``<stage><TYPE><microbatch>``.
        """
        overlap = _OVERLAP.match(text.strip())
        if overlap is not None:
            return Action.overlap(Action.parse(overlap.group(1)), Action.parse(overlap.group(2)))
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(f"Action.parse: {text!r} is not <stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B><microbatch>, "
                             "e.g. '2F0' or '1SEND_B3', or (<stage>B<microbatch>;<stage>F<microbatch>)OVERLAP_B_F")
        return Action(int(match.group(1)), ActionType(match.group(2)), int(match.group(3)))


def to_csv(schedule: Schedule) -> str:
    """One CSV row per rank: the rank, then its actions in compact form."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in sorted(schedule):
        writer.writerow([rank, *map(str, schedule[rank])])
    return out.getvalue()


def from_csv(text: str) -> Schedule:
    """Inverse of ``to_csv``.

    Raises:
        ValueError: a row without a rank, or an action that does not parse.
    """
    schedule: Schedule = {}
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if not row[0].strip().isdigit():
            raise ValueError(f"from_csv: row {row} does not start with a rank number")
        schedule[int(row[0])] = [Action.parse(cell) for cell in row[1:] if cell.strip()]
    return schedule
