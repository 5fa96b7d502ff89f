"""Compute-only schedules (no communication actions; see ``lowering.add_communication``).

Stages are placed in a loop: stage ``s`` runs on rank ``s % num_ranks``; with ``v``
virtual stages per rank there are ``num_ranks * v`` stages.
"""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType, Schedule

F, B = ActionType.F, ActionType.B


def _check(num_ranks: int, n_microbatches: int, what: str) -> None:
    if num_ranks < 1 or n_microbatches < 1:
        raise ValueError(f"{what}: num_ranks={num_ranks} and n_microbatches={n_microbatches} must both be >= 1")


def gpipe(num_ranks: int, n_microbatches: int) -> Schedule:
    """GPipe (Huang et al., 2019): every forward, then every backward (reverse order).
    Peak activation memory: ``n_microbatches`` per rank."""
    _check(num_ranks, n_microbatches, "gpipe")
    return {rank: [Action(rank, F, m) for m in range(n_microbatches)]
            + [Action(rank, B, m) for m in reversed(range(n_microbatches))] for rank in range(num_ranks)}


def one_f_one_b(num_ranks: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Narayanan et al., 2021): ``num_ranks - rank - 1`` warm-up
    forwards, then alternate one forward and one backward, then drain the backwards. Peak
    activation memory: ``min(num_ranks - rank, n_microbatches)`` microbatches."""
    _check(num_ranks, n_microbatches, "one_f_one_b")
    schedule: Schedule = {}
    for rank in range(num_ranks):
        warmup = min(num_ranks - rank - 1, n_microbatches)
        actions = [Action(rank, F, m) for m in range(warmup)]
        forward, backward = warmup, 0
        while forward < n_microbatches:
            actions.append(Action(rank, F, forward))
            forward += 1
            actions.append(Action(rank, B, backward))
            backward += 1
        actions += [Action(rank, B, m) for m in range(backward, n_microbatches)]
        schedule[rank] = actions
    return schedule


def pair_backward_forward(actions: list[Action]) -> list[Action]:
    """Each ``B`` directly followed by an ``F`` becomes one ``OVERLAP_B_F`` (the steady
    state of 1F1B-like schedules), run on two threads by ``CommComputeOverlap``."""
    out: list[Action] = []
    for action in actions:
        if action.type is F and out and out[-1].type is B:
            out[-1] = Action.overlap(out[-1], action)
        else:
            out.append(action)
    return out


def interleaved_1f1b(num_ranks: int, n_virtual: int, n_microbatches: int, *, overlap_b_f: bool = False) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021): ``n_virtual`` stages per rank (stage
    ``s`` on rank ``s % num_ranks``); microbatches go through the local stages in groups
    of ``num_ranks``, which shrinks the bubble by ``n_virtual``. With ``overlap_b_f`` each
    steady-state backward is paired with the next forward (``OVERLAP_B_F``).

    Raises:
        ValueError: ``n_microbatches`` not a multiple of ``num_ranks`` (the grouping needs it).
    """
    _check(num_ranks, n_microbatches, "interleaved_1f1b")
    if n_virtual < 1:
        raise ValueError(f"interleaved_1f1b: n_virtual={n_virtual} must be >= 1")
    if n_microbatches % num_ranks:
        raise ValueError(f"interleaved_1f1b: n_microbatches={n_microbatches} must be a multiple of num_ranks="
                         f"{num_ranks}; use {(n_microbatches // num_ranks + 1) * num_ranks} microbatches")
    total = n_microbatches * n_virtual

    def forward_at(rank: int, k: int) -> Action:
        group, offset = divmod(k, num_ranks * n_virtual)
        chunk, within = divmod(offset, num_ranks)
        return Action(chunk * num_ranks + rank, F, group * num_ranks + within)

    def backward_at(rank: int, k: int) -> Action:
        group, offset = divmod(k, num_ranks * n_virtual)
        chunk, within = divmod(offset, num_ranks)
        return Action((n_virtual - 1 - chunk) * num_ranks + rank, B, group * num_ranks + within)

    schedule: Schedule = {}
    for rank in range(num_ranks):
        warmup = min((num_ranks - rank - 1) * 2 + (n_virtual - 1) * num_ranks, total)
        actions = [forward_at(rank, k) for k in range(warmup)]
        forward, backward = warmup, 0
        while forward < total:
            actions.append(forward_at(rank, forward))
            forward += 1
            actions.append(backward_at(rank, backward))
            backward += 1
        actions += [backward_at(rank, k) for k in range(backward, total)]
        schedule[rank] = pair_backward_forward(actions) if overlap_b_f else actions
    return schedule
