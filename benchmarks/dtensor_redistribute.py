#!/usr/bin/env python3
"""Time per ``redistribute`` for the common transitions, hyper_parallel's DTensor beside
torch's own ``torch.distributed.tensor`` on the same shapes, in the same run.

4 ranks on gloo (torch-cpu), a float32 global tensor of each size, 1-D mesh. Each
measurement: barrier, then the redistribution (result materialized), timed on every rank;
the step's time is the slowest rank's; the median over ``--iters`` repetitions after
``--warmup`` is reported. Writes JSON and a markdown table with the ratio ours/torch
(below 1: we are faster).

    python benchmarks/dtensor_redistribute.py [--sizes-mib 1 4 16 64] [--iters 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, timed, write_results  # noqa: E402  (after the path insert)

# (name, source placement, target placement, the collective it takes)
TRANSITIONS = [
    ("Shard(0)->Replicate", "S0", "R", "all-gather"),
    ("Partial->Replicate", "P", "R", "all-reduce"),
    ("Partial->Shard(0)", "P", "S0", "reduce-scatter"),
    ("Shard(0)->Shard(1)", "S0", "S1", "all-to-all"),
    ("Replicate->Shard(0)", "R", "S0", "none (local chunk)"),
]


def _placement(code: str, module) -> object:
    return {"S0": module.Shard(0), "S1": module.Shard(1), "R": module.Replicate(), "P": module.Partial()}[code]


def bench_rank(sizes_mib: list[float], iters: int, warmup: int) -> list[dict]:
    """Runs on every rank: times both implementations; returns this rank's seconds."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import hyper_parallel as hp

    p = hp.get_platform()
    n = p.world_size()
    ours_mesh = hp.init_device_mesh(p.device_type, (n,))
    torch_device_mesh = torch_mesh("cpu", (n,))
    rows_out = []
    for size_mib in sizes_mib:
        cols = 1024
        rows = max(n, int(size_mib * 2**20 / 4 / cols) // n * n)
        shape = (rows, cols)
        full = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        for name, src, dst, collective in TRANSITIONS:
            locals_ = {
                "S0": np.ascontiguousarray(np.split(full, n, axis=0)[p.rank()]),
                "R": full, "P": full / n,
            }
            src_local = torch.from_numpy(locals_[src].copy())

            def ours() -> None:
                dt = hp.DTensor.from_local(src_local, ours_mesh, [_placement(src, hp)], shape=shape)
                out = dt.redistribute(ours_mesh, [_placement(dst, hp)]).to_local()
                float(out.reshape(-1)[0])

            def theirs() -> None:
                dt = tdt.DTensor.from_local(src_local, torch_device_mesh, [_placement(src, tdt)], run_check=False,
                                            shape=torch.Size(shape), stride=(cols, 1))
                out = dt.redistribute(torch_device_mesh, [_placement(dst, tdt)]).to_local()
                if hasattr(out, "wait"):
                    out = out.wait()  # functional collectives may hand back a lazy tensor
                float(out.reshape(-1)[0])

            for impl, fn in (("hyper_parallel", ours), ("torch", theirs)):
                with torch.no_grad():
                    times = timed(fn, warmup, iters, dist.barrier)
                rows_out.append({"transition": name, "collective": collective, "size_mib": size_mib,
                                 "shape": list(shape), "impl": impl, "seconds": times})
    return rows_out


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """Slowest rank per repetition, median over repetitions, ours/torch ratio."""
    merged: dict[tuple, dict] = {}
    for row_index, row in enumerate(per_rank[0]):
        slowest = [max(rank_rows[row_index]["seconds"][i] for rank_rows in per_rank)
                   for i in range(len(row["seconds"]))]
        key = (row["transition"], row["size_mib"])
        entry = merged.setdefault(key, {"transition": row["transition"], "collective": row["collective"],
                                        "size_mib": row["size_mib"], "shape": row["shape"]})
        entry[f"{row['impl']}_ms"] = statistics.median(slowest) * 1e3
    results = list(merged.values())
    for entry in results:
        entry["ratio"] = entry["hyper_parallel_ms"] / entry["torch_ms"] if entry["torch_ms"] > 0 else float("nan")
    return results


def markdown(results: list[dict], world: int) -> str:
    lines = [
        f"# DTensor redistribute: hyper_parallel vs torch.distributed.tensor ({world} ranks, gloo, CPU)",
        "",
        "Median of the slowest rank per repetition. ratio = hyper_parallel / torch (below 1: faster).",
        "",
        "| transition | collective | MiB | shape | hyper_parallel ms | torch ms | ratio |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for e in results:
        lines.append(f"| {e['transition']} | {e['collective']} | {e['size_mib']:g} | {tuple(e['shape'])} | "
                     f"{e['hyper_parallel_ms']:.2f} | {e['torch_ms']:.2f} | {e['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dtensor_redistribute")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.dtensor_redistribute import bench_rank as rank_fn

    per_rank = run_on_ranks(rank_fn, args.world_size, args.sizes_mib, args.iters, args.warmup,
                            platform="torch-cpu", timeout_s=1800)
    results = summarize(per_rank)
    meta = {"world_size": args.world_size, "backend": "torch-cpu (gloo)", "iters": args.iters,
            "warmup": args.warmup, **host_meta()}
    write_results(args.out, meta, results, markdown(results, args.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
