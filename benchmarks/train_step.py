#!/usr/bin/env python3
"""Time per training step of the ``hyper-parallel train`` decoder, tensor parallel with
hyper_parallel beside the same model tensor parallel with torch's own
``torch.distributed.tensor.parallel``, in the same run.

4 ranks on gloo (torch-cpu), the ``small`` preset, tp 4, the same plan (q/k/v and the SwiGLU
input projections column-parallel, the output projections row-parallel), the same batches and
AdamW. Each step: forward, backward, optimizer step, loss read back; timed on every rank, the
step's time is the slowest rank's; the median over ``--iters`` steps after ``--warmup`` is
reported, with the ratio ours/torch (below 1: we are faster). Writes JSON and a markdown table.

    python benchmarks/train_step.py [--iters 10] [--seq-len 128] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import add_step_arguments, host_meta, write_results  # noqa: E402  (after the path insert)
from hyper_parallel.core.process_groups import barrier


def bench_rank(model_name: str, seq_len: int, batch_size: int, iters: int, warmup: int) -> list[dict]:
    """Runs on every rank: times both implementations; returns this rank's seconds per step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    import hyper_parallel as hp
    from hyper_parallel.train.config import PRESETS
    from hyper_parallel.train.data import Corpus, rank_batch
    from hyper_parallel.train.model import build_model
    from hyper_parallel.train.parallelize import TP_PLAN, apply_tensor_parallel

    p = hp.get_platform()
    n = p.world_size()
    cfg = PRESETS[model_name]
    corpus = Corpus.load((str(Path(json.__file__).parent),), seq_len + 1)
    ours = build_model(p, cfg, 0)
    apply_tensor_parallel(ours, hp.init_device_mesh(p.device_type, (n,), mesh_dim_names=("tp",))["tp"])
    theirs = build_model(p, cfg, 0)
    torch_styles = {"ColwiseParallel": TColwise, "RowwiseParallel": TRowwise}
    torch_parallelize(theirs, torch_mesh("cpu", (n,)),
                      {key: torch_styles[type(style).__name__]() for key, style in TP_PLAN.items()})
    from torch.distributed.tensor import DTensor

    sharded = [name for name, param in theirs.named_parameters() if isinstance(param, DTensor)]
    if len(sharded) != 7 * cfg.n_layers:  # wq wk wv wo w1 w2 w3 per layer
        raise RuntimeError(f"torch's parallelize_module sharded {sharded}, not the 7 linears of every layer")
    one = torch.ones(())

    def step_ours(params: list, opt: torch.optim.Optimizer, tensors: list) -> float:
        loss, backward = p.vjp(ours, tensors, params)
        backward([one])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    def step_theirs(params: list, opt: torch.optim.Optimizer, tensors: list) -> float:
        loss = theirs(*tensors)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    rows = []
    for impl, model, step in (("hyper_parallel", ours, step_ours), ("torch", theirs, step_theirs)):
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        times, losses = [], []
        for i in range(warmup + iters):
            batch = rank_batch(corpus.train, 0, i + 1, batch_size, seq_len, 0, 1)
            tensors = [torch.from_numpy(batch.tokens), torch.from_numpy(batch.positions),
                       torch.from_numpy(batch.targets)]
            barrier()
            began = time.perf_counter()
            losses.append(step(params, opt, tensors))
            elapsed = time.perf_counter() - began
            if i >= warmup:
                times.append(elapsed)
        rows.append({"impl": impl, "seconds": times, "losses": losses})
    # the same computation: the loss curves agree (float32, different reduction orders)
    if abs(rows[0]["losses"][-1] - rows[1]["losses"][-1]) > 1e-3 * abs(rows[1]["losses"][-1]):
        raise RuntimeError(f"the two implementations diverged: {rows[0]['losses']} vs {rows[1]['losses']}")
    return rows


def summarize(per_rank: list[list[dict]], tokens: int) -> list[dict]:
    out = {}
    for index, row in enumerate(per_rank[0]):
        slowest = [max(rank_rows[index]["seconds"][i] for rank_rows in per_rank) for i in range(len(row["seconds"]))]
        out[row["impl"]] = statistics.median(slowest)
    ratio = out["hyper_parallel"] / out["torch"]
    return [{"what": "train step (forward + backward + AdamW)", "tokens_per_step": tokens,
             "hyper_parallel_ms": out["hyper_parallel"] * 1e3, "torch_ms": out["torch"] * 1e3,
             "hyper_parallel_tokens_per_s": tokens / out["hyper_parallel"], "torch_tokens_per_s": tokens / out["torch"],
             "ratio": ratio}]


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"# Training step: hyper_parallel TP vs torch.distributed.tensor.parallel ({meta['world_size']} ranks, gloo, "
        f"CPU, model {meta['model']}, seq {meta['seq_len']}, batch {meta['batch_size']})",
        "",
        "Median of the slowest rank per step. ratio = hyper_parallel / torch (below 1: faster).",
        "",
        "| step | tokens | hyper_parallel ms | torch ms | hyper_parallel tok/s | torch tok/s | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in results:
        lines.append(f"| {e['what']} | {e['tokens_per_step']} | {e['hyper_parallel_ms']:.1f} | {e['torch_ms']:.1f} | "
                     f"{e['hyper_parallel_tokens_per_s']:.0f} | {e['torch_tokens_per_s']:.0f} | {e['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, iters=10, warmup=3)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "train_step")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.train_step import bench_rank as rank_fn

    per_rank = run_on_ranks(rank_fn, args.world_size, args.model, args.seq_len, args.batch_size, args.iters,
                            args.warmup, platform="torch-cpu", timeout_s=1800)
    results = summarize(per_rank, args.seq_len * args.batch_size)
    meta = {"world_size": args.world_size, "backend": "torch-cpu (gloo)", "model": args.model, "seq_len": args.seq_len,
            "batch_size": args.batch_size, "iters": args.iters, "warmup": args.warmup, **host_meta()}
    write_results(args.out, meta, results, markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
