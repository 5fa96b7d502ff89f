#!/usr/bin/env python3
"""Local attention, forward + backward, through hyper_parallel beside the framework's own
attention, in one run; and the ``hyper-parallel train`` step beside the same model in plain
torch with ``scaled_dot_product_attention``.

Tables (time ratio and memory ratio: ours / reference, below 1 is better):

1. ``local``: ``hp.scaled_dot_product_attention(q, k, v, is_causal=True)`` (the platform's
   fused kernel through core's autograd function) against
   ``torch.nn.functional.scaled_dot_product_attention`` (torch picks its CPU flash kernel),
   ``[1, S, 8, 64]`` causal, float32 and bfloat16, S from ``--seqs``; gradients of q, k, v.
2. ``mindspore``: the same call on MindSpore CPU (the tiled online-softmax kernel) against
   plain MindSpore ops (``softmax(q k^T) v`` over the full score matrix, what the backend
   ran before; differentiated by ``value_and_grad``); float32. The plain reference is run
   only up to ``--ms-plain-max`` positions: beyond, its score matrix does not fit.
3. ``train step``: one rank, the ``small`` preset, forward + backward + AdamW, against the
   same decoder whose core attention is ``torch.nn.functional.scaled_dot_product_attention``
   (the rest of the model identical), one thread.

Each (implementation, size) runs in a fresh process; the time is the median over
``--iters`` repetitions after one warm-up. Memory on torch is the peak bytes of live
tensors during one more call (torch's ``MemTracker``: the storages the call allocates,
tracked through a dispatch mode); on MindSpore, which has no such tracker, the process's
peak RSS (``ru_maxrss``) minus its RSS once the inputs were built. Run: ``python benchmarks/attention.py``
(options: ``--seqs``, ``--ms-seqs``, ``--iters``, ``--skip-mindspore``, ``--out``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, peak_tensor_bytes, write_results  # noqa: E402  (after the path insert)

HEADS, HEAD_DIM = 8, 64


def _rss() -> int:
    """Peak resident set size of this process so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _local_step(impl: str, seq: int, dtype: str, device: str) -> Callable[[], None]:
    """Inputs ``[1, seq, 8, 64]`` of ``dtype`` on ``device`` (seeded by ``seq``) and one causal
    forward + backward on them: ours (``impl == "ours"``) or torch's SDPA. On CPU each call
    clones the inputs (the tables' memory counts them as the call's); on CUDA the inputs
    are allocated after the memory baseline instead."""
    import numpy as np
    import torch

    import hyper_parallel as hp

    rng = np.random.default_rng(seq)
    q, k, v, dout = (torch.from_numpy(rng.standard_normal((1, seq, HEADS, HEAD_DIM)).astype(np.float32))
                     .to(device, getattr(torch, dtype)) for _ in range(4))

    def run() -> None:
        qq, kk, vv = ((t.clone() if device == "cpu" else t.detach()).requires_grad_(True) for t in (q, k, v))
        if impl == "ours":
            out = hp.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), is_causal=True).transpose(1, 2)
        out.backward(dout)

    return run


def case_torch(impl: str, seq: int, dtype: str, iters: int) -> dict:
    """One local case on torch: seconds per forward + backward and working memory."""
    import hyper_parallel as hp

    hp.init(platform="torch-cpu")
    run = _local_step(impl, seq, dtype, "cpu")

    times = []
    for i in range(iters + 1):
        start = time.perf_counter()
        run()
        if i:
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_bytes": peak_tensor_bytes(run)}


