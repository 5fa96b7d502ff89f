#!/usr/bin/env python3
"""The ``hyper-parallel train`` step on torch with and without ``--compile``, beside plain torch
training the same decoder eagerly and with ``torch.compile`` of each block, in the same run
(torch-cpu, one rank, float32); with ``--world-size 2`` (the default) also the job's tp 2 and
dp-shard 2 steps with and without ``--compile`` on two gloo ranks.

All four: the ``small`` preset (or ``--model``), seq 128, batch 8, the job's initial weights
and batches. The job's steps are ``train.loop._train_step`` of ``loop.setup`` (``--compile``:
each decoder block ``torch.compile``'d by ``Platform.compile_module``, inductor, the
platform's hooks excluded from tracing; [Note: what --compile compiles]). The plain steps
train the same decoder module (``train.model.build_model``: a ``torch.nn.Module``) the way a
torch user writes it: ``loss.backward()``, ``clip_grad_norm_`` at ``--max-norm`` 1.0 and
``torch.optim.AdamW`` (lr 3e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1); "plain
torch.compile" compiles each block with ``block.compile()`` (torchtitan's per-block
compile, inductor).

Timing: the four alternate step by step (the order rotates every repetition), medians over
``--iters`` steps after ``--warmup`` (compilation happens in the warmup); ratio = the
median of per-repetition ratios. Losses are compared at every step (the same math: 1e-4
relative).

    python benchmarks/compile_torch.py [--iters 12] [--warmup 3] [--world-size 2]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, ratio_cell, step_arguments, write_results  # noqa: E402  (after the path insert)

LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


def plain_step(model: Any) -> Callable[[list[Any]], float]:
    """One plain torch step of ``model`` on ``[tokens, positions, targets]``: forward,
    ``backward``, clipping, AdamW; returns the loss."""
    import torch

    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    def step(tensors: list[Any]) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(*tensors)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        return float(loss.detach())

    return step


def bench_rank(model_name: str, seq_len: int, batch_size: int, iters: int, warmup: int, world: int) -> list[dict]:
    """Runs on every rank: at one rank the four steps, at two the job's tp 2 and dp-shard 2
    steps eager and compiled, alternating; this rank's seconds per step and losses."""
    import torch

    from hyper_parallel.platform import get_platform
    from hyper_parallel.train import loop
    from hyper_parallel.train.config import PRESETS, Layout, TrainConfig
    from hyper_parallel.train.data import rank_batch
    from hyper_parallel.train.model import build_model

    p = get_platform()
    cfg = PRESETS[model_name]
    layouts = {"job": Layout()} if world == 1 else {"job tp 2": Layout(tp=2), "job dp-shard 2": Layout(dp_shard=2)}
    runs = {name + suffix: loop.setup(TrainConfig(platform="torch-cpu", nproc=world, model=cfg, model_name=model_name,
                                                  layout=layout, seq_len=seq_len, batch_size=batch_size, steps=10_000,
                                                  max_norm=MAX_NORM, lr=LR, warmup_steps=0, lr_schedule="constant",
                                                  weight_decay=WEIGHT_DECAY, progress=False, compile=compiled))
            for name, layout in layouts.items() for suffix, compiled in (("", False), (" compiled", True))}
    corpus = next(iter(runs.values())).corpus
    plain = {}
    if world == 1:
        eager_model, compiled_model = build_model(p, cfg, 0), build_model(p, cfg, 0)
        for block in compiled_model.layers:
            block.compile()  # torch's own per-block compile (inductor)
        plain = {"plain torch": plain_step(eager_model), "plain torch.compile": plain_step(compiled_model)}

    def plain_call(fn: Callable[[list[Any]], float]) -> Callable[[int], float]:
        def one(step: int) -> float:
            batch = rank_batch(corpus.train, 0, step, batch_size, seq_len, 0, 1)
            return fn([torch.from_numpy(batch.tokens), torch.from_numpy(batch.positions),
                       torch.from_numpy(batch.targets)])
        return one

    fns: dict[str, Callable[[int], float]] = {
        **{name: (lambda step, run=run: loop._train_step(run, step)[0]) for name, run in runs.items()},
        **{name: plain_call(fn) for name, fn in plain.items()}}
    names = list(fns)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + iters):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            began = time.perf_counter()
            losses[name].append(fns[name](rep + 1))
            if rep >= warmup:
                seconds[name].append(time.perf_counter() - began)
    return [{"impl": name, "seconds": seconds[name], "losses": losses[name]} for name in names]


