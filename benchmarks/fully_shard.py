#!/usr/bin/env python3
"""Training step time and peak memory per rank: hyper_parallel's ``fully_shard`` beside
torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same model, in the same run.

Model: ``--blocks`` / ``--layers`` (default 8) residual MLP blocks ``x + W2 relu(W1 x)`` of
width ``--dim`` and hidden ``4 * dim``, float32, each block a fully_shard unit, then the
root; AdamW; input ``[batch, seq, dim]`` per rank. ``--device cpu`` (default): gloo ranks
(torch-cpu); each configuration runs in a fresh pool of rank processes, so the peak
resident set size (``memory_stats().peak``: the process peak RSS on CPU) belongs to that
run alone; the table gives the peak minus the RSS before the model was built (the model,
its gradients, optimizer state and activations). ``--device cuda``: NCCL ranks
(torch-cuda, one GPU per rank), model and data on the GPU, ``torch.cuda.synchronize()``
around each timed step, the peak ``torch.cuda.max_memory_allocated()`` minus what was
allocated before the model was built; results go to ``results/fully_shard_cuda`` unless
``--out`` says otherwise. Step time: barrier, step, slowest rank, median over ``--iters``
after ``--warmup``; with ``--repeats R`` each configuration runs R times, hyper_parallel
and torch alternating which goes first, and the table gives the median of the R medians
(a shared host's load drifts; each repeat's figures are in the JSON). Writes JSON and a
markdown table.

    python benchmarks/fully_shard.py [--worlds 1 2 4] [--dim 512] [--iters 5] [--repeats 3]
    python benchmarks/fully_shard.py --device cuda --worlds 1 --layers 32 --repeats 3

Where the time went (torch.profiler of 5 steps at world 1 and 2 against FSDP2's, 2 shared
CPU cores, before issue 37's item-1 changes): both spend the same in the matmuls (about
half a step) and in AdamW (about a third); the difference was copies (``aten::copy_``:
ours 140 ms per step at world 2, FSDP2's 88). Per step, with M the model's float32 bytes
(68 MB here) and N ranks, ours made beyond FSDP2's: a copy of each gathered parameter in
``GatherParam`` (M in all; FSDP2 hands the module its copied-out parameter as is), a copy
of each shard in ``WaitReduce`` (M / N), a zero-padding copy of each full gradient before
its reduce-scatter copy-in, even with no padding (M), a zero fill of the placeholder
gradient ``GatherParam.backward`` returns (M / N) and, at world 1, a copy per gather of a
shard held whole (2 M: forward and the backward's reload) and a multiply by one of each
gradient (``ReduceOp.AVG`` over one rank: M). All are gone: the ``GatherParam`` copy is
now the copy-out itself, made inside ``GatherParam`` (MindSpore needs a custom function's
output made inside it: [Note: gathered parameters and autograd] in ``hsdp_state``) from
the held all-gather output ([Note: flat all-gather copy-in] in ``param_group``);
``test_flat_collectives.py`` counts at most one copy per parameter per gather. Python overhead per parameter is not the difference: cProfile counts
about 24,000 Python calls per step for ours at world 2, 32,000 for FSDP2's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, write_results  # noqa: E402  (after the path insert)
from hyper_parallel.core.process_groups import barrier


def bench_rank(impl: str, blocks: int, dim: int, batch: int, seq: int, iters: int, warmup: int,
               device: str = "cpu") -> dict:
    """Runs on every rank: build on ``device`` (``"cpu"`` or ``"cuda"``), shard with
    ``impl``, train; this rank's numbers."""
    import numpy as np
    import torch

    import hyper_parallel as hp

    p = hp.get_platform()
    n, r = p.world_size(), p.rank()
    torch.manual_seed(0)
    cuda = device == "cuda"
    if cuda:  # this rank's GPU (set by init_process_group); the peak is counted from here
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = p.memory_stats().allocated

    def sync() -> None:  # a CUDA step has ended when its kernels have
        if cuda:
            torch.cuda.synchronize()

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

    target = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    with target:
        model = Model()
    if impl == "hyper_parallel":
        mesh = hp.init_device_mesh(p.device_type, (n,))
        for block in model.blocks:
            hp.fully_shard(block, mesh=mesh)
        hp.fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.from_numpy(np.random.default_rng(r).standard_normal((batch, seq, dim)).astype(np.float32)).to(target)
    seconds, cpu_seconds = [], []
    for step in range(warmup + iters):
        sync()
        barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if step >= warmup:
            seconds.append(elapsed)
            cpu_seconds.append(cpu)
    # One more step under torch's CommDebugMode: the collectives each implementation issues
    # per step (the same counter for both: the c10d ops reaching the dispatcher).
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        model(x).pow(2).mean().backward()
    opt.zero_grad()
    sync()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items() if n}
    peak = torch.cuda.max_memory_allocated() if cuda else p.memory_stats().peak
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_bytes": peak - base, "collectives": counts,
            "units": blocks + 1, "param_tensors": len(list(model.parameters())),
            # this rank's values: both implementations' parameters are DTensors of the global shape
            "params": sum(int(t.to_local().numel() if hasattr(t, "to_local") else t.numel())
                          for t in model.parameters())}