def case_mindspore(impl: str, seq: int, iters: int) -> dict:
    """One local case on MindSpore CPU: the tiled kernel (``ours``) or plain ops (``plain``)."""
    import mindspore as ms
    import numpy as np
    from mindspore import mint

    import hyper_parallel as hp

    hp.init(platform="mindspore")
    ms.runtime.launch_blocking()
    rng = np.random.default_rng(seq)
    q, k, v, dout = (ms.Tensor(rng.standard_normal((1, seq, HEADS, HEAD_DIM)).astype(np.float32)) for _ in range(4))
    causal = ms.Tensor(np.tril(np.ones((seq, seq), np.bool_))) if impl == "plain" else None

    def plain(q, k, v):
        qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        scores = mint.matmul(qh, kh.transpose(2, 3)) * HEAD_DIM ** -0.5
        scores = mint.where(causal, scores, float("-inf"))
        return mint.matmul(mint.nn.functional.softmax(scores, dim=-1), vh).permute(0, 2, 1, 3)

    def ours(q, k, v):
        return hp.scaled_dot_product_attention(q, k, v, is_causal=True)

    fn = ours if impl == "ours" else plain
    grad = ms.value_and_grad(lambda q, k, v: (fn(q, k, v) * dout).sum(), grad_position=(0, 1, 2))
    base = _current_rss()
    times = []
    for i in range(iters + 1):
        start = time.perf_counter()
        _, grads = grad(q, k, v)
        grads[0].asnumpy()
        if i:
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_bytes": max(_rss() - base, 0)}


def _train_setup(impl: str, device: str) -> tuple[Any, Callable[[int], None]]:
    """The ``small`` decoder on ``device`` (ours, or with torch SDPA as its core attention)
    and its training step ``step(i)`` on batch ``i`` (forward, backward, AdamW)."""
    import json as json_module

    import torch

    import hyper_parallel as hp
    from hyper_parallel.train.config import PRESETS
    from hyper_parallel.train.data import Corpus, rank_batch
    from hyper_parallel.train.model import build_model

    p = hp.init(platform=f"torch-{device}")
    cfg = PRESETS["small"]
    model = build_model(p, cfg, 0).to(device)
    if impl == "torch":
        class SDPA(torch.nn.Module):
            def forward(self, q, k, v):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                    enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)

        for layer in model.layers:
            layer.attention.core = SDPA()
    seq_len, batch = 512, 8
    corpus = Corpus.load((str(Path(json_module.__file__).parent),), seq_len + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        b = rank_batch(corpus.train, 0, i + 1, batch, seq_len, 0, 1)
        tokens, positions, targets = (torch.from_numpy(a).to(device) for a in (b.tokens, b.positions, b.targets))
        loss = model(tokens, positions, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        float(loss)

    return model, step


def case_train_step(impl: str, iters: int) -> dict:
    """The ``small`` decoder's training step on one CPU rank: ours, or with torch SDPA."""
    import torch

    torch.set_num_threads(1)
    _, step = _train_setup(impl, "cpu")
    times = []
    for i in range(iters + 2):
        start = time.perf_counter()
        step(i)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_bytes": peak_tensor_bytes(lambda: step(iters + 2)),
            "tokens_per_step": 512 * 8}


#: Rounds of ``--iters`` back-to-back calls in the CUDA local table (median over rounds).
_CUDA_ROUNDS = 5


def cuda_local(seqs: list[int], dtypes: list[str], iters: int) -> list[dict]:
    """The ``local`` table on one GPU, in this process: CUDA time by events around
    ``iters`` calls run back to back, after one warm-up (the median over
    ``_CUDA_ROUNDS`` such rounds, per call), memory as the peak of
    ``torch.cuda.max_memory_allocated`` over one call above what was allocated before the
    inputs (the inputs count, as with MemTracker). Each row names the kernel ours ran and
    the one torch's SDPA picked."""
    import torch

    import hyper_parallel as hp
    from hyper_parallel.platform import AttentionMask
    from hyper_parallel.platform.torch import attention as attn

    hp.init(platform="torch-cuda")
    rows = []
    for seq in seqs:
        for dtype in dtypes:
            tdtype = getattr(torch, dtype)
            results = {}
            for impl in ("ours", "torch"):
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                run = _local_step(impl, seq, dtype, "cuda")

                run()  # warm-up: cuDNN builds its plan on the first call
                torch.cuda.synchronize()
                times = []
                for _ in range(_CUDA_ROUNDS):
                    # Back to back between two events, not one call between synchronizations:
                    # a synchronized call's time is its host launch time wherever the kernels
                    # are short (half precision at 4K), which measures Python, not the GPU.
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(iters):
                        run()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1e3 / iters)
                results[impl] = {"seconds": statistics.median(times),
                                 "peak_bytes": torch.cuda.max_memory_allocated() - base}
                del run
            probe = torch.empty(1, seq, HEADS, HEAD_DIM, device="cuda", dtype=tdtype)
            choice = torch._fused_sdp_choice(*(probe.transpose(1, 2),) * 3, None, 0.0, True)
            key = {"seq": seq, "dtype": dtype, "kernel": attn.cuda_kernel(probe, probe, probe, AttentionMask("top_left")),
                   "torch_kernel": torch.nn.attention.SDPBackend(choice).name.lower()}
            _pair(rows, "cuda local", key, results["ours"], results["torch"])
    return rows


