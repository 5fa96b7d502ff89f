#!/usr/bin/env python3
"""The ``hyper-parallel train`` step on MindSpore beside the same decoder written directly on
``mindspore.mint`` (plain MindSpore: no hyper_parallel, no platform layer), in PyNative and
under ``mindspore.jit``, in the same run (mindspore-cpu, float32).

Both sides: the ``small`` preset (or ``--model``), seq 128, batch 8, the job's initial weights
(``train.model.initial_weights``) and batches (``train.data.rank_batch``); a step is forward,
backward, the global gradient norm and clipping at ``--max-norm`` 1.0, AdamW (lr 3e-3,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1), and the loss read back to the host. The job's
step is ``train.loop._train_step`` of ``loop.setup`` at one rank (what ``--nproc 1 --tp 1``
runs); the plain step is ``PlainDecoder`` + ``mindspore.value_and_grad`` +
``mindspore.experimental.optim.AdamW`` (the optimizer the job uses), its attention the
textbook one a MindSpore user writes: ``softmax(q k^T * scale + causal mask) v``, each
key/value head broadcast over its group of query heads (grouped-query attention). The compiled row runs the same
plain step as one ``mindspore.jit`` function (forward, gradients, clipping, AdamW). At one rank the
job also runs with ``--compile`` (``job compiled``: each dense block's math but its core attention under ``mindspore.jit``,
train/compile.py), compared with its PyNative step and the plain jit step; at two ranks
dp-shard 2 does too (``job dp-shard 2 compiled``, compared with its PyNative step).

Timing: the implementations alternate step by step (the order rotates every repetition), so
load that comes and goes on a shared machine reaches every side of a ratio alike; medians
over ``--iters`` steps after ``--warmup``; ratio = the median of per-repetition ratios. The
losses of the job and the plain PyNative step are compared at every step (same math,
float32, other summation orders: checked to 1e-3 relative, about 1e-6 seen), so the
baseline is the same computation.

With ``--world-size 2`` the job's step also runs on two ranks, tp 2 and dp-shard 2, each
beside the plain step on each rank (the same global batch, so the plain step does twice
a rank's work there: the ratio shows what the layout costs beyond sharing the work).

[Top costs of the job's step] cProfile of ``loop._train_step`` at one rank (small preset,
MindSpore 2.10 CPU, 5 steps). PyNative runs kernels asynchronously, so a Python read of a
fresh tensor's ``shape``, ``dtype`` or ``ndim`` waits for the queue to reach that tensor
(about 1 ms after a 1500 x 1500 matmul, measured) and is charged the kernels' time:

1. MindSpore's backward (``GradExecutor.grad`` and the ops it queues): about half of the
   step, on the plain step as well.
2. Those reads: about 265 ``shape``, 120 ``dtype`` and 50 ``ndim`` reads a step (the plain
   step: 6 of each), from the CPU attention's ``_shape`` (about 40 a step), the RoPE and
   attention modules' ``x.shape``, the attention input checks and ``tensor_ops.stack`` in
   the gradient norm: about a fifth of the profile, most of it a wait that the loss read
   at the end of the step pays on the plain side.
3. The CPU attention (``platform/mindspore/attention.py``: a tiled FlashAttention-2 forward
   and its recomputing backward, ``O(seq x tile)`` memory) against the plain step's one
   ``softmax(q k^T) v`` per layer, as about 60 PyNative operations a layer. A call this
   small now runs as one ``mindspore.jit`` graph each way ([Note: MindSpore CPU attention
   in one graph]): 86 -> 30 ms for one layer's forward + backward timed alone, and the
   job's compiled step went from 544 to 372 ms (``results/plain_mindspore.md``).

What was found: at one rank the job's step is at or below plain PyNative's in the same run
(``results/plain_mindspore.md``); the 617 vs 423-484 ms of issue 38 compared runs of
different days on a shared host, and no time is missing at one rank. Under ``jit`` the
plain step runs in about half its PyNative time on a quiet host: that gap is the compiled
mode (issue 38 item 3). The job's ``--compile`` (each dense block's math in two graphs, the
core attention between them, itself one graph each way at these sizes: cost 3 above) runs in
0.66-0.68 of its PyNative step at one rank, 0.62-0.67 at dp-shard 2, and 0.98-1.04 of the
plain jit step (two runs; 1.33-1.38 before the attention's graphs; docs/train_compile.md).
The job's tp 2 and dp-shard 2 steps run no op through the DTensor
class's ``__fallback__`` nor core's ``dispatch`` (counted over a step: the tensor-parallel
styles and fully_shard hand the modules local tensors), so the dispatch cache of
``platform/mindspore/dtensor.py`` (``results/dtensor_dispatch.md``) speeds up models that
run MindSpore's own ops on DTensors (MindFormers'), not these rows.

    python benchmarks/plain_mindspore.py [--iters 12] [--warmup 3] [--world-size 2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import add_step_arguments, host_meta, ratio_cell, write_results  # noqa: E402  (after the path insert)

LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


def plain_decoder(cfg: Any, weights: dict[str, Any], rope: tuple[Any, Any]) -> Any:
    """The job's decoder (``train/model.py``) as a ``mindspore.nn.Cell`` on ``mint`` ops, with
    ``weights`` (numpy, the job's parameter names) as its parameters: embedding, ``n_layers``
    pre-norm blocks (RMSNorm, grouped-query causal attention with rotate-half RoPE, SwiGLU),
    final RMSNorm, output head, mean cross-entropy. ``rope``: the ``(cos, sin)`` tables
    ``[max_seq_len, head_dim / 2]``."""
    import mindspore as ms
    import numpy as np
    from mindspore import mint, nn, ops

    hd, heads, kv_heads, eps = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps
    group, scale = heads // kv_heads, cfg.head_dim ** -0.5

    class PlainDecoder(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            # flat names: a ParameterTuple in the jit graph is simpler than nested Cells
            self.names = list(weights)
            self.weights = ms.ParameterTuple(
                [ms.Parameter(ms.Tensor(np.ascontiguousarray(v)), name=n) for n, v in weights.items()])
            self.cos, self.sin = ms.Tensor(rope[0]), ms.Tensor(rope[1])

        def construct(self, tokens: Any, positions: Any, targets: Any) -> Any:
            w = {name: self.weights[i] for i, name in enumerate(self.names)}
            b, s = tokens.shape
            cos = self.cos[positions].reshape(b, s, 1, -1)
            sin = self.sin[positions].reshape(b, s, 1, -1)
            mask = mint.triu(mint.ones((s, s), dtype=ms.float32), diagonal=1) * -1e30

            def norm(x: Any, weight: Any) -> Any:
                return x * mint.rsqrt(mint.mean(x * x, -1, True) + eps) * weight

            def rotate(x: Any) -> Any:
                half = hd // 2
                x1, x2 = x[..., :half], x[..., half:]
                return mint.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

            h = ops.gather(w["tok_embeddings.weight"], tokens, 0)  # mint's Embedding has no CPU kernel
            for i in range(cfg.n_layers):
                pre = f"layers.{i}."
                x = norm(h, w[pre + "attention_norm.weight"])
                q = rotate(mint.nn.functional.linear(x, w[pre + "attention.wq.weight"]).reshape(b, s, heads, hd))
                k = rotate(mint.nn.functional.linear(x, w[pre + "attention.wk.weight"]).reshape(b, s, kv_heads, hd))
                v = mint.nn.functional.linear(x, w[pre + "attention.wv.weight"]).reshape(b, s, kv_heads, hd)
                # grouped-query: query head j reads key/value head j // group ([b, kv_heads, group,
                # s, hd] against [b, kv_heads, group, s, hd]; mint's RepeatInterleave has no CPU kernel)
                q = q.reshape(b, s, kv_heads, group, hd).permute(0, 2, 3, 1, 4)
                k = mint.broadcast_to(k.permute(0, 2, 1, 3).unsqueeze(2), (b, kv_heads, group, s, hd))
                v = mint.broadcast_to(v.permute(0, 2, 1, 3).unsqueeze(2), (b, kv_heads, group, s, hd))
                probs = mint.nn.functional.softmax(mint.matmul(q, mint.transpose(k, 3, 4)) * scale + mask, dim=-1)
                attended = mint.matmul(probs, v).permute(0, 3, 1, 2, 4).reshape(b, s, heads * hd)
                h = h + mint.nn.functional.linear(attended, w[pre + "attention.wo.weight"])
                x = norm(h, w[pre + "ffn_norm.weight"])
                gate = mint.nn.functional.silu(mint.nn.functional.linear(x, w[pre + "feed_forward.w1.weight"]))
                up = mint.nn.functional.linear(x, w[pre + "feed_forward.w3.weight"])
                h = h + mint.nn.functional.linear(gate * up, w[pre + "feed_forward.w2.weight"])
            head = w["tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"]
            logits = mint.nn.functional.linear(norm(h, w["norm.weight"]), head)
            return ops.cross_entropy(logits.reshape(b * s, -1), targets.reshape(-1), reduction="mean")

    return PlainDecoder()


def plain_step(model: Any, compiled: bool) -> Callable[[list[Any]], float]:
    """One plain step of ``model`` (forward, backward, global norm and clip, AdamW) on
    ``[tokens, positions, targets]``; returns the loss. ``compiled``: the whole step as one
    ``mindspore.jit`` function."""
    import mindspore as ms
    from mindspore import mint
    from mindspore.experimental.optim import AdamW

    params = model.trainable_params()
    opt = AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    grad_fn = ms.value_and_grad(model, None, model.weights)

    def step(tokens: Any, positions: Any, targets: Any) -> Any:
        loss, grads = grad_fn(tokens, positions, targets)
        norm = mint.sqrt(sum((g * g).sum() for g in grads))
        coefficient = mint.clamp(MAX_NORM / (norm + 1e-6), None, 1.0)  # torch's clip_grad_norm_ rule
        opt(tuple(g * coefficient for g in grads))
        return loss

    run = ms.jit(step) if compiled else step

    def call(tensors: list[Any]) -> float:
        return float(run(*tensors).asnumpy())

    return call


def bench_rank(model_name: str, seq_len: int, batch_size: int, iters: int, warmup: int, world: int) -> list[dict]:
    """Runs on every rank: the job's step (the layout of ``world`` ranks; at 2: tp 2, then
    dp-shard 2) and the plain steps, alternating; returns this rank's seconds per step and losses."""
    import resource

    import mindspore as ms

    from hyper_parallel.train import loop
    from hyper_parallel.train.config import PRESETS, Layout, TrainConfig
    from hyper_parallel.train.data import rank_batch
    from hyper_parallel.train.model import initial_weights, rope_tables

    cfg = PRESETS[model_name]
    # (layout, --compile); MindSpore's --compile refuses --tp (train/compile.py)
    layouts = {"job": (Layout(), False), "job compiled": (Layout(), True)} if world == 1 else \
        {"job tp 2": (Layout(tp=2), False), "job dp-shard 2": (Layout(dp_shard=2), False),
         "job dp-shard 2 compiled": (Layout(dp_shard=2), True)}
    runs = {name: loop.setup(TrainConfig(platform="mindspore-cpu", nproc=world, model=cfg, model_name=model_name,
                                         layout=layout, seq_len=seq_len, batch_size=batch_size, steps=10_000,
                                         max_norm=MAX_NORM, lr=LR, warmup_steps=0, lr_schedule="constant",
                                         weight_decay=WEIGHT_DECAY, progress=False, compile=compiled))
            for name, (layout, compiled) in layouts.items()}
    corpus = next(iter(runs.values())).corpus
    weights, rope = initial_weights(cfg, 0), rope_tables(cfg)
    plain = {"plain PyNative": plain_step(plain_decoder(cfg, weights, rope), compiled=False)}
    if world == 1:
        plain["plain jit"] = plain_step(plain_decoder(cfg, weights, rope), compiled=True)

    def plain_call(fn: Callable[[list[Any]], float]) -> Callable[[int], float]:
        def one(step: int) -> float:
            batch = rank_batch(corpus.train, 0, step, batch_size, seq_len, 0, 1)  # the whole batch
            return fn([ms.Tensor(batch.tokens), ms.Tensor(batch.positions), ms.Tensor(batch.targets)])
        return one

    def job_call(run: Any) -> Callable[[int], float]:
        return lambda step: loop._train_step(run, step)[0]

    fns = {**{name: job_call(run) for name, run in runs.items()},
           **{name: plain_call(fn) for name, fn in plain.items()}}
    names = list(fns)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # this process's CPU time, all threads

    def cpu_now() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    losses: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + iters):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            began, began_cpu = time.perf_counter(), cpu_now()
            loss = fns[name](rep + 1)
            elapsed, elapsed_cpu = time.perf_counter() - began, cpu_now() - began_cpu
            losses[name].append(loss)
            if rep >= warmup:
                seconds[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
    return [{"impl": name, "seconds": seconds[name], "cpu_seconds": cpu[name], "losses": losses[name]}
            for name in names]


def summarize(per_rank: list[list[dict]], world: int) -> list[dict]:
    """Median ms per step (the slowest rank per step) and ratios to the plain steps."""
    rows = {row["impl"]: row for row in per_rank[0]}
    slowest = {name: [max(rank_rows[i]["seconds"][k] for rank_rows in per_rank)
                      for k in range(len(row["seconds"]))]
               for i, (name, row) in enumerate(rows.items())}
    out = []
    for name, times in slowest.items():
        entry = {"impl": name, "world_size": world, "ms": statistics.median(times) * 1e3,
                 "cpu_ms": statistics.median(rows[name]["cpu_seconds"]) * 1e3, "final_loss": rows[name]["losses"][-1]}
        eager = name.removesuffix(" compiled")  # a compiled row beside its PyNative one
        for reference in ("plain PyNative", "plain jit", eager):
            if reference in slowest and reference != name:
                key = "ratio_to_" + ("job" if reference == eager else reference.replace(" ", "_").lower())
                entry[key] = statistics.median(a / b for a, b in zip(times, slowest[reference]))
                entry["cpu_" + key] = statistics.median(
                    a / b for a, b in zip(rows[name]["cpu_seconds"], rows[reference]["cpu_seconds"]))
        if name.startswith("job"):  # run_all's summary: the job / plain, same mode
            entry["ratio"] = entry["ratio_to_plain_jit" if name == "job compiled" else "ratio_to_plain_pynative"]
        out.append(entry)
    return out


def check_same_math(per_rank: list[list[dict]]) -> None:
    """Raise where the job's loss and the plain PyNative one differ beyond float32 reordering."""
    rows = {row["impl"]: row for row in per_rank[0]}
    reference = rows["plain PyNative"]["losses"]
    for name, row in rows.items():
        for step, (a, b) in enumerate(zip(row["losses"], reference)):
            # float32, different summation orders (and the tiled attention's online softmax)
            if abs(a - b) > 1e-3 * abs(b):
                raise RuntimeError(f"{name} diverged from plain PyNative at step {step + 1}: {a} vs {b}")


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# The job's MindSpore step beside plain MindSpore (CPU, float32, model {meta['model']}, "
             f"seq {meta['seq_len']}, batch {meta['batch_size']})", "",
             "Median ms per step (the slowest rank per step at 2 ranks), steps alternating within each "
             "repetition; ratio = median over repetitions of this step / the plain step of that repetition. "
             "The plain step does the whole batch on one rank. CPU: this process's CPU time per step (all its "
             "threads, rank 0), less sensitive than wall time to other processes' load. compiled: "
             "`--compile` (each block's math but its core attention under mindspore.jit, in two graphs; the rest of the step PyNative); "
             "/ job PyNative: against the same layout's PyNative step.", "",
             "| step | ranks | ms | / plain PyNative | / plain jit | / job PyNative | CPU ms | CPU / plain PyNative "
             "| final loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in results:
        ratio = functools.partial(ratio_cell, e)
        lines.append(f"| {e['impl']} | {e['world_size']} | {e['ms']:.0f} | {ratio('ratio_to_plain_pynative')} | "
                     f"{ratio('ratio_to_plain_jit')} | {ratio('ratio_to_job')} | {e['cpu_ms']:.0f} | "
                     f"{ratio('cpu_ratio_to_plain_pynative')} | "
                     f"{e['final_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, iters=12, warmup=3)
    parser.add_argument("--world-size", type=int, default=2, choices=(1, 2),
                        help="1: the job at one rank; 2: also tp 2 and dp-shard 2")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "plain_mindspore")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.plain_mindspore import bench_rank as rank_fn

    results = []
    for world in (1, 2)[:args.world_size]:
        per_rank = run_on_ranks(rank_fn, world, args.model, args.seq_len, args.batch_size, args.iters, args.warmup,
                                world, platform="mindspore-cpu", timeout_s=3600)
        if world == 1:
            check_same_math(per_rank)
        results += summarize(per_rank, world)
    meta = {"model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size, "iters": args.iters,
            "warmup": args.warmup, "backend": "mindspore-cpu", **host_meta()}
    write_results(args.out, meta, results, markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
