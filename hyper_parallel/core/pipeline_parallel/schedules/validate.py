"""The schedule validator: structure first (every microbatch's work done once, on the
rank its stage lives on; every send has its receive), then a zero-cost run that must
finish (no deadlock)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hyper_parallel.core.pipeline_parallel.schedules.actions import ActionType, Schedule
from hyper_parallel.core.pipeline_parallel.schedules.simulator import ScheduleError, simulate

A = ActionType
_MATCH = {A.SEND_F: (A.RECV_F, 1), A.SEND_B: (A.RECV_B, -1)}


def validate(schedule: Schedule, num_stages: int, n_microbatches: int, *,
             stage_to_rank: Callable[[int], int] | None = None, backward: bool = True) -> None:
    """Check that ``schedule`` runs every microbatch through every stage exactly once
    (``backward=False``: a forward-only schedule, ``lowering.forward_only``, whose
    microbatches run ``F`` only).

    Raises:
        ScheduleError: with the first problem found and how to fix it.
    """
    place = stage_to_rank or (lambda stage, n=len(schedule): stage % n)
    counts: Counter = Counter()
    for rank, listed in schedule.items():
        actions = [part for action in listed for part in (action.sub_actions or (action,))]
        for action in actions:
            if not 0 <= action.stage_index < num_stages or not 0 <= action.microbatch_index < n_microbatches:
                raise ScheduleError(f"rank {rank}: {action} is outside {num_stages} stages x {n_microbatches} "
                                    "microbatches")
            if place(action.stage_index) != rank:
                raise ScheduleError(f"rank {rank}: {action} belongs to rank {place(action.stage_index)}, where stage "
                                    f"{action.stage_index} is placed")
            counts[(action.type, action.stage_index, action.microbatch_index)] += 1
    duplicates = [key for key, count in counts.items() if count > 1]
    if duplicates:
        kind, s, m = duplicates[0]
        raise ScheduleError(f"{s}{kind.value}{m} appears {counts[duplicates[0]]} times; each action runs once")
    for s in range(num_stages):
        for m in range(n_microbatches):
            if not counts[(A.F, s, m)]:
                raise ScheduleError(f"{s}F{m} is missing: every microbatch runs forward on every stage")
            if not backward:
                if any(counts[(kind, s, m)] for kind in (A.B, A.I, A.W)):
                    raise ScheduleError(f"stage {s} microbatch {m} runs a backward in a forward-only schedule")
                continue
            split = counts[(A.I, s, m)] or counts[(A.W, s, m)]
            if split and not (counts[(A.I, s, m)] and counts[(A.W, s, m)]):
                raise ScheduleError(f"stage {s} microbatch {m} splits its backward but lacks its "
                                    f"{'W' if counts[(A.I, s, m)] else 'I'} half")
            if not split and not counts[(A.B, s, m)]:
                raise ScheduleError(f"{s}B{m} is missing (or give its I and W halves)")
            if split and counts[(A.B, s, m)]:
                raise ScheduleError(f"stage {s} microbatch {m} has both B and I/W; use one form")
    for (kind, s, m), _ in list(counts.items()):
        if kind in _MATCH:
            partner, step = _MATCH[kind]
            if not counts[(partner, s + step, m)]:
                raise ScheduleError(f"{s}{kind.value}{m} has no matching {s + step}{partner.value}{m} on rank "
                                    f"{place(s + step)}")
        if kind in (A.RECV_F, A.RECV_B):
            sender = A.SEND_F if kind is A.RECV_F else A.SEND_B
            source = s - 1 if kind is A.RECV_F else s + 1
            if not counts[(sender, source, m)]:
                raise ScheduleError(f"{s}{kind.value}{m} waits for {source}{sender.value}{m}, which no rank sends")
    simulate(schedule, num_stages, stage_to_rank=place, costs={kind: 0.0 for kind in A})
