#!/usr/bin/env python3
"""The training stall per checkpoint of ``hyper-parallel train``: a synchronous save
(``checkpoint.save``: snapshot, write, fsync, digest, commit, all on the training thread)
against ``--async-checkpoint`` (``AsyncCheckpointer.save``: the snapshot, rank 0's folder and
one all-reduce on the training thread, the files written by a background thread while
training continues), of the same state, through the job's own functions (``loop.setup``,
``loop._train_step``, ``loop.save_checkpoint``).

2 ranks on gloo (torch-cpu), dp-shard 2, decoders of ``--models`` (default: dim 512 and 1024,
4 layers: 12.8 M and 50 M parameters, their float32 values and AdamW's two moments, half per
rank: 74 and 291 MiB per rank). Each mode: ``--saves`` checkpoints, ``--steps-between``
training steps before each. Reported, as the slowest rank per save and the median over
saves: the synchronous save's time, the asynchronous save's stall (what the training thread
waits), their ratio (target <= 0.10), the time the background write took, and the median
training step while a background write runs against the step with none (the writer shares
the CPU). Writes JSON and a markdown table.

    python benchmarks/checkpoint.py [--saves 5] [--steps-between 3] [--models 512x4x1536,1024x4x3072]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, write_results  # noqa: E402  (after the path insert)
from hyper_parallel.core.process_groups import barrier


def bench_rank(models: list[tuple[int, int, int]], saves: int, steps_between: int, root: str) -> list[dict]:
    """Runs on every rank: both modes on each ``(dim, n_layers, hidden_dim)``; this rank's seconds."""
    return [_bench_model(*model, saves, steps_between, f"{root}/{index}") for index, model in enumerate(models)]


def _bench_model(dim: int, n_layers: int, hidden_dim: int, saves: int, steps_between: int, root: str) -> dict:
    import hyper_parallel as hp
    from hyper_parallel.train import checkpoint
    from hyper_parallel.train.checkpoint_async import AsyncCheckpointer
    from hyper_parallel.train.config import Layout, ModelConfig, TrainConfig
    from hyper_parallel.train.loop import _train_step, save_checkpoint, setup

    p = hp.get_platform()
    n, rank = p.world_size(), p.rank()
    model = ModelConfig(dim=dim, n_layers=n_layers, n_heads=8, n_kv_heads=4, hidden_dim=hidden_dim, max_seq_len=256)
    cfg = TrainConfig(platform="torch", nproc=n, model=model, model_name="bench", layout=Layout(dp_shard=n),
                      seq_len=64, batch_size=2 * n, steps=10_000, data=(str(Path(json.__file__).parent),),
                      out=f"{root}/run", progress=False)
    run = setup(cfg)
    out: dict = {"model": [dim, n_layers, hidden_dim]}
    step = 0
    for mode in ("sync", "async"):
        writer = AsyncCheckpointer(p, n, rank) if mode == "async" else None
        saves_s, steps_s, busy_steps_s, write_s = [], [], [], []
        for _ in range(saves):
            for _ in range(steps_between):
                step += 1
                busy = writer is not None and writer.in_flight
                barrier()
                began = time.perf_counter()
                _train_step(run, step)
                (busy_steps_s if busy else steps_s).append(time.perf_counter() - began)
            if "state_bytes_per_rank" not in out:  # after a step: AdamW's moments exist
                out["state_bytes_per_rank"] = sum(piece.value.nbytes for piece in _pieces(run).values())
            barrier()
            began = time.perf_counter()
            save_checkpoint(run, Path(f"{root}/{mode}"), step, writer)
            saves_s.append(time.perf_counter() - began)
        protocol_s: list[float] = []
        if writer is not None:
            writer.wait()
            write_s = writer.write_seconds
            # joining the previous writer, the folder, the one all-reduce (the rest of a save: the host copy)
            protocol_s = writer.stalls
        found = checkpoint.latest_manifest(Path(f"{root}/{mode}"))
        if found is None or found[1]["step"] != step:
            raise RuntimeError(f"{mode}: the last checkpoint (step {step}) is not the newest complete one: {found}")
        out[mode] = {"save_s": saves_s, "step_s": steps_s, "busy_step_s": busy_steps_s, "write_s": write_s,
                     "protocol_s": protocol_s}
    return out


