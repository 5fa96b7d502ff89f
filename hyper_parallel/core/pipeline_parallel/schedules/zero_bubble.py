"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
the backward splits into ``I`` (gradient w.r.t. the stage input, which the previous stage
waits for) and ``W`` (parameter gradients, which nothing waits for), and the ``W``s fill
the bubbles that 1F1B leaves.

Both generators here list-schedule on the paper's cost model (``F``, ``I`` and ``W``
take one unit each): at every step, each free rank starts the first ready action by
priority ``I`` > ``F`` > ``W`` (oldest microbatch first; among forwards the deepest
stage first), and starts an ``F`` only while it holds fewer activations (from ``F`` to
``W``) than its memory limit. The limit is the "H1" rule of the paper: no more activation
memory than the 1F1B counterpart of the schedule.

* ``interleaved_zero_bubble``: loop placement (stage ``s`` on rank ``s % num_ranks``),
  ``n_virtual`` stages per rank; ``n_virtual=1`` is ZB-H1. Limit: the peak of
  ``interleaved_1f1b`` (``one_f_one_b`` for one stage per rank) on that rank.
* ``zbv_zero_bubble``: ZB-V, V-shaped placement (``v_placement``: rank ``r`` holds stages
  ``r`` and ``2 * num_ranks - 1 - r``, so the first and last stage share rank 0). Limit:
  ``2 * num_ranks`` stage-activations per rank, the memory of 1F1B over the same model
  (``num_ranks`` microbatches of a whole rank's layers).
"""

from __future__ import annotations

from collections.abc import Callable

from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType, Schedule
from hyper_parallel.core.pipeline_parallel.schedules.generators import interleaved_1f1b, one_f_one_b
from hyper_parallel.core.pipeline_parallel.schedules.simulator import simulate

A = ActionType


def v_placement(num_ranks: int) -> Callable[[int], int]:
    """V-shaped placement of ``2 * num_ranks`` stages: stage ``s`` on rank ``s`` for
    ``s < num_ranks``, else on rank ``2 * num_ranks - 1 - s``."""
    return lambda stage: stage if stage < num_ranks else 2 * num_ranks - 1 - stage


def _list_schedule(num_ranks: int, num_stages: int, n_microbatches: int, place: Callable[[int], int],
                   memory_limit: dict[int, int], what: str) -> Schedule:
    """The greedy list scheduler of the module docstring (unit costs)."""
    stages = {rank: [s for s in range(num_stages) if place(s) == rank] for rank in range(num_ranks)}
    done: dict[tuple[ActionType, int, int], int] = {}  # action -> finish time
    held = {rank: 0 for rank in range(num_ranks)}
    free_at = {rank: 0 for rank in range(num_ranks)}
    schedule: Schedule = {rank: [] for rank in range(num_ranks)}
    remaining = 3 * num_stages * n_microbatches
    last = num_stages - 1

    def ready(key: tuple[ActionType, int, int], t: int) -> bool:
        return key in done and done[key] <= t

    def pick(rank: int, t: int) -> Action | None:
        todo = [(s, m) for m in range(n_microbatches) for s in stages[rank]]
        inputs = [(m, -s) for s, m in todo if (A.I, s, m) not in done and ready((A.F, s, m), t)
                  and (s == last or ready((A.I, s + 1, m), t))]
        if inputs:
            m, s = min(inputs)
            return Action(-s, A.I, m)
        if held[rank] < memory_limit[rank]:
            forwards = [(m, -s) for s, m in todo if (A.F, s, m) not in done and (s == 0 or ready((A.F, s - 1, m), t))]
            if forwards:
                m, s = min(forwards)
                return Action(-s, A.F, m)
        weights = [(m, s) for s, m in todo if (A.W, s, m) not in done and ready((A.I, s, m), t)]
        if weights:
            m, s = min(weights)
            return Action(s, A.W, m)
        return None

    t = 0
    limit = 4 * remaining + 4  # unit costs: a schedule that runs at all ends long before
    while remaining:
        for rank in range(num_ranks):
            if free_at[rank] > t:
                continue
            action = pick(rank, t)
            if action is None:
                continue
            done[(action.type, action.stage_index, action.microbatch_index)] = t + 1
            free_at[rank] = t + 1
            held[rank] += {A.F: 1, A.I: 0, A.W: -1}[action.type]
            schedule[rank].append(action)
            remaining -= 1
        t += 1
        if t > limit:
            raise ValueError(f"{what}: the memory limits {memory_limit} leave no runnable action; raise them")
    return schedule


def _check(num_ranks: int, n_microbatches: int, what: str) -> None:
    if num_ranks < 1 or n_microbatches < 1:
        raise ValueError(f"{what}: num_ranks={num_ranks} and n_microbatches={n_microbatches} must both be >= 1")


def interleaved_zero_bubble(num_ranks: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """ZB-H1 with ``n_virtual`` interleaved stages per rank (stage ``s`` on rank ``s %
    num_ranks``): compute actions ``F``/``I``/``W``, no more activation memory per rank
    than interleaved 1F1B (1F1B for ``n_virtual=1``).

    Raises:
        ValueError: ``n_virtual < 1``; ``n_microbatches`` not a multiple of ``num_ranks``
            when ``n_virtual > 1`` (interleaved 1F1B's grouping, whose memory is the limit).
    """
    _check(num_ranks, n_microbatches, "interleaved_zero_bubble")
    if n_virtual < 1:
        raise ValueError(f"interleaved_zero_bubble: n_virtual={n_virtual} must be >= 1")
    num_stages = num_ranks * n_virtual
    reference = one_f_one_b(num_ranks, n_microbatches) if n_virtual == 1 else \
        interleaved_1f1b(num_ranks, n_virtual, n_microbatches)
    peak = simulate(reference, num_stages).peak_activations
    return _list_schedule(num_ranks, num_stages, n_microbatches, lambda s: s % num_ranks,
                          {rank: int(peak[rank]) for rank in range(num_ranks)}, "interleaved_zero_bubble")


def zbv_zero_bubble(num_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-V: ``2 * num_ranks`` stages in the V placement (``v_placement``), compute
    actions ``F``/``I``/``W``, at most ``2 * num_ranks`` stage-activations per rank."""
    _check(num_ranks, n_microbatches, "zbv_zero_bubble")
    return _list_schedule(num_ranks, 2 * num_ranks, n_microbatches, v_placement(num_ranks),
                          {rank: 2 * num_ranks for rank in range(num_ranks)}, "zbv_zero_bubble")
