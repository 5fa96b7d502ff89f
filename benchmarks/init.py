#!/usr/bin/env python3
"""Building and initialising a large model sharded: peak memory per rank against the
rank's share of the parameters, and the time; hyper_parallel beside torch's own path, in
the same run (torch-cpu, gloo).

- hyper_parallel: the job's own build under ``--init-device meta`` (``train/loop.py``
  ``setup``): the decoder (``--preset``, default ``1b``) built inside the platform's meta
  scope, parallelized as the job does (``train.parallelize``: fully_shard per block and
  the root; tensor parallelism first with ``--tp``), then ``model.materialize_model``: each
  rank draws its boxes of the initial weights alone from core's counter-based stream
  (``model.initial_piece``) and holds nothing else (the embedding and the norms included).
- torch: the same decoder under ``torch.device("meta")``, torch's FSDP2
  (``torch.distributed.fsdp.fully_shard``) per block and the root, ``to_empty(device="cpu")``,
  then ``torch.nn.init.normal_(p, std=0.02)`` on each parameter (torch's DTensor random
  ops: ``OffsetBasedRNGTracker``) and the norms filled with ones: torchtitan's
  ``init_weights`` path. dp-shard only (no torch TP here).

Each configuration runs in a fresh pool of rank processes; peak = the process's peak RSS
(``memory_stats().peak``) minus its RSS before the build. share = this rank's parameter
values x 4 bytes. Time: the slowest rank, one build (the host is shared: indicative).

    python benchmarks/init.py [--preset 1b] [--world-size 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, write_results  # noqa: E402  (after the path insert)


def bench_rank(impl: str, preset: str, tp: int) -> dict:
    """Runs on every rank: build on meta, shard, initialise; this rank's numbers."""
    import torch

    import hyper_parallel as hp
    from hyper_parallel.core.process_groups import barrier
    from hyper_parallel.train.config import Layout
    from hyper_parallel.train.model import build_model, materialize_model
    from hyper_parallel.train.model_config import PRESETS

    p = hp.get_platform()
    n = p.world_size()
    cfg = PRESETS[preset]
    base = p.memory_stats().allocated
    barrier()
    start = time.perf_counter()
    if impl == "hyper_parallel":
        from hyper_parallel.train.parallelize import build_mesh, parallelize

        # what the job's setup does under --init-device meta (train/loop.py)
        layout = Layout(tp=tp, dp_shard=n // tp)
        mesh = build_mesh(p, layout)
        with p.module_types().meta_device():
            model = build_model(p, cfg, 0, values=False, meta=True)
            model = parallelize(model, mesh, layout, None)
        materialize_model(p, cfg, 0, [model])
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        with torch.device("meta"):
            model = build_model(p, cfg, 0, values=False)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    torch.nn.init.normal_(param, std=0.02)
    barrier()
    seconds = time.perf_counter() - start
    local = sum(int(t.to_local().numel() if hasattr(t, "to_local") else t.numel()) for t in model.parameters())
    return {"seconds": seconds, "peak_bytes": p.memory_stats().peak - base, "share_bytes": 4 * local}


def run(impl: str, world: int, tp: int, preset: str) -> dict:
    from hyper_parallel.testing import run_on_ranks

    from benchmarks.init import bench_rank as rank_fn  # importable by name on the ranks

    per_rank = run_on_ranks(rank_fn, world, impl, preset, tp, platform="torch-cpu", timeout_s=1800)
    worst = max(per_rank, key=lambda r: r["peak_bytes"])
    return {"impl": impl, "world_size": world, "tp": tp, "seconds": max(r["seconds"] for r in per_rank),
            "peak_mib": worst["peak_bytes"] / 2**20, "share_mib": worst["share_bytes"] / 2**20,
            "peak_over_share": worst["peak_bytes"] / max(worst["share_bytes"], 1)}


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"# Building and initialising `{args.preset}` sharded over {args.world_size} ranks (torch-cpu, gloo)", "",
             "peak: the largest rank's peak RSS minus its RSS before the build; share: that rank's parameter "
             "values x 4 bytes. seconds: slowest rank, one build, shared host (indicative).", "",
             "| path | layout | seconds | peak MiB | share MiB | peak / share |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        layout = f"tp {row['tp']} x dp-shard {row['world_size'] // row['tp']}" if row["tp"] > 1 else \
            f"dp-shard {row['world_size']}"
        name = "hyper_parallel meta + materialize" if row["impl"] == "hyper_parallel" else "torch meta + FSDP2 + init"
        lines.append(f"| {name} | {layout} | {row['seconds']:.1f} | {row['peak_mib']:.0f} | {row['share_mib']:.0f} | "
                     f"{row['peak_over_share']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "init")
    args = parser.parse_args()
    configs = [("hyper_parallel", 1), ("torch", 1)]
    if args.world_size % 2 == 0:
        configs.append(("hyper_parallel", 2))
    rows = [run(impl, args.world_size, tp, args.preset) for impl, tp in configs]
    meta = {"preset": args.preset, "world_size": args.world_size, "backend": "torch-cpu (gloo)", **host_meta()}
    write_results(args.out, meta, rows, markdown(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
