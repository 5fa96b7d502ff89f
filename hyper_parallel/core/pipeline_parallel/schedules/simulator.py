"""Executing a schedule on a model of the machine: per-action costs, point-to-point
latency, activation memory. One engine serves the validator (zero costs: does every rank
finish, in dependency order?) and the simulator (when, and with how much memory).

Execution model: each rank runs its list in order. Compute actions wait for their inputs:
``F(s, m)`` for ``F(s-1, m)``; ``B``/``I(s, m)`` for ``F(s, m)`` and the gradient from
``s+1``; ``W(s, m)`` for ``I(s, m)``. Across ranks the input must have been received (a
``RECV`` earlier in the list) when the schedule is lowered, or comes implicitly when it
is compute-only. Sends never block (they are asynchronous, as ``isend`` is); a receive
waits for its matching send plus ``comm_latency``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType, Schedule

A = ActionType

#: seconds per action type when no cost is given: backward twice the forward.
DEFAULT_COSTS: dict[ActionType, float] = {A.F: 1.0, A.B: 2.0, A.I: 1.0, A.W: 1.0, A.SEND_F: 0.0, A.RECV_F: 0.0,
                                          A.SEND_B: 0.0, A.RECV_B: 0.0}


@dataclass(frozen=True)
class _Gradient:
    """The input gradient of ``stage`` for ``microbatch`` exists (made by its B or I)."""

    stage: int
    microbatch: int


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or duplicate action, an unmatched send or
    receive, an action placed on the wrong rank, or a deadlock."""


@dataclass
class SimulationResult:
    """What one run of a schedule costs.

    Attributes:
        step_time: seconds until the last rank finishes.
        busy_time: per rank, seconds spent in compute actions.
        bubble_fraction: ``1 - sum(busy_time) / (ranks * step_time)``.
        peak_activations: per rank, the most activation units held at once (a
            microbatch's activations are held from its ``F`` to its ``B``/``W``).
        finish_time: per rank, when its last action ends.
    """

    step_time: float
    busy_time: dict[int, float]
    bubble_fraction: float
    peak_activations: dict[int, float]
    finish_time: dict[int, float] = field(default_factory=dict)


def _deps(action: Action, num_stages: int, place: Callable[[int], int],
          lowered: bool) -> list[tuple[int, Action | _Gradient]]:
    """(rank, action) pairs that must be done before ``action`` starts."""
    if action.sub_actions:  # OVERLAP_B_F waits for both halves' inputs
        return [dep for part in action.sub_actions for dep in _deps(part, num_stages, place, lowered)]
    s, m = action.stage_index, action.microbatch_index
    here = place(s)
    deps: list[tuple[int, Action | _Gradient]] = []
    if action.type is A.F and s > 0:
        prev = place(s - 1)
        deps.append((here, Action(s, A.RECV_F, m)) if lowered and prev != here else (prev, Action(s - 1, A.F, m)))
    elif action.type in (A.B, A.I):
        deps.append((here, Action(s, A.F, m)))
        if s < num_stages - 1:
            nxt = place(s + 1)
            if lowered and nxt != here:
                deps.append((here, Action(s, A.RECV_B, m)))
            else:
                deps.append((nxt, _Gradient(s + 1, m)))
    elif action.type is A.W:
        deps.append((here, Action(s, A.I, m)))
    elif action.type is A.SEND_F:
        deps.append((here, Action(s, A.F, m)))
    elif action.type is A.SEND_B:
        deps.append((here, _Gradient(s, m)))
    elif action.type is A.RECV_F:
        deps.append((place(s - 1), Action(s - 1, A.SEND_F, m)))
    elif action.type is A.RECV_B:
        deps.append((place(s + 1), Action(s + 1, A.SEND_B, m)))
    return deps


def simulate(schedule: Schedule, num_stages: int, *, stage_to_rank: Callable[[int], int] | None = None,
             costs: dict[ActionType, float] | Callable[[Action], float] | None = None,
             comm_latency: float = 0.0, activation_size: float | Callable[[Action], float] = 1.0) -> SimulationResult:
    """Run ``schedule`` on the execution model above and measure it.

    Args:
        schedule: ``{rank: [Action, ...]}``, compute-only or lowered.
        num_stages: stages in the pipeline.
        stage_to_rank: placement (default: stage ``s`` on rank ``s % ranks``).
        costs: seconds per action type, or a function of the action (measured in a
            warm-up, say); default ``DEFAULT_COSTS``.
        comm_latency: seconds from a send to its receive completing.
        activation_size: activation units one ``F`` holds, or a function of the action.

    Raises:
        ScheduleError: the schedule deadlocks (names each stuck rank and what it waits for).
    """
    place = stage_to_rank or (lambda stage, n=len(schedule): stage % n)
    cost = costs if callable(costs) else (lambda a, table={**DEFAULT_COSTS, **(costs or {})}: table[a.type])
    size = activation_size if callable(activation_size) else (lambda a, v=activation_size: v)
    lowered = any(not a.type.is_compute for actions in schedule.values() for a in actions)
    done: dict[tuple[int, object], float] = {}  # (rank, action or grad key) -> completion time
    position = {rank: 0 for rank in schedule}
    clock = {rank: 0.0 for rank in schedule}
    busy = {rank: 0.0 for rank in schedule}
    held = {rank: 0.0 for rank in schedule}
    peak = {rank: 0.0 for rank in schedule}
    remaining = sum(len(actions) for actions in schedule.values())
    while remaining:
        progressed = False
        for rank, actions in schedule.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                deps = _deps(action, num_stages, place, lowered)
                if any(dep not in done for dep in deps):
                    break
                ready = max([clock[rank]] + [done[dep] + (comm_latency if action.type in (A.RECV_F, A.RECV_B)
                                                          else 0.0) for dep in deps])
                parts = action.sub_actions or (action,)
                # OVERLAP_B_F: the halves share one device, their costs add
                duration = sum(cost(part) for part in parts)
                end = ready + duration
                clock[rank] = end
                for part in parts:
                    done[(rank, part)] = end
                    if part.type in (A.B, A.I):
                        done[(rank, _Gradient(part.stage_index, part.microbatch_index))] = end
                    if part.type is A.F:
                        held[rank] += size(part)
                    elif part.type in (A.B, A.W):
                        held[rank] -= size(part)
                    peak[rank] = max(peak[rank], held[rank])
                if action.type.is_compute:
                    busy[rank] += duration
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {rank: str(actions[position[rank]]) for rank, actions in schedule.items()
                     if position[rank] < len(actions)}
            raise ScheduleError(f"schedule deadlocks: each rank waits at its next action, none can start: {stuck}; "
                                "check the order of sends, receives and the stages' dependencies")
    step = max(clock.values()) if clock else 0.0
    total_busy = sum(busy.values())
    bubble = 1.0 - total_busy / (len(schedule) * step) if step > 0 else 0.0
    return SimulationResult(step, busy, bubble, peak, dict(clock))