def _pieces(run):  # noqa: ANN001, ANN202  (the loop's private run object)
    from hyper_parallel.train.loop import checkpoint_pieces

    return checkpoint_pieces(run, run.optimizer.state_arrays())


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """Per model: the slowest rank per save, the median over saves."""
    rows = []
    for index in range(len(per_rank[0])):
        ranks = [rank_rows[index] for rank_rows in per_rank]

        def slowest(mode: str, key: str, ranks: list[dict] = ranks) -> list[float]:
            count = min(len(r[mode][key]) for r in ranks)
            return [max(r[mode][key][i] for r in ranks) for i in range(count)]

        sync = statistics.median(slowest("sync", "save_s"))
        stall = statistics.median(slowest("async", "save_s"))
        busy = slowest("async", "busy_step_s")
        dim, n_layers, hidden_dim = ranks[0]["model"]
        rows.append({"what": f"dim {dim}, {n_layers} layers, hidden {hidden_dim}",
                     "state_mb_per_rank": ranks[0]["state_bytes_per_rank"] / 2**20,
                     "sync_save_s": sync, "async_stall_s": stall, "stall_fraction": stall / sync,
                     "async_protocol_s": statistics.median(slowest("async", "protocol_s")),
                     "background_write_s": statistics.median(slowest("async", "write_s")),
                     "step_s": statistics.median(slowest("sync", "step_s")),
                     "step_during_write_s": statistics.median(busy) if busy else None})
    return rows


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"# Checkpoint stall: synchronous vs --async-checkpoint ({meta['world_size']} ranks, gloo, CPU, "
        f"dp-shard {meta['world_size']}, {meta['saves']} saves of each kind, {meta['steps_between']} steps between)",
        "",
        "Median over saves of the slowest rank. sync save: the host copy, the file's write, fsync and SHA-256, "
        "the commit and the barriers, on the training thread. async stall: what the training thread waits "
        "with --async-checkpoint: the host copy of the state plus the protocol (joining the previous writer, "
        "rank 0's folder, one all-reduce). stall fraction = async stall / sync save (target <= 0.10). "
        "Step during write: a training step while a background write runs (it shares the CPU).",
        "",
        "| model | state MiB / rank | sync save s | async stall s | of which protocol s | stall fraction | "
        "background write s | step s | step during write s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in results:
        during = f"{e['step_during_write_s']:.3f}" if e["step_during_write_s"] is not None else "-"
        lines.append(f"| {e['what']} | {e['state_mb_per_rank']:.1f} | {e['sync_save_s']:.3f} | "
                     f"{e['async_stall_s']:.3f} | {e['async_protocol_s']:.3f} | {e['stall_fraction']:.3f} | "
                     f"{e['background_write_s']:.3f} | "
                     f"{e['step_s']:.3f} | {during} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="512x4x1536,1024x4x3072",
                        help="comma-separated DIMxLAYERSxHIDDEN decoders (8 query, 4 key/value heads)")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps-between", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "checkpoint")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.checkpoint import bench_rank as rank_fn

    models = [tuple(int(v) for v in item.split("x")) for item in args.models.split(",")]
    with tempfile.TemporaryDirectory(prefix="hp-bench-checkpoint-", dir=REPO / "benchmarks") as root:
        per_rank = run_on_ranks(rank_fn, args.world_size, models, args.saves, args.steps_between, root,
                                platform="torch-cpu", timeout_s=1800)
    results = summarize(per_rank)
    meta = {"world_size": args.world_size, "backend": "torch-cpu (gloo)", "models": args.models,
            "saves": args.saves, "steps_between": args.steps_between,
            "folder": "a temporary folder under benchmarks/ (the repository's disk)", **host_meta()}
    write_results(args.out, meta, results, markdown(results, meta), per_rank=per_rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
