#!/usr/bin/env python3
"""Activation checkpointing: step time, peak memory and activation memory kept for the
backward, with and without checkpointing each decoder block, hyper_parallel beside the
torch-native equivalent in the same run.

Model: the ``hyper-parallel train`` decoder (``--model``, default ``small``: dim 128, 4
blocks, SwiGLU hidden 352), float32, input ``[--batch, --seq]`` byte tokens per rank;
forward, backward and AdamW. Per world size:

- world 1: hyper_parallel's ``checkpoint_wrapper`` (in place, ``platform.recompute``) on
  every block vs torch's ``checkpoint_wrapper(CheckpointImpl.NO_REENTRANT)`` (which calls
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``); modes ``off``, ``full``
  and ``selective``: the matrix products and the attention kept (``SAVED_OPS``), ours
  with ``policy_fn``, torch's with ``context_fn=create_selective_checkpoint_contexts``;
- world > 1: the same, then each block and the root fully sharded: hyper_parallel's
  ``fully_shard`` vs torch FSDP2 (``torch.distributed.fsdp.fully_shard``), the
  torchtitan order (checkpointing, then FSDP).

Columns: step time (barrier, step, slowest rank, median over ``--iters`` after
``--warmup``); peak memory (``memory_stats().peak`` minus the value before the model was
built: the process peak RSS on CPU, so each configuration runs in a fresh pool of rank
processes); saved activations (bytes of the distinct tensors autograd keeps from the
forward for the backward, parameters excluded, measured with an outer
``torch.autograd.graph.saved_tensors_hooks``: inside a checkpointed block the
checkpoint's own hooks take every save, so what the outer hooks see is what stays; world 1
only, as fully_shard's own saved-tensor hooks are innermost under it; the outputs selective
checkpointing keeps are held by its dispatch modes, not saved: they count in the peak only).
gloo ranks on CPU (torch-cpu). Writes JSON and a markdown table.

    python benchmarks/activation_checkpoint.py [--worlds 1 2] [--model small] [--seq 256]
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


MODES = ("off", "full", "selective")


def saved_ops() -> tuple:
    """The operations selective checkpointing keeps (torchtitan's choice: matrix products
    and the attention kernel)."""
    import torch

    aten = torch.ops.aten
    return (aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default)


def bench_rank(impl: str, mode: str, model_name: str, batch: int, seq: int, iters: int,
               warmup: int) -> dict:
    """Runs on every rank: build, checkpoint (``impl``'s way), shard when world > 1, train."""
    import functools

    import numpy as np
    import torch

    import hyper_parallel as hp
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
    from hyper_parallel.train.config import PRESETS
    from hyper_parallel.train.model import build_model

    p = hp.get_platform()
    n, r = p.world_size(), p.rank()
    base = p.memory_stats().peak
    model = build_model(p, PRESETS[model_name], seed=0)
    param_shapes = {shape for t in model.parameters() for shape in (tuple(t.shape), tuple(t.shape)[::-1])}
    kept = saved_ops()
    if mode != "off" and impl == "hyper_parallel":
        from hyper_parallel.core.activation_checkpoint import CheckpointPolicy

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

        for block in model.layers:
            checkpoint_wrapper(block, policy_fn=policy if mode == "selective" else None)
    elif mode != "off":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                                 apply_activation_checkpointing)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as torch_wrapper
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        selective = {"context_fn": functools.partial(create_selective_checkpoint_contexts, list(kept))} \
            if mode == "selective" else {}
        blocks = set(model.layers)
        apply_activation_checkpointing(model, check_fn=lambda m: m in blocks,
                                       checkpoint_wrapper_fn=functools.partial(torch_wrapper,
                                                                               checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                                               **selective))
    if n > 1:
        if impl == "hyper_parallel":
            mesh = hp.init_device_mesh(p.device_type, (n,))
            shard = functools.partial(hp.fully_shard, mesh=mesh)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            shard = functools.partial(fully_shard, mesh=init_device_mesh("cpu", (n,)))
        for block in model.layers:
            shard(block)
        shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(r)
    tokens = torch.from_numpy(rng.integers(0, 256, (batch, seq + 1)))
    positions = torch.arange(seq).expand(batch, seq).contiguous()
    args = (tokens[:, :-1].contiguous(), positions, tokens[:, 1:].contiguous())

    def saved_bytes() -> int:
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            # Parameters (gathered or not, transposed or not) are told apart by shape: FSDP2's
            # gathered parameters are plain tensors, ours are released by fully_shard's own hooks.
            if tuple(t.shape) not in param_shapes:
                storage = t.untyped_storage()
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*args)
        loss.backward()
        opt.zero_grad()
        return sum(kept.values())

    # Only without sharding: fully_shard's own saved-tensor hooks (around the root's whole
    # forward) are innermost there and would hide every save from the counting hooks.
    saved = saved_bytes() if n == 1 else None
    seconds, cpu_seconds = [], []
    for step in range(warmup + iters):
        if n > 1:
            barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = model(*args)
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if step >= warmup:
            seconds.append(elapsed)
            cpu_seconds.append(cpu)
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_bytes": p.memory_stats().peak - base, "saved_bytes": saved,
            "loss": float(loss.detach())}