PLATFORMS = {"cpu": "torch-cpu", "cuda": "torch-cuda"}


def run(impl: str, world: int, args: argparse.Namespace) -> dict:
    """One configuration in a fresh pool of ``world`` ranks: the median step of the slowest
    rank (ms), the largest rank's peak (MiB) and what each issued."""
    from hyper_parallel.testing import run_on_ranks

    from benchmarks.fully_shard import bench_rank as rank_fn  # importable by name on the ranks

    per_rank = run_on_ranks(rank_fn, world, impl, args.blocks, args.dim, args.batch, args.seq, args.iters,
                            args.warmup, args.device, platform=PLATFORMS[args.device], timeout_s=1800)
    slowest = [max(rank["seconds"][i] for rank in per_rank) for i in range(args.iters)]
    busiest = [max(rank["cpu_seconds"][i] for rank in per_rank) for i in range(args.iters)]
    return {"impl": impl, "world_size": world, "step_ms": statistics.median(slowest) * 1e3,
            "cpu_ms": statistics.median(busiest) * 1e3,
            "peak_mib": max(rank["peak_bytes"] for rank in per_rank) / 2**20,
            "local_params": per_rank[0]["params"], "collectives": per_rank[0]["collectives"],
            "units": per_rank[0]["units"], "param_tensors": per_rank[0]["param_tensors"]}


def repeated(world: int, args: argparse.Namespace) -> list[dict]:
    """Both implementations at ``world``, ``args.repeats`` times, alternating which runs
    first; per implementation the median of the repeats' step times and peaks, with the
    repeats' own figures under ``step_ms_repeats`` / ``peak_mib_repeats``."""
    impls = ("hyper_parallel", "torch")
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for repeat in range(args.repeats):
        for impl in impls if repeat % 2 == 0 else impls[::-1]:
            runs[impl].append(run(impl, world, args))
    rows = []
    for impl in impls:
        row = dict(runs[impl][0])
        row["step_ms_repeats"] = [r["step_ms"] for r in runs[impl]]
        row["cpu_ms_repeats"] = [r["cpu_ms"] for r in runs[impl]]
        row["peak_mib_repeats"] = [r["peak_mib"] for r in runs[impl]]
        row["step_ms"] = statistics.median(row["step_ms_repeats"])
        row["cpu_ms"] = statistics.median(row["cpu_ms_repeats"])
        row["peak_mib"] = statistics.median(row["peak_mib_repeats"])
        rows.append(row)
    return rows


