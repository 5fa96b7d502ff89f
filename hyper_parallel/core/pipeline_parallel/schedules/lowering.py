"""Lowering a compute-only schedule: insert the point-to-point actions between stages
that live on different ranks."""

from __future__ import annotations

from collections.abc import Callable

from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType, Schedule

A = ActionType


def loop_placement(num_ranks: int) -> Callable[[int], int]:
    """Stage ``s`` on rank ``s % num_ranks`` (interleaved placement; one stage per rank
    when there are ``num_ranks`` stages)."""
    return lambda stage: stage % num_ranks


def add_communication(schedule: Schedule, num_stages: int, stage_to_rank: Callable[[int], int] | None = None) -> Schedule:
    """Each cross-rank edge gets a send after the producing action and a receive right
    before the consuming one: ``RECV_F`` before ``F`` (stage > 0), ``SEND_F`` after it
    (stage < last); ``RECV_B`` before ``B``/``I`` (stage < last), ``SEND_B`` after it
    (stage > 0). Same-rank edges need none. Returns a new schedule."""
    place = stage_to_rank or loop_placement(len(schedule))
    lowered: Schedule = {}
    for rank, actions in schedule.items():
        out: list[Action] = []
        for action in actions:
            s, m = action.stage_index, action.microbatch_index
            if action.type is A.F:
                if s > 0 and place(s - 1) != place(s):
                    out.append(Action(s, A.RECV_F, m))
                out.append(action)
                if s < num_stages - 1 and place(s + 1) != place(s):
                    out.append(Action(s, A.SEND_F, m))
            elif action.type in (A.B, A.I):
                if s < num_stages - 1 and place(s + 1) != place(s):
                    out.append(Action(s, A.RECV_B, m))
                out.append(action)
                if s > 0 and place(s - 1) != place(s):
                    out.append(Action(s, A.SEND_B, m))
            else:
                out.append(action)
        lowered[rank] = out
    return lowered
