#!/usr/bin/env python3
"""Step time and tokens/s of the ``hyper-parallel train`` MoE decoder on a pipeline with expert
parallelism, with and without ``--ep-overlap``, in the same run.

4 ranks on gloo (torch-cpu): ``--model`` (``moe-small``: 4 blocks, each an MoE of 8 routed
experts, top-2, a shared expert) on pp 2 x dp-shard 2 x ep 2 with ``--pp-schedule`` (1F1B by
default; ``interleaved-1f1b``; ``dualpipev``, whose pairs are its own and whose split backwards'
weight gradients reach fully_shard once per step) over ``--microbatches``, through the job's own ``setup`` and ``train`` (forward, backward, the
routing all-reduce, global-norm clipping, AdamW). Each layout runs ``--warmup + --iters``
steps; a step's time (``loop._train_step``, after a barrier) is the slowest rank's; the median over the timed steps
is reported, with tokens/s (``batch x seq`` per step) and the ratio overlap / plain (below 1:
the overlap is faster). With the overlap the rows also give, per step and thread, the
seconds the two threads spent blocked at the dispatch/combine rendezvous (the hooks'
timestamps: ``HookCoordinator.waited_s``, slowest rank) and the rendezvous they met at.
The losses of the two runs are compared (float32: the overlap reduce-scatters each
fully_shard unit's summed gradient once, the plain run per microbatch).

What this host can show: the two threads of a rank and its collectives share two cores with
the other three ranks, and the overlap runs its segments one at a time ([Note: serial
tails] in ``core/pipeline_parallel/hook_coordinator.py``), so only the all-to-alls issued
before a switch run under the other thread's compute; on CPU with gloo that hides little.
The time a rank waits on the all-to-alls themselves is not separable here: torch's
asynchronous all-to-all is waited for at its first use inside the next compute segment,
and in the backward inside the all-to-all's own autograd node; torch's profiler, which
would see those waits (``_c10d_functional::wait_tensor``), records the calling thread
only, not the overlap's two threads.

torchtitan's recipe (its ``ExpertParallel`` and MoE on the same model) does not run on
this machine: torchtitan 0.2.2's ``ExpertParallel._token_dispatch`` permutes the received
tokens with a Triton kernel (``moe/kernels.py``, ``generate_permute_indices`` without its
CPU path), which needs a GPU driver ("0 active drivers"), and torchtitan 0.3.0 needs a
nightly torch and ``spmd_types``. The comparison belongs to a run on a GPU.

    python benchmarks/moe.py [--iters 5] [--seq-len 128] [--batch-size 8] [--microbatches 4]
                             [--pp-schedule 1f1b|interleaved-1f1b|dualpipev]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import add_step_arguments, host_meta, write_results  # noqa: E402  (after the path insert)


def bench_rank(model_name: str, seq_len: int, batch_size: int, microbatches: int, iters: int,
               warmup: int, pp_schedule: str = "1f1b") -> list[dict]:
    """Runs on every rank: the job's step (``loop._train_step``, then ``balance_step`` as the
    loop runs it) on both layouts; returns this rank's per-step seconds, losses and
    (overlap) rendezvous waits."""
    import time

    from hyper_parallel.core.pipeline_parallel.hook_coordinator import BACKWARD, FORWARD
    from hyper_parallel.core.process_groups import barrier
    from hyper_parallel.train.config import PRESETS, Layout, TrainConfig
    from hyper_parallel.train.loop import _train_step, setup
    from hyper_parallel.train.moe_model import balance_step

    rows = []
    with tempfile.TemporaryDirectory() as out:
        for overlap in (False, True):
            layout = Layout(pp=2, dp_shard=2, ep=2, microbatches=microbatches, ep_overlap=overlap,
                            pp_schedule=pp_schedule)
            cfg = TrainConfig(platform="torch", nproc=4, layout=layout, model=PRESETS[model_name],
                              model_name=model_name, data=(str(Path(json.__file__).parent),), seq_len=seq_len,
                              batch_size=batch_size, steps=warmup + iters, lr=1e-3, warmup_steps=2,
                              eval_batches=1, checkpoint_every=0, out=f"{out}/{overlap}", progress=False)
            run = setup(cfg)
            coordinator = run.pipe.schedule.overlap.coordinator if overlap else None
            seconds, losses, waits, paired = [], [], [], []
            for step in range(1, warmup + iters + 1):
                before = dict(coordinator.waited_s) if coordinator else {}
                met = coordinator.paired if coordinator else 0
                barrier()
                began = time.perf_counter()
                loss, _ = _train_step(run, step)
                seconds.append(time.perf_counter() - began)
                balance_step(run.p, run.moe, run.balance_group, cfg.model)
                losses.append(loss)
                if coordinator:
                    waits.append({side: coordinator.waited_s[side] - before[side] for side in (FORWARD, BACKWARD)})
                    paired.append(coordinator.paired - met)
            rows.append({"overlap": overlap, "seconds": seconds[warmup:], "losses": losses, "waits": waits[warmup:],
                         "paired": paired[warmup:]})
    return rows


def summarize(per_rank: list[list[dict]], tokens: int) -> list[dict]:
    out = []
    for index, row in enumerate(per_rank[0]):
        slowest = [max(rank_rows[index]["seconds"][i] for rank_rows in per_rank) for i in range(len(row["seconds"]))]
        entry = {"what": "--ep-overlap" if row["overlap"] else "plain", "tokens_per_step": tokens,
                 "step_ms": statistics.median(slowest) * 1e3, "tokens_per_s": tokens / statistics.median(slowest),
                 "losses": row["losses"]}
        if row["overlap"]:
            for side in ("forward", "backward"):
                entry[f"{side}_rendezvous_wait_ms"] = statistics.median(
                    max(rank_rows[index]["waits"][i][side] for rank_rows in per_rank)
                    for i in range(len(row["waits"]))) * 1e3
            entry["rendezvous_per_step"] = statistics.median(
                sum(rank_rows[index]["paired"][i] for rank_rows in per_rank) for i in range(len(row["paired"])))
        out.append(entry)
    plain, overlap = out
    overlap["ratio"] = overlap["step_ms"] / plain["step_ms"]
    worst = max(abs(a / b - 1) for a, b in zip(overlap["losses"], plain["losses"]))
    if worst > 1e-4:  # the same computation: see the docstring
        raise RuntimeError(f"--ep-overlap diverged from the plain pipeline: {overlap['losses']} vs {plain['losses']}")
    return out


def markdown(results: list[dict], meta: dict) -> str:
    plain, overlap = results
    lines = [
        f"# MoE pipeline step with and without --ep-overlap ({meta['world_size']} ranks, gloo, CPU, model "
        f"{meta['model']}, pp 2 x dp-shard 2 x ep 2, {meta['pp_schedule']}, {meta['microbatches']} microbatches, seq "
        f"{meta['seq_len']}, batch {meta['batch_size']})",
        "",
        "Median of the slowest rank per step (the job's step, loop._train_step). ratio = overlap / plain (below 1: faster). "
        "Rendezvous wait: seconds per step the thread spent blocked at the dispatch/combine hooks (slowest rank); "
        "rendezvous: hook pairings per step over the ranks.",
        "",
        "| run | tokens | step ms | tok/s | ratio | forward wait ms | backward wait ms | rendezvous |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| plain | {plain['tokens_per_step']} | {plain['step_ms']:.1f} | {plain['tokens_per_s']:.0f} | 1.00 | - | - "
        "| - |",
        f"| --ep-overlap | {overlap['tokens_per_step']} | {overlap['step_ms']:.1f} | {overlap['tokens_per_s']:.0f} | "
        f"{overlap['ratio']:.2f} | {overlap['forward_rendezvous_wait_ms']:.1f} | "
        f"{overlap['backward_rendezvous_wait_ms']:.1f} | {overlap['rendezvous_per_step']:.0f} |",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, iters=5, warmup=2)
    parser.set_defaults(model="moe-small")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--pp-schedule", default="1f1b", choices=("1f1b", "interleaved-1f1b", "dualpipev"))
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem (default: benchmarks/results/moe, or moe_<schedule> for another schedule)")
    args = parser.parse_args()
    stem = "moe" if args.pp_schedule == "1f1b" else f"moe_{args.pp_schedule.replace('-', '_')}"
    args.out = args.out or REPO / "benchmarks" / "results" / stem

    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.moe import bench_rank as rank_fn

    per_rank = run_on_ranks(rank_fn, 4, args.model, args.seq_len, args.batch_size, args.microbatches, args.iters,
                            args.warmup, args.pp_schedule, platform="torch-cpu", timeout_s=1800)
    results = summarize(per_rank, args.seq_len * args.batch_size)
    meta = {"world_size": 4, "backend": "torch-cpu (gloo)", "model": args.model, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "microbatches": args.microbatches, "pp_schedule": args.pp_schedule,
            "iters": args.iters,
            "warmup": args.warmup, **host_meta()}
    write_results(args.out, meta, results, markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
