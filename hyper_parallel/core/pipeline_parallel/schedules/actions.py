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

    @property
    def is_compute(self) -> bool:
        return self in (ActionType.F, ActionType.B, ActionType.I, ActionType.W)


_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One step: ``type`` for ``microbatch_index`` on ``stage_index``."""

    stage_index: int
    type: ActionType
    microbatch_index: int

    def __post_init__(self) -> None:
        if self.stage_index < 0 or self.microbatch_index < 0:
            raise ValueError(f"Action: stage_index={self.stage_index} and microbatch_index={self.microbatch_index} "
                             "must be non-negative")

    def __str__(self) -> str:
        return f"{self.stage_index}{self.type.value}{self.microbatch_index}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> Action:
        """``"2F0"`` -> ``Action(2, ActionType.F, 0)``.

        Raises:
            ValueError: text not of the form ``<stage><TYPE><microbatch>``.
        """
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(f"Action.parse: {text!r} is not <stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B><microbatch>, "
                             "e.g. '2F0' or '1SEND_B3'")
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
