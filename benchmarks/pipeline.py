#!/usr/bin/env python3
"""Step time and bubble per pipeline schedule: hyper_parallel's runtime beside the
simulator's prediction and beside torch.distributed.pipelining's same schedule, in the
same run.

4 ranks on gloo (torch-cpu). The model: ``stages x layers`` ``tanh(Linear(dim, dim))``
layers, each stage a slice; a mean-squared-error loss; ``--microbatches`` microbatches of
``--batch / microbatches`` rows. Per schedule of the core's table
(``hyper_parallel.core.pipeline_parallel.SCHEDULES``: GPipe, 1F1B, interleaved 1F1B with 2
stages per rank, ZB-H1, interleaved zero bubble (ZB-H1, 2 stages per rank), ZB-V and
DualPipeV (2 V-placed stages per rank)), beside torch's class of the same schedule:
barrier, one ``step`` (forward and backward of every microbatch), timed on every rank; the step's time is the slowest rank's; the median over ``--iters``
repetitions after ``--warmup`` is reported.

Bubble (measured): ``1 - busy / step`` averaged over ranks, where a rank's busy time is its
microbatches' forward and backward compute, timed alone on that rank before the run (the
per-action costs measured in a warm-up, which also feed the simulator). Predicted: the
simulator on the same lowered schedule with those costs (``I`` and ``W`` half a backward each).

    python benchmarks/pipeline.py [--dim 256] [--microbatches 8] [--iters 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, timed, write_results  # noqa: E402  (after the path insert)

#: torch.distributed.pipelining's class of each schedule of our table, by name (ZB-H1 is
#: its ScheduleInterleavedZeroBubble on one stage per rank)
TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                 "zbh1": "ScheduleInterleavedZeroBubble", "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
                 "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def _chain(n_layers: int, dim: int, seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(*[m for _ in range(n_layers) for m in (torch.nn.Linear(dim, dim), torch.nn.Tanh())])


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _median_slowest(times: list[float]) -> list[float]:
    import torch

    import torch.distributed as dist

    gathered = [torch.zeros(len(times)) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor(times))
    return [max(float(g[i]) for g in gathered) for i in range(len(times))]


def bench_rank(dim: int, layers: int, batch: int, n_microbatches: int, iters: int, warmup: int) -> list[dict]:
    """Runs on every rank; returns rows (the same on every rank: times are the slowest rank's)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp

    import hyper_parallel as hp
    from hyper_parallel.core.pipeline_parallel import SCHEDULES
    from hyper_parallel.core.pipeline_parallel.schedules import ActionType, simulate

    p = hp.get_platform()
    n, r = p.world_size(), p.rank()
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(0))
    y = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1))
    rows = []
    for name, entry in SCHEDULES.items():
        virtual = entry.stages_per_rank
        num_stages = entry.num_stages(n)
        per_stage = max(1, layers // virtual)  # the same model whatever the schedule
        local = entry.stages_of(n, r)
        last_rank = entry.stage_to_rank(n)(num_stages - 1)
        modules = {s: _chain(per_stage, dim, seed=s) for s in local}

        # per-action costs, measured alone on this rank (forward + backward of one microbatch)
        mb = x[: batch // n_microbatches]
        f_times, b_times = [], []
        for _ in range(3):
            for s in local:
                start = time.perf_counter()
                out = modules[s](mb)
                f_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                out.sum().backward()
                b_times.append(time.perf_counter() - start)
        f_cost = statistics.median(_median_slowest(f_times))
        b_cost = statistics.median(_median_slowest(b_times))
        for module in modules.values():
            module.zero_grad()

        # both infer the stages' placement from the schedule
        ours = entry.schedule_class([hp.PipelineStage(modules[s], s, num_stages) for s in local], n_microbatches, _loss)
        torch_stages = [tpp.PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in local]
        torch_class = getattr(tpp, TORCH_CLASSES[name])
        theirs = (torch_class(torch_stages, n_microbatches, loss_fn=_loss) if virtual > 1 or "Interleaved" in
                  TORCH_CLASSES[name] else torch_class(torch_stages[0], n_microbatches, loss_fn=_loss))

        kwargs = {"target": y} if r == last_rank else {}

        def run_ours() -> None:
            ours.step(x, **kwargs) if r == 0 else ours.step(**kwargs)

        def run_theirs() -> None:
            theirs.step(x, **kwargs) if r == 0 else theirs.step(**kwargs)

        measured = {}
        for impl, fn in (("hyper_parallel", run_ours), ("torch", run_theirs)):
            times = timed(fn, warmup, iters, dist.barrier)
            measured[impl] = statistics.median(_median_slowest(times))
        busy = n_microbatches * virtual * (f_cost + b_cost)
        # I and W: half the measured backward each (a linear layer's two matmuls)
        predicted = simulate(ours.schedule, num_stages, stage_to_rank=entry.stage_to_rank(n),
                             costs={ActionType.F: f_cost, ActionType.B: b_cost, ActionType.I: b_cost / 2,
                                    ActionType.W: b_cost / 2})
        rows.append({"schedule": name, "stages": num_stages, "microbatches": n_microbatches,
                     "forward_ms": f_cost * 1e3, "backward_ms": b_cost * 1e3,
                     "hyper_parallel_ms": measured["hyper_parallel"] * 1e3, "torch_ms": measured["torch"] * 1e3,
                     "predicted_ms": predicted.step_time * 1e3,
                     "hyper_parallel_bubble": max(0.0, 1 - busy / measured["hyper_parallel"]),
                     "torch_bubble": max(0.0, 1 - busy / measured["torch"]),
                     "predicted_bubble": predicted.bubble_fraction,
                     "ratio": measured["hyper_parallel"] / measured["torch"]})
    return rows


def markdown(rows: list[dict], world: int, meta: dict) -> str:
    lines = [
        f"# Pipeline schedules: hyper_parallel vs torch.distributed.pipelining ({world} ranks, gloo, CPU)",
        "",
        f"dim {meta['dim']}, {meta['layers']} layers per rank, batch {meta['batch']}. Median of the slowest rank "
        "per step. ratio = ours / torch step time (below 1: faster). Bubble = 1 - busy/step with busy from per-action costs measured alone; predicted = the "
        "simulator with those costs.",
        "",
        "| schedule | stages | microbatches | F ms | B ms | ours ms | torch ms | predicted ms | ours bubble "
        "| torch bubble | predicted bubble | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in rows:
        lines.append(f"| {e['schedule']} | {e['stages']} | {e['microbatches']} | {e['forward_ms']:.2f} | "
                     f"{e['backward_ms']:.2f} | {e['hyper_parallel_ms']:.1f} | {e['torch_ms']:.1f} | "
                     f"{e['predicted_ms']:.1f} | {e['hyper_parallel_bubble']:.2f} | {e['torch_bubble']:.2f} | "
                     f"{e['predicted_bubble']:.2f} | {e['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="layers per rank")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "pipeline")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks

    from benchmarks.pipeline import bench_rank as rank_fn  # the ranks import it by name

    per_rank = run_on_ranks(rank_fn, args.world_size, args.dim, args.layers, args.batch, args.microbatches,
                            args.iters, args.warmup, platform="torch-cpu", timeout_s=1800)
    rows = per_rank[0]
    meta = {"world_size": args.world_size, "backend": "torch-cpu (gloo)", "dim": args.dim, "layers": args.layers,
            "batch": args.batch, "iters": args.iters, "warmup": args.warmup, **host_meta()}
    write_results(args.out, meta, rows, markdown(rows, args.world_size, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