def cuda_train_step(iters: int) -> list[dict]:
    """The ``train step`` table on one GPU: the ``small`` decoder, float32, ours against the
    same model with torch SDPA as its core attention."""
    import torch

    results = {}
    for impl in ("ours", "torch"):
        model, step = _train_setup(impl, "cuda")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for i in range(iters + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
        results[impl] = {"seconds": statistics.median(times), "peak_bytes": torch.cuda.max_memory_allocated() - base}
        del model, step
    rows: list[dict] = []
    _pair(rows, "cuda train step", {}, results["ours"], results["torch"])
    return rows


def _spawn(args: list[str]) -> dict:
    """Run one case in a fresh interpreter; its JSON result, or the error."""
    done = subprocess.run([sys.executable, __file__, "--case", *args], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pair(rows: list[dict], table: str, key: dict, ours: dict, ref: dict) -> None:
    row = {"table": table, **key, "ours_ms": ours.get("seconds", float("nan")) * 1e3,
           "ref_ms": ref.get("seconds", float("nan")) * 1e3,
           "ours_mib": ours.get("peak_bytes", 0) / 2**20, "ref_mib": ref.get("peak_bytes", 0) / 2**20}
    if "error" in ours or "error" in ref:
        row["error"] = ours.get("error") or ref.get("error")
    else:
        row["ratio"] = row["ours_ms"] / row["ref_ms"]
        row["memory_ratio"] = row["ours_mib"] / max(row["ref_mib"], 1e-9)
    rows.append(row)
    print(json.dumps(row), flush=True)


def _ms(ms: float) -> str:
    """Milliseconds to 3 significant digits at least (a 0.3 ms GPU call keeps its ratio's digits)."""
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}"


def markdown(rows: list[dict]) -> str:
    if any(r["table"].startswith("cuda") for r in rows):
        caption = ("Time: forward + backward per call (train step: + AdamW) after one warm-up, CUDA events around "
                   f"--iters calls back to back, median of {_CUDA_ROUNDS} rounds (train step: wall clock between "
                   "synchronizations, median), all cases in one process; memory: peak of "
                   "`torch.cuda.max_memory_allocated` above what was allocated before the inputs (inputs included). "
                   "Ratios are ours / reference (below 1: better).")
    else:
        caption = ("Time: median seconds of forward + backward (train step: + AdamW), each case in a fresh process; "
                   "memory: peak MiB of live tensors (torch's MemTracker) on torch, peak RSS above the inputs on "
                   "MindSpore. Ratios are ours / reference (below 1: better).")
    lines = ["# Local attention and the train step: hyper_parallel / the framework's own", "", caption, ""]
    titles = {"local": "torch-cpu: `hp.scaled_dot_product_attention` vs `F.scaled_dot_product_attention`, "
                       "causal `[1, S, 8, 64]`",
              "mindspore": "mindspore-cpu: tiled kernel vs plain ops (full score matrix), causal `[1, S, 8, 64]` "
                           "float32",
              "train step": "torch-cpu, one rank, one thread: `hyper-parallel train` decoder (`small`) vs the same "
                            "model with torch SDPA",
              "cuda local": "torch-cuda, one GPU: `hp.scaled_dot_product_attention` vs `F.scaled_dot_product_attention`, "
                            "causal `[1, S, 8, 64]` (kernel: ours / torch's SDPA choice)",
              "cuda train step": "torch-cuda, one GPU: `hyper-parallel train` decoder (`small`, float32) vs the same "
                                 "model with torch SDPA"}
    for table, title in titles.items():
        sel = [r for r in rows if r["table"] == table]
        if not sel:
            continue
        lines += [f"## {title}", "", "| case | ours ms | ref ms | time ratio | ours MiB | ref MiB | memory ratio |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in sel:
            case = " ".join(f"{k}={r[k]}" for k in ("seq", "dtype") if k in r) or "step"
            if "kernel" in r:
                case += f" ({r['kernel']} / {r['torch_kernel']})"
            if "error" in r:
                lines.append(f"| {case} | {r['ours_ms']:.1f} | {r['ref_ms']:.1f} | - | {r['ours_mib']:.1f} | "
                             f"{r['ref_mib']:.1f} | - ({r['error'][:60]}) |")
            else:
                lines.append(f"| {case} | {_ms(r['ours_ms'])} | {_ms(r['ref_ms'])} | {r['ratio']:.2f} | "
                             f"{r['ours_mib']:.1f} | {r['ref_mib']:.1f} | {r['memory_ratio']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--ms-seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--ms-plain-max", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--skip-mindspore", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "attention")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the local and train-step tables on one GPU (--cuda-seqs, --dtypes), in this process")
    parser.add_argument("--cuda-seqs", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda":
        rows = cuda_local(args.cuda_seqs, args.dtypes, args.iters) + cuda_train_step(args.iters * 3)
        out = args.out.with_name(args.out.name + "_cuda") if args.out.name == "attention" else args.out
        import torch

        write_results(out, {**host_meta(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, rows,
                      markdown(rows))
        return 0
    if args.case:
        kind, *rest = args.case
        if kind == "torch":
            result = case_torch(rest[0], int(rest[1]), rest[2], args.iters)
        elif kind == "mindspore":
            result = case_mindspore(rest[0], int(rest[1]), args.iters)
        else:
            result = case_train_step(rest[0], args.iters * 3)
        print(json.dumps(result))
        return 0
    rows: list[dict] = []
    for seq in args.seqs:
        for dtype in ("float32", "bfloat16"):
            ours = _spawn(["torch", "ours", str(seq), dtype, "--iters", str(args.iters)])
            ref = _spawn(["torch", "torch", str(seq), dtype, "--iters", str(args.iters)])
            _pair(rows, "local", {"seq": seq, "dtype": dtype}, ours, ref)
    if not args.skip_mindspore:
        for seq in args.ms_seqs:
            ours = _spawn(["mindspore", "ours", str(seq), "--iters", str(args.iters)])
            ref = (_spawn(["mindspore", "plain", str(seq), "--iters", str(args.iters)]) if seq <= args.ms_plain_max
                   else {"error": f"plain ops not run above --ms-plain-max={args.ms_plain_max} (score matrix)"})
            _pair(rows, "mindspore", {"seq": seq, "dtype": "float32"}, ours, ref)
    ours = _spawn(["train", "ours", "--iters", str(args.iters)])
    ref = _spawn(["train", "torch", "--iters", str(args.iters)])
    _pair(rows, "train step", {}, ours, ref)
    write_results(args.out, host_meta(), rows, markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
