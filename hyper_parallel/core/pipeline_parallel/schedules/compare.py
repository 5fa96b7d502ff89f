"""Comparing schedules on the simulator: for given (ranks, microbatches, virtual stages,
memory limit), each schedule's (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble,
ZB-V, DualPipeV) predicted step time, bubble fraction and peak activation memory, and
whether it fits. ``python -m hyper_parallel.core.pipeline_parallel.schedules.compare
--ranks 4 --microbatches 8 --virtual 2 --memory-limit 6`` prints the table."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType, Schedule
from hyper_parallel.core.pipeline_parallel.schedules.dualpipe import dualpipe_v
from hyper_parallel.core.pipeline_parallel.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b
from hyper_parallel.core.pipeline_parallel.schedules.lowering import add_communication, loop_placement
from hyper_parallel.core.pipeline_parallel.schedules.simulator import DEFAULT_COSTS, simulate
from hyper_parallel.core.pipeline_parallel.schedules.zero_bubble import (interleaved_zero_bubble, v_placement,
                                                                         zbv_zero_bubble)


@dataclass(frozen=True)
class ScheduleEstimate:
    """One schedule's prediction.

    Attributes:
        name: the schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``,
            ``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dualpipe_v``).
        num_stages: stages of the pipeline it runs.
        step_time: seconds (in the units of the costs given).
        bubble_fraction: idle share of ``ranks x step_time``.
        peak_activations: the largest per-rank peak, in activation units of one stage's
            ``F`` (a stage of an interleaved schedule holds ``1 / virtual`` of a rank's
            layers, so its unit is scaled by ``1 / virtual`` here).
        fits: ``peak_activations <= memory_limit`` (True without a limit).
    """

    name: str
    num_stages: int
    step_time: float
    bubble_fraction: float
    peak_activations: float
    fits: bool


def compare_schedules(num_ranks: int, n_microbatches: int, n_virtual: int = 2, *,
                      memory_limit: float | None = None,
                      costs: dict[ActionType, float] | Callable[[Action], float] | None = None,
                      comm_latency: float = 0.0) -> list[ScheduleEstimate]:
    """Simulate every schedule that applies, lowered with point-to-point actions, and
    return their estimates, the fastest that fits ``memory_limit`` first.

    The model is one rank's share of the layers, split into the stages each schedule
    runs: GPipe and 1F1B one stage per rank (the whole share); interleaved 1F1B and
    interleaved zero-bubble ``n_virtual`` stages per rank (loop placement; with
    ``n_virtual = 1`` the zero-bubble schedule is ZB-H1); ZB-V and DualPipeV two
    stages per rank in a V. A stage holding ``1 / k`` of a rank's share has its costs
    and activations scaled by ``1 / k``. Interleaved schedules with ``n_virtual > 1``
    need ``n_microbatches`` to be a multiple of ``num_ranks`` and DualPipeV needs
    ``n_microbatches >= 2 * num_ranks``; a schedule whose condition fails is left out.

    Args:
        costs: seconds per action type of a rank's whole share (default
            ``DEFAULT_COSTS``: F 1, B 2, I 1, W 1; give I and W with B for the split
            backwards of the zero-bubble schedules, whose ``B`` is ``I + W``).
        memory_limit: activation units a rank may hold (one unit: a microbatch's
            activations of a rank's whole share).
        comm_latency: seconds from a send to its receive completing.

    Raises:
        ValueError: ``num_ranks``, ``n_microbatches`` or ``n_virtual`` below 1 (from
            the generators).
    """
    loop = loop_placement(num_ranks)
    vee = v_placement(num_ranks)
    candidates: list[tuple[str, Schedule, int, float, Callable[[int], int]]] = [
        ("gpipe", gpipe(num_ranks, n_microbatches), num_ranks, 1.0, loop),
        ("1f1b", one_f_one_b(num_ranks, n_microbatches), num_ranks, 1.0, loop),
    ]
    if n_virtual == 1 or n_microbatches % num_ranks == 0:
        if n_virtual > 1:
            candidates.append(("interleaved_1f1b", interleaved_1f1b(num_ranks, n_virtual, n_microbatches),
                               num_ranks * n_virtual, 1.0 / n_virtual, loop))
        candidates.append(("interleaved_zero_bubble", interleaved_zero_bubble(num_ranks, n_virtual, n_microbatches),
                           num_ranks * n_virtual, 1.0 / n_virtual, loop))
    candidates.append(("zbv_zero_bubble", zbv_zero_bubble(num_ranks, n_microbatches), 2 * num_ranks, 0.5, vee))
    if n_microbatches >= 2 * num_ranks:
        candidates.append(("dualpipe_v", dualpipe_v(num_ranks, n_microbatches), 2 * num_ranks, 0.5, vee))
    out = []
    for name, compute, num_stages, scale, place in candidates:
        if callable(costs):
            cost: Callable[[Action], float] | dict[ActionType, float] = (lambda a, c=costs, k=scale: c(a) * k)
        else:
            table = {**DEFAULT_COSTS, **(costs or {})}
            cost = {kind: value * scale for kind, value in table.items()}
        result = simulate(add_communication(compute, num_stages, place), num_stages, stage_to_rank=place,
                          costs=cost, comm_latency=comm_latency, activation_size=scale)
        peak = max(result.peak_activations.values())
        out.append(ScheduleEstimate(name, num_stages, result.step_time, result.bubble_fraction, peak,
                                    memory_limit is None or peak <= memory_limit))
    return sorted(out, key=lambda e: (not e.fits, e.step_time))


def format_table(estimates: list[ScheduleEstimate]) -> str:
    """A markdown table of ``estimates``."""
    lines = ["| schedule | stages | step time | bubble | peak activations | fits |", "|---|---|---|---|---|---|"]
    lines += [f"| {e.name} | {e.num_stages} | {e.step_time:.3f} | {e.bubble_fraction:.3f} | {e.peak_activations:.2f} "
              f"| {'yes' if e.fits else 'no'} |" for e in estimates]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--virtual", type=int, default=2)
    parser.add_argument("--memory-limit", type=float, default=None)
    parser.add_argument("--forward-cost", type=float, default=1.0)
    parser.add_argument("--backward-cost", type=float, default=2.0)
    parser.add_argument("--input-grad-cost", type=float, default=None,
                        help="cost of I (zero-bubble split backward); default half the backward cost")
    parser.add_argument("--weight-grad-cost", type=float, default=None,
                        help="cost of W (zero-bubble split backward); default half the backward cost")
    parser.add_argument("--comm-latency", type=float, default=0.0)
    args = parser.parse_args(argv)
    half = args.backward_cost / 2
    costs = {ActionType.F: args.forward_cost, ActionType.B: args.backward_cost,
             ActionType.I: half if args.input_grad_cost is None else args.input_grad_cost,
             ActionType.W: half if args.weight_grad_cost is None else args.weight_grad_cost}
    print(format_table(compare_schedules(args.ranks, args.microbatches, args.virtual, memory_limit=args.memory_limit,
                                         costs=costs, comm_latency=args.comm_latency)))


if __name__ == "__main__":
    main()