def run(impl: str, mode: str, world: int, args: argparse.Namespace) -> dict:
    from hyper_parallel.testing import run_on_ranks

    from benchmarks.activation_checkpoint import bench_rank as rank_fn  # importable by name on the ranks

    per_rank = run_on_ranks(rank_fn, world, impl, mode, args.model, args.batch, args.seq, args.iters,
                            args.warmup, platform="torch-cpu", timeout_s=1800)
    slowest = [max(rank["seconds"][i] for rank in per_rank) for i in range(args.iters)]
    busiest = [max(rank["cpu_seconds"][i] for rank in per_rank) for i in range(args.iters)]
    return {"impl": impl, "mode": mode, "world_size": world,
            "step_ms": statistics.median(slowest) * 1e3, "cpu_ms": statistics.median(busiest) * 1e3,
            "peak_mib": max(rank["peak_bytes"] for rank in per_rank) / 2**20,
            "saved_mib": None if per_rank[0]["saved_bytes"] is None else per_rank[0]["saved_bytes"] / 2**20}


def comparison(rows: list[dict]) -> list[dict]:
    """Per world size and setting: hyper_parallel / torch for step time, peak memory and
    saved activations (below 1: ours is faster / smaller)."""
    by = {(row["impl"], row["mode"], row["world_size"]): row for row in rows}
    out = []
    for world in sorted({row["world_size"] for row in rows}):
        for mode in MODES:
            ours, theirs = by.get(("hyper_parallel", mode, world)), by.get(("torch", mode, world))
            if ours and theirs:
                out.append({"world_size": world, "mode": mode,
                            "step_ratio": ours["step_ms"] / theirs["step_ms"],
                            "cpu_step_ratio": ours["cpu_ms"] / theirs["cpu_ms"],
                            "peak_ratio": ours["peak_mib"] / max(theirs["peak_mib"], 1e-9)})
                if ours["saved_mib"] is not None:
                    out[-1]["saved_ratio"] = ours["saved_mib"] / max(theirs["saved_mib"], 1e-9)
    return out


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    by = {(row["impl"], row["mode"], row["world_size"]): row for row in rows}
    lines = [f"# Activation checkpointing: hyper_parallel vs torch ({args.model} decoder, every block checkpointed, "
             f"batch {args.batch}x{args.seq} per rank, gloo, CPU)", "",
             "World 1: the model alone; world > 1: each block and the root fully sharded (ours / torch FSDP2). "
             "Step: median over iterations of the slowest rank. Peak: the largest rank's peak RSS minus its value "
             "before the model was built. Saved: activations autograd keeps for the backward (parameters "
             "excluded; world 1 only, see the script). ratio = hyper_parallel / torch (below 1: faster / smaller). "
             "World 1 without checkpointing runs the same code on both sides: its ratios show the noise of the "
             "machine. Selective: matrix products and attention kept, the rest recomputed. CPU: the process CPU "
             "time of a step (all its threads), median over iterations of the busiest rank, less sensitive than "
             "the step time to other processes on a shared host; the two implementations alternate which runs "
             f"first. Load average before the runs: {args.load}.", "",
             "| world | checkpointing | hp step ms | torch step ms | ratio | hp CPU ms | torch CPU ms | ratio "
             "| hp peak MiB | torch peak MiB | ratio | hp saved MiB | torch saved MiB | ratio |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for world in args.worlds:
        for mode in MODES:
            ours, theirs = by[("hyper_parallel", mode, world)], by[("torch", mode, world)]
            saved = ("| — | — | — |" if ours["saved_mib"] is None else
                     f"| {ours['saved_mib']:.2f} | {theirs['saved_mib']:.2f} | "
                     f"{ours['saved_mib'] / max(theirs['saved_mib'], 1e-9):.2f} |")
            lines.append(
                f"| {world} | {mode} | {ours['step_ms']:.1f} | {theirs['step_ms']:.1f} | "
                f"{ours['step_ms'] / theirs['step_ms']:.2f} | {ours['cpu_ms']:.1f} | {theirs['cpu_ms']:.1f} | "
                f"{ours['cpu_ms'] / theirs['cpu_ms']:.2f} | {ours['peak_mib']:.1f} | {theirs['peak_mib']:.1f} | "
                f"{ours['peak_mib'] / max(theirs['peak_mib'], 1e-9):.2f} {saved}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "activation_checkpoint")
    args = parser.parse_args()
    args.load = " ".join(f"{x:.2f}" for x in os.getloadavg())  # before the runs
    impls = ("hyper_parallel", "torch")
    rows = [run(impl, mode, world, args) for world in args.worlds for i, mode in enumerate(MODES)
            for impl in (impls if i % 2 == 0 else impls[::-1])]  # alternating which runs first
    meta = {"model": args.model, "batch": args.batch, "seq": args.seq, "iters": args.iters, "warmup": args.warmup,
            "backend": "torch-cpu (gloo)", "load_average": args.load, **host_meta()}
    write_results(args.out, meta, rows, markdown(rows, args), comparison=comparison(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
