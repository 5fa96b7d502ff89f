#!/usr/bin/env python3
"""Per-call cost of small operations on MindSpore CPU ranks, with PyNative's asynchronous
dispatch (``MS_DEV_LAUNCH_BLOCKING=0``) and without it (``=1``, what the test harness and
CI give MindSpore CPU ranks), beside torch-cpu (gloo) on the same calls in the same run.

4 ranks, a float32 [7, 5] tensor (the size of the test suite's tensors: the cost is per
call, not per byte). Each call is followed by a read back to numpy, as a test's comparison
does. Timed on every rank after a barrier; the slowest rank per repetition, median over
``--iters``. ratio = MindSpore (launch blocking) / torch; speedup = async / blocking.

    python benchmarks/mindspore_dispatch.py [--iters 30] [--world-size 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, timed, write_results  # noqa: E402  (after the path insert)
from hyper_parallel.core.process_groups import barrier

#: The calls timed (each ends with a read back to numpy).
CALLS = ("local add", "all_reduce", "all_gather_into_tensor", "barrier", "redistribute Shard(0)->Replicate")
#: The launch-blocking variable, as the harness sets it.
BLOCKING_VAR = "MS_DEV_LAUNCH_BLOCKING"


def bench_rank(iters: int, warmup: int) -> dict[str, list[float]]:
    """Runs on every rank: seconds of each call of ``CALLS`` per repetition."""
    import numpy as np

    import hyper_parallel as hp

    p = hp.get_platform()
    n = p.world_size()
    mesh = hp.init_device_mesh(p.device_type, (n,))
    x = p.from_numpy(np.ones((7, 5), np.float32))
    shard = p.from_numpy(np.ones((2, 5), np.float32))
    calls = {
        "local add": lambda: p.to_numpy(x + 1.0),
        "all_reduce": lambda: p.to_numpy(p.all_reduce(x).wait()),
        "all_gather_into_tensor": lambda: p.to_numpy(p.all_gather_into_tensor(x).wait()),
        "barrier": lambda: barrier(),
        "redistribute Shard(0)->Replicate": lambda: p.to_numpy(
            hp.DTensor.from_local(shard, mesh, [hp.Shard(0)], shape=(2 * n, 5))
            .redistribute(mesh, [hp.Replicate()]).to_local()),
    }
    return {name: timed(calls[name], warmup, iters, lambda: barrier()) for name in CALLS}


def slowest_median_ms(per_rank: list[dict[str, list[float]]], name: str) -> float:
    reps = len(per_rank[0][name])
    return statistics.median(max(rank[name][i] for rank in per_rank) for i in range(reps)) * 1e3


def markdown(results: list[dict], world: int) -> str:
    lines = [
        f"# MindSpore CPU per-call cost: async dispatch vs launch blocking, beside torch ({world} ranks, CPU)",
        "",
        "float32 [7, 5], each call read back to numpy. Median of the slowest rank per repetition. "
        "ratio = MindSpore launch blocking / torch; speedup = MindSpore async / launch blocking.",
        "",
        "| call | MindSpore async ms | MindSpore launch blocking ms | torch ms | ratio | speedup |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for e in results:
        lines.append(f"| {e['call']} | {e['mindspore_async_ms']:.2f} | {e['mindspore_blocking_ms']:.2f} | "
                     f"{e['torch_ms']:.2f} | {e['ratio']:.2f} | {e['speedup']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "mindspore_dispatch")
    args = parser.parse_args()

    from hyper_parallel.testing import WorkerPool

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.mindspore_dispatch import bench_rank as rank_fn

    runs = {}
    for key, platform, env in (("mindspore_async", "mindspore-cpu", {BLOCKING_VAR: "0"}),
                               ("mindspore_blocking", "mindspore-cpu", {BLOCKING_VAR: "1"}),
                               ("torch", "torch-cpu", {})):
        with WorkerPool(platform, args.world_size, env=env) as pool:
            runs[key] = pool.run(rank_fn, args.iters, args.warmup, timeout_s=1800)
    results = []
    for name in CALLS:
        entry = {"call": name, **{f"{key}_ms": slowest_median_ms(per_rank, name) for key, per_rank in runs.items()}}
        entry["ratio"] = entry["mindspore_blocking_ms"] / entry["torch_ms"]
        entry["speedup"] = entry["mindspore_async_ms"] / entry["mindspore_blocking_ms"]
        results.append(entry)
    meta = {"world_size": args.world_size, "iters": args.iters, "warmup": args.warmup, **host_meta()}
    write_results(args.out, meta, results, markdown(results, args.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
