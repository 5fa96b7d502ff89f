"""Comparing schedules on the simulator: for given (ranks, microbatches, virtual stages,
memory limit), the predicted step time, bubble fraction and peak activation memory of
each schedule of ``schedule_table.SCHEDULES`` (GPipe, 1F1B, interleaved 1F1B, ZB-H1,
interleaved zero-bubble, ZB-V, DualPipeV), and whether it fits.
``python -m hyper_parallel.core.pipeline_parallel.compare --ranks 4
--microbatches 8 --virtual 2 --memory-limit 6`` prints the table."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.schedule_table import SCHEDULES
from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType
from hyper_parallel.core.pipeline_parallel.schedules.lowering import add_communication
from hyper_parallel.core.pipeline_parallel.schedules.simulator import DEFAULT_COSTS, simulate


@dataclass(frozen=True)
class ScheduleEstimate:
    """One schedule's prediction.

    Attributes:
        name: the schedule's name in ``schedule_table.SCHEDULES`` (``gpipe``, ``1f1b``,
            ``interleaved-1f1b``, ``zbh1``, ``interleaved-zero-bubble``, ``zbv``,
            ``dualpipev``; ``schedule_entry`` also takes this module's earlier spellings).
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
    of ``SCHEDULES`` runs: its ``stages_per_rank``, except the interleaved ones (loop
    placement, several stages per rank), which run ``n_virtual`` stages per rank and are
    left out for ``n_virtual = 1`` (they would be 1F1B and ZB-H1 again); ZB-V and
    DualPipeV two stages per rank in a V. A stage holding ``1 / k`` of a rank's share
    has its costs and activations scaled by ``1 / k``. A schedule whose generator
    refuses the configuration is left out (interleaved schedules with ``n_virtual > 1``
    need ``n_microbatches`` to be a multiple of ``num_ranks``; DualPipeV needs
    ``n_microbatches >= 2 * num_ranks``).

    Args:
        costs: seconds per action type of a rank's whole share (default
            ``DEFAULT_COSTS``: F 1, B 2, I 1, W 1; give I and W with B for the split
            backwards of the zero-bubble schedules, whose ``B`` is ``I + W``).
        memory_limit: activation units a rank may hold (one unit: a microbatch's
            activations of a rank's whole share).
        comm_latency: seconds from a send to its receive completing.

    Raises:
        ValueError: ``num_ranks``, ``n_microbatches`` or ``n_virtual`` below 1.
    """
    if num_ranks < 1 or n_microbatches < 1 or n_virtual < 1:
        raise ValueError(f"compare_schedules: num_ranks={num_ranks}, n_microbatches={n_microbatches} and "
                         f"n_virtual={n_virtual} must all be >= 1")
    out = []
    for name, entry in SCHEDULES.items():
        per_rank = entry.stages_per_rank
        if entry.placement == "loop" and per_rank > 1:  # interleaved: n_virtual stages per rank
            if n_virtual == 1:
                continue
            per_rank = n_virtual
        try:
            compute = entry.generate(num_ranks, n_microbatches, per_rank)
        except ValueError:  # e.g. DualPipeV with fewer than 2 x num_ranks microbatches
            continue
        num_stages, scale, place = num_ranks * per_rank, 1.0 / per_rank, entry.stage_to_rank(num_ranks)
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