def summarize(rows: list[dict], world: int) -> list[dict]:
    """Median ms per step and the ratios of each step to the others of its repetition (a
    compiled job step also to the same layout's eager step). Rank 0's times: every step
    ends in collectives that wait for the slowest rank."""
    by_name = {row["impl"]: row["seconds"] for row in rows}
    out = []
    for row in rows:
        entry = {"impl": row["impl"], "world_size": world, "ms": statistics.median(row["seconds"]) * 1e3,
                 "final_loss": row["losses"][-1]}
        references = {"plain torch": "ratio_to_plain_torch", "plain torch.compile": "ratio_to_plain_torch_compile",
                      row["impl"].removesuffix(" compiled"): "ratio_to_eager"}
        for reference, key in references.items():
            if reference != row["impl"] and reference in by_name:
                entry[key] = statistics.median(a / b for a, b in zip(row["seconds"], by_name[reference]))
        out.append(entry)
    # run_all's summary: the job / plain torch in the same mode
    for entry in out:
        if entry["impl"] == "job":
            entry["ratio"] = entry["ratio_to_plain_torch"]
        elif entry["impl"] == "job compiled":
            entry["ratio"] = entry["ratio_to_plain_torch_compile"]
    return out


def check_same_math(rows: list[dict]) -> None:
    """Raise where a step's loss leaves the job's eager loss beyond float32 reordering."""
    reference = rows[0]["losses"]
    for row in rows:
        for step, (a, b) in enumerate(zip(row["losses"], reference)):
            if abs(a - b) > 1e-4 * abs(b):  # float32: the compilers' and the kernels' summation orders
                raise RuntimeError(f"{row['impl']} diverged from the job's eager step at step {step + 1}: {a} vs {b}")


#: what the table's numbers are, under its title
EXPLANATION = ("Median ms per step, the four steps alternating within each repetition; ratio = median over "
               "repetitions of this step / that step of the repetition. job compiled: `--compile` (each block "
               "torch.compile'd, inductor); plain torch.compile: the same decoder trained by plain torch, each block "
               "`block.compile()`.")
RATIO_COLUMNS = {"ratio_to_plain_torch": "/ plain torch", "ratio_to_plain_torch_compile": "/ plain torch.compile",
                 "ratio_to_eager": "/ job eager, same layout"}


def markdown(results: list[dict], meta: dict) -> str:
    title = (f"# --compile on torch beside plain torch (CPU, float32, model {meta['model']}, "
             f"seq {meta['seq_len']}, batch {meta['batch_size']})")
    columns = ["step", "ranks", "ms", *RATIO_COLUMNS.values(), "final loss"]
    table = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for e in results:
        cells = [e["impl"], str(e["world_size"]), f"{e['ms']:.1f}", *(ratio_cell(e, key) for key in RATIO_COLUMNS),
                 f"{e['final_loss']:.4f}"]
        table.append("| " + " | ".join(cells) + " |")
    return "\n".join([title, "", EXPLANATION, "", *table]) + "\n"


def main() -> int:
    args = step_arguments(__doc__, "compile_torch", iters=12, warmup=3, world_sizes=(1, 2))
    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.compile_torch import bench_rank as rank_fn

    results = []
    for world in (1, 2)[:args.world_size]:
        rows = run_on_ranks(rank_fn, world, args.model, args.seq_len, args.batch_size, args.iters, args.warmup, world,
                            platform="torch-cpu", timeout_s=3600)[0]
        check_same_math(rows)
        results += summarize(rows, world)
    meta = {"model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size, "iters": args.iters,
            "warmup": args.warmup, "backend": "torch-cpu", "compile_backend": "inductor", **host_meta()}
    write_results(args.out, meta, results, markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
