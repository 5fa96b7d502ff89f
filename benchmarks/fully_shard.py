#!/usr/bin/env python3
"""Training step time and peak memory per rank: hyper_parallel's ``fully_shard`` beside
torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same model, in the same run.

Model: ``--blocks`` (default 8) residual MLP blocks ``x + W2 relu(W1 x)`` of width
``--dim`` and hidden ``4 * dim``, float32, each block a fully_shard unit, then the root;
AdamW; input ``[batch, seq, dim]`` per rank. gloo ranks on CPU (torch-cpu). Each
configuration runs in a fresh pool of rank processes, so the peak resident set size
(``memory_stats().peak``: the process peak RSS on CPU) belongs to that run alone; the
table gives the peak minus the RSS before the model was built (the model, its
gradients, optimizer state and activations). Step time: barrier, step, slowest rank,
median over ``--iters`` after ``--warmup``. Writes JSON and a markdown table.

    python benchmarks/fully_shard.py [--world-size 4] [--dim 512] [--iters 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, write_results  # noqa: E402  (after the path insert)
from hyper_parallel.core.process_groups import barrier


def bench_rank(impl: str, blocks: int, dim: int, batch: int, seq: int, iters: int, warmup: int) -> dict:
    """Runs on every rank: build, shard with ``impl``, train; this rank's numbers."""
    import numpy as np
    import torch

    import hyper_parallel as hp

    p = hp.get_platform()
    n, r = p.world_size(), p.rank()
    torch.manual_seed(0)
    base = p.memory_stats().allocated

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Linear(dim, 4 * dim)
            self.w2 = torch.nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.w2(torch.relu(self.w1(x)))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(blocks)])
            self.head = torch.nn.Linear(dim, dim)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    model = Model()
    if impl == "hyper_parallel":
        mesh = hp.init_device_mesh(p.device_type, (n,))
        for block in model.blocks:
            hp.fully_shard(block, mesh=mesh)
        hp.fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.from_numpy(np.random.default_rng(r).standard_normal((batch, seq, dim)).astype(np.float32))
    seconds = []
    for step in range(warmup + iters):
        barrier()
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            seconds.append(elapsed)
    # One more step under torch's CommDebugMode: the collectives each implementation issues
    # per step (the same counter for both: the c10d ops reaching the dispatcher).
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        model(x).pow(2).mean().backward()
    opt.zero_grad()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items() if n}
    return {"seconds": seconds, "peak_bytes": p.memory_stats().peak - base, "collectives": counts,
            "units": blocks + 1, "param_tensors": len(list(model.parameters())),
            # this rank's values: both implementations' parameters are DTensors of the global shape
            "params": sum(int(t.to_local().numel() if hasattr(t, "to_local") else t.numel())
                          for t in model.parameters())}


def run(impl: str, world: int, args: argparse.Namespace) -> dict:
    from hyper_parallel.testing import run_on_ranks

    from benchmarks.fully_shard import bench_rank as rank_fn  # importable by name on the ranks

    per_rank = run_on_ranks(rank_fn, world, impl, args.blocks, args.dim, args.batch, args.seq, args.iters,
                            args.warmup, platform="torch-cpu", timeout_s=1800)
    slowest = [max(rank["seconds"][i] for rank in per_rank) for i in range(args.iters)]
    return {"impl": impl, "world_size": world, "step_ms": statistics.median(slowest) * 1e3,
            "peak_mib": max(rank["peak_bytes"] for rank in per_rank) / 2**20,
            "local_params": per_rank[0]["params"], "collectives": per_rank[0]["collectives"],
            "units": per_rank[0]["units"], "param_tensors": per_rank[0]["param_tensors"]}


def comparison(rows: list[dict]) -> list[dict]:
    """Per world size: hyper_parallel / torch for step time and peak memory (below 1: ours is
    faster / smaller)."""
    by = {(row["impl"], row["world_size"]): row for row in rows}
    worlds = sorted({row["world_size"] for row in rows})
    return [{"world_size": w,
             "step_ratio": by[("hyper_parallel", w)]["step_ms"] / by[("torch", w)]["step_ms"],
             "peak_ratio": by[("hyper_parallel", w)]["peak_mib"] / max(by[("torch", w)]["peak_mib"], 1e-9)}
            for w in worlds if ("hyper_parallel", w) in by and ("torch", w) in by]


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    by = {(row["impl"], row["world_size"]): row for row in rows}
    lines = [f"# fully_shard: hyper_parallel vs torch FSDP2 ({args.blocks} blocks, dim {args.dim}, "
             f"batch {args.batch}x{args.seq} per rank, gloo, CPU)", "",
             "Step: median over iterations of the slowest rank. Peak: the largest rank's peak RSS minus its RSS "
             "before the model was built. ratio = hyper_parallel / torch (below 1: faster / smaller).", "",
             "| world | hyper_parallel step ms | torch step ms | ratio | hyper_parallel peak MiB | torch peak MiB "
             "| ratio | params on rank 0 | hyper_parallel collectives / step | torch collectives / step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for world in args.worlds:
        ours, theirs = by[("hyper_parallel", world)], by[("torch", world)]
        lines.append(f"| {world} | {ours['step_ms']:.1f} | {theirs['step_ms']:.1f} | "
                     f"{ours['step_ms'] / theirs['step_ms']:.2f} | {ours['peak_mib']:.1f} | {theirs['peak_mib']:.1f} | "
                     f"{ours['peak_mib'] / max(theirs['peak_mib'], 1e-9):.2f} | {ours['local_params']} | "
                     f"{_counts(ours)} | {_counts(theirs)} |")
    first = rows[0]
    lines += ["", f"Collectives per step (forward + backward, counted by torch's `CommDebugMode`): "
              f"{first['units']} units ({args.blocks} blocks and the root), {first['param_tensors']} parameter "
              "tensors; `reshard_after_forward=True`: each unit is all-gathered in the forward and again for its "
              "backward, except that FSDP2 keeps its root gathered after the root's forward (one all-gather "
              "fewer); one reduce-scatter per unit."]
    return "\n".join(lines) + "\n"


def _counts(row: dict) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(row["collectives"].items())) or "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fully_shard")
    args = parser.parse_args()
    rows = [run(impl, world, args) for world in args.worlds for impl in ("hyper_parallel", "torch")]
    meta = {"blocks": args.blocks, "dim": args.dim, "batch": args.batch, "seq": args.seq, "iters": args.iters,
            "warmup": args.warmup, "backend": "torch-cpu (gloo)", **host_meta()}
    write_results(args.out, meta, rows, markdown(rows, args), comparison=comparison(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
