#!/usr/bin/env python3
"""Forward + backward of causal attention under context parallelism on MindSpore CPU
ranks: each mode of hyper_parallel beside one process running the same kernel (the
platform's tiled FlashAttention-2 on MindSpore CPU) on the whole sequence and on one
rank's share, per sequence length, in one run.

4 ranks (mindspore-cpu), ``[batch=1, seq, heads=8, head_dim=64]`` float32, causal. Per
mode and length: barrier, ``platform.vjp`` of the forward and its backward (gradients of
q, k, v read back), timed on every rank; a repetition's time is the slowest rank's, the
median over ``--iters`` after ``--warmup`` is reported. ratio vs single: the mode's time
over one process on the whole sequence (below 1: context parallelism is faster; a perfect
split of the work reaches ``1 / cp``). ``one rank's share`` (one process on the first
``seq / cp`` positions) is listed for scale only: causally it does ``1 / cp^2`` of the work.
MindSpore has no tensor-level memory tracker and one process's peak RSS only grows, so
this table has times only (``context_parallel.py`` measures memory on torch). There is no
MindSpore ring attention to compare with.

    python benchmarks/context_parallel_mindspore.py [--seqs 1024 2048] [--iters 3]
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
from benchmarks.context_parallel import BATCH, HEAD_DIM, HEADS, MODES  # noqa: E402
from hyper_parallel.core.process_groups import barrier


def bench_rank(seqs: list[int], iters: int, warmup: int) -> list[dict]:
    """Runs on every rank: times every mode; returns this rank's seconds."""
    import numpy as np

    import hyper_parallel as hp

    p = hp.get_platform()
    n = p.world_size()
    mesh = hp.init_device_mesh(p.device_type, (n,))
    rows = []
    for seq in seqs:
        rng = np.random.default_rng(seq)
        full = [p.from_numpy(rng.standard_normal((BATCH, seq, HEADS, HEAD_DIM)).astype(np.float32)) for _ in range(4)]

        def attend(q, k, v):
            return hp.scaled_dot_product_attention(q, k, v, is_causal=True)

        share = [p.narrow(t, 1, 0, seq // n) for t in full]
        runs = {"single device": (attend, full), "one rank's share": (attend, share)}
        for name, (ud, exchange, lb) in MODES.items():
            module = _module()
            hp.ContextParallel(ulysses_degree=ud, kv_exchange=exchange, load_balance=lb).apply(module, mesh)
            runs[name] = (module, hp.context_parallel_shard(full, [1] * 4, mesh, load_balance=lb))
        for name, (fn, (q, k, v, dout)) in runs.items():
            times = []
            for i in range(warmup + iters):
                barrier()
                start = time.perf_counter()
                _, backward = p.vjp(fn, [q, k, v])
                grads, _ = backward([dout])
                float(sum(float(p.to_numpy(g).reshape(-1)[0]) for g in grads))
                if i >= warmup:
                    times.append(time.perf_counter() - start)
            rows.append({"mode": name, "seq": seq, "seconds": times})
    return rows


def _module():
    import mindspore

    import hyper_parallel as hp

    class CoreAttention(mindspore.nn.Cell):
        def construct(self, q, k, v):
            return hp.scaled_dot_product_attention(q, k, v, is_causal=True)

    return CoreAttention()


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    results = []
    for i, row in enumerate(per_rank[0]):
        slowest = [max(rank_rows[i]["seconds"][j] for rank_rows in per_rank) for j in range(len(row["seconds"]))]
        results.append({"mode": row["mode"], "seq": row["seq"], "ms": statistics.median(slowest) * 1e3})
    for entry in results:
        ref = {e["mode"]: e["ms"] for e in results if e["seq"] == entry["seq"]}
        entry["ratio_vs_single"] = entry["ms"] / ref["single device"]
    return results


def markdown(results: list[dict], world: int) -> str:
    lines = [f"# Context parallelism on MindSpore CPU: forward + backward of causal attention ({world} ranks)", "",
             f"`[batch={BATCH}, seq, heads={HEADS}, head_dim={HEAD_DIM}]` float32, the platform's tiled "
             "FlashAttention-2 kernel. ms: median of the slowest rank. ratio vs single: / one process on the whole "
             f"sequence (a perfect split: 1/cp = {1 / world:.2f}). one rank's share: the first seq/cp positions in "
             "one process, for scale (causally 1/cp^2 of the work).", "",
             "| mode | seq | ms | ratio vs single |", "|---|---:|---:|---:|"]
    for e in results:
        lines.append(f"| {e['mode']} | {e['seq']} | {e['ms']:.0f} | {e['ratio_vs_single']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "context_parallel_mindspore")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.context_parallel_mindspore import bench_rank as rank_fn

    per_rank = run_on_ranks(rank_fn, args.world_size, args.seqs, args.iters, args.warmup,
                            platform="mindspore-cpu", timeout_s=3000)
    results = summarize(per_rank)
    meta = {"world_size": args.world_size, "backend": "mindspore-cpu", "iters": args.iters, "warmup": args.warmup,
            **host_meta()}
    write_results(args.out, meta, results, markdown(results, args.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