def comparison(rows: list[dict]) -> list[dict]:
    """Per world size: hyper_parallel / torch for step time and peak memory (below 1: ours is
    faster / smaller)."""
    by = {(row["impl"], row["world_size"]): row for row in rows}
    worlds = sorted({row["world_size"] for row in rows})
    return [{"world_size": w,
             "step_ratio": by[("hyper_parallel", w)]["step_ms"] / by[("torch", w)]["step_ms"],
             "cpu_step_ratio": by[("hyper_parallel", w)]["cpu_ms"] / by[("torch", w)]["cpu_ms"],
             "peak_ratio": by[("hyper_parallel", w)]["peak_mib"] / max(by[("torch", w)]["peak_mib"], 1e-9)}
            for w in worlds if ("hyper_parallel", w) in by and ("torch", w) in by]


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    by = {(row["impl"], row["world_size"]): row for row in rows}
    where = "NCCL, CUDA" if args.device == "cuda" else "gloo, CPU"
    peak = ("peak `torch.cuda.max_memory_allocated()` minus what was allocated" if args.device == "cuda"
            else "peak RSS minus its RSS")
    repeats = (f", median of {args.repeats} repeats (the two implementations alternating which runs first)"
               if args.repeats > 1 else "")
    lines = [f"# fully_shard: hyper_parallel vs torch FSDP2 ({args.blocks} blocks, dim {args.dim}, "
             f"batch {args.batch}x{args.seq} per rank, {where})", "",
             f"Step: median over iterations of the slowest rank{repeats}. CPU: the process CPU time of a step "
             "(all its threads), median over iterations of the busiest rank: less sensitive than the step time "
             f"to other processes on a shared host. Peak: the largest rank's {peak} "
             "before the model was built. ratio = hyper_parallel / torch (below 1: faster / smaller). "
             f"Load average before the runs: {args.load}.", "",
             "| world | hyper_parallel step ms | torch step ms | ratio | hyper_parallel CPU ms | torch CPU ms | ratio "
             "| hyper_parallel peak MiB | torch peak MiB "
             "| ratio | params on rank 0 | hyper_parallel collectives / step | torch collectives / step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for world in args.worlds:
        ours, theirs = by[("hyper_parallel", world)], by[("torch", world)]
        lines.append(f"| {world} | {ours['step_ms']:.1f} | {theirs['step_ms']:.1f} | "
                     f"{ours['step_ms'] / theirs['step_ms']:.2f} | {ours['cpu_ms']:.1f} | {theirs['cpu_ms']:.1f} | "
                     f"{ours['cpu_ms'] / theirs['cpu_ms']:.2f} | {ours['peak_mib']:.1f} | {theirs['peak_mib']:.1f} | "
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
    parser.add_argument("--device", choices=sorted(PLATFORMS), default="cpu",
                        help="cpu: gloo ranks (torch-cpu); cuda: NCCL ranks, one GPU each (torch-cuda)")
    parser.add_argument("--blocks", "--layers", dest="blocks", type=int, default=8,
                        help="residual MLP blocks, each a fully_shard unit")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each configuration, alternating which implementation goes first")
    parser.add_argument("--out", type=Path, default=None,
                        help="results path without suffix (default: results/fully_shard, results/fully_shard_cuda "
                             "with --device cuda)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: run each configuration at least once")
    if args.out is None:
        args.out = REPO / "benchmarks" / "results" / ("fully_shard_cuda" if args.device == "cuda" else "fully_shard")
    meta = {"blocks": args.blocks, "dim": args.dim, "batch": args.batch, "seq": args.seq, "iters": args.iters,
            "warmup": args.warmup, "repeats": args.repeats,
            "backend": "torch-cuda (nccl)" if args.device == "cuda" else "torch-cpu (gloo)", **host_meta()}
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False (a CUDA build of torch and a GPU needed)")
        if max(args.worlds) > torch.cuda.device_count():
            parser.error(f"--worlds {' '.join(map(str, args.worlds))} --device cuda: one GPU per rank, and "
                         f"{torch.cuda.device_count()} visible; e.g. --worlds 1")
        meta.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=str(torch.version.cuda))
    args.load = meta["load_average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())  # before the runs
    rows = [row for world in args.worlds for row in repeated(world, args)]
    write_results(args.out, meta, rows, markdown(rows, args), comparison=comparison(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
