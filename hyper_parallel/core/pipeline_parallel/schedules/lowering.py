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
    (stage > 0). Same-rank edges need none. An ``OVERLAP_B_F`` gets the receives of both
    halves before it and their sends after it. Returns a new schedule."""
    place = stage_to_rank or loop_placement(len(schedule))

    def receives(action: Action) -> list[Action]:
        s, m = action.stage_index, action.microbatch_index
        if action.type is A.F and s > 0 and place(s - 1) != place(s):
            return [Action(s, A.RECV_F, m)]
        if action.type in (A.B, A.I) and s < num_stages - 1 and place(s + 1) != place(s):
            return [Action(s, A.RECV_B, m)]
        return []

    def sends(action: Action) -> list[Action]:
        s, m = action.stage_index, action.microbatch_index
        if action.type is A.F and s < num_stages - 1 and place(s + 1) != place(s):
            return [Action(s, A.SEND_F, m)]
        if action.type in (A.B, A.I) and s > 0 and place(s - 1) != place(s):
            return [Action(s, A.SEND_B, m)]
        return []

    lowered: Schedule = {}
    for rank, actions in schedule.items():
        out: list[Action] = []
        for action in actions:
            parts = action.sub_actions or (action,)  # OVERLAP_B_F: both halves' inputs first
            for part in parts:
                out += receives(part)
            out.append(action)
            for part in parts:
                out += sends(part)
        lowered[rank] = out
    return lowered


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of a compute-only ``schedule``, each rank's in its order (an
    ``OVERLAP_B_F`` keeps its ``F``; ``B``, ``I`` and ``W`` go): the forward-only step of
    the same schedule, as torch.distributed.pipelining's ``eval`` runs it. Restricting
    every rank to its forwards keeps the schedule deadlock-free: a forward waits only for
    earlier forwards. Returns a new schedule (lower it with ``add_communication``)."""
    return {rank: [part for action in actions for part in (action.sub_actions or (action,)) if part.type is A.F]
            for rank, actions in schedule.items()}
