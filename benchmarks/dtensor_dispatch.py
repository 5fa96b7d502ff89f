#!/usr/bin/env python3
"""Per-op dispatch overhead of DTensors on small tensors: hyper_parallel's DTensor beside
torch's own ``torch.distributed.tensor.DTensor`` in the same run (torch-cpu), and on
MindSpore its ``mint`` ops on DTensors beside the same ops on plain tensors.

2 ranks, float32, 1-D mesh; every op runs without communication (its inputs already
fit the rule), so the time is the dispatch itself plus the local kernel, which the
"local" column shows alone. Each measurement times ``--calls`` back-to-back calls and
divides; the median over ``--iters`` repetitions on rank 0 is reported (microseconds per
call). On torch the two DTensors alternate within each repetition (ours first in even
repetitions, torch's first in odd ones), and ratio = the median over repetitions of
hyper_parallel / torch DTensor in that repetition, so load that comes and goes on a
shared machine reaches both sides of a ratio alike. MindSpore alike: its ``mint`` op on
DTensors and the same op on plain tensors of the local size alternate, ratio = the median
of per-repetition hyper_parallel / plain (``--mindspore-only`` runs that half alone).

| op | shapes and placements |
|---|---|
| linear | ``F.linear(x [16, 64] Replicate, w [64, 64] Shard(0))`` -> ``Shard(-1)`` |
| add | ``a + b``, ``[64, 64]`` both ``Shard(0)`` |
| softmax | ``softmax(a, -1)``, ``[64, 64]`` ``Shard(0)`` |
| linear fwd+bwd | the linear, ``.sum().backward()`` |
| AdamW step | ``torch.optim.AdamW(foreach=True).step()`` on 4 ``[64, 64]`` ``Shard(0)`` parameters with gradients |
| reshape (MindSpore) | ``a.reshape(64, 8, 8)``, ``[64, 64]`` ``Shard(0)`` (stays ``Shard(0)``) |

    python benchmarks/dtensor_dispatch.py [--calls 200] [--iters 21] [--no-mindspore | --mindspore-only]

Where a MindSpore call's time went (issue 38 item 2; 2 ranks, calling-thread CPU time per
call, so that other sessions' load on the 2-core host stays out; ``uptime`` beside each run):

1. MindSpore's ``__fallback__`` round trip itself, in its C++ (finding the hook, building the
   primitive's call object and the arguments, calling into Python, taking a Tensor subclass
   back): a subclass whose hook only unwraps and calls costs 3.0x a plain reshape (+7 us),
   1.3x an add and 1.3-1.4x a softmax (+13-25 us), and a DTensor result handed back costs
   about 5 us more than a plain one. Nothing in this project can shorten it; ``+ - * /`` and
   ``reshape`` / ``view`` now go around it (methods of the class, [Note: MindSpore Tensor
   methods on DTensors]); ``mint`` functions (softmax, linear) cannot.
2. linear: the gradient sum of its Replicate input (the Megatron "f" operator, a MindSpore
   custom function per call): 27 us of the 32 us Python; now left out while MindSpore records
   nothing (a cached call outside ``value_and_grad``/``grad``/``vjp``).
3. The cached path's Python (5.2-6.0 us for softmax, reshape, add): copies of the arguments,
   ``DTensor.__new__``/``__init__``, ``NoFallbackGuard`` (1 us), the key (a MindSpore dtype's
   hash is a pybind call, 0.3-0.6 us); now 3.4-4.2 us, 2.5 us on a reshape's shorter key.
4. Wrapping the result (``Tensor._make_subclass`` of a new output, its attributes): ~1.7 us,
   half of a plain reshape (3.7 us): a reshape cannot come under 1.5x through a subclass.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, write_results  # noqa: E402  (after the path insert)

OPS = ("linear", "add", "softmax", "linear fwd+bwd", "AdamW step")


def _per_call_us(fn: Callable[[], object], calls: int, iters: int) -> float:
    fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def _interleaved_us(fns: tuple[Callable[[], object], Callable[[], object]], calls: int,
                    iters: int) -> tuple[float, float, float]:
    """Medians of microseconds per call of two functions timed alternately (``calls``
    calls each per repetition, the order swapped every repetition), and the median of
    their per-repetition ratio (first / second)."""
    for fn in fns:
        fn()
    samples: tuple[list[float], list[float]] = ([], [])
    for rep in range(iters):
        for index in ((0, 1) if rep % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            for _ in range(calls):
                fns[index]()
            samples[index].append((time.perf_counter() - start) / calls * 1e6)
    ratios = [a / b for a, b in zip(*samples)]
    return statistics.median(samples[0]), statistics.median(samples[1]), statistics.median(ratios)


def bench_torch(calls: int, iters: int) -> list[dict]:
    """Runs on every rank (torch-cpu): microseconds per call for each op and implementation."""
    import torch
    import torch.distributed.tensor as tdt
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import hyper_parallel as hp

    torch.set_num_threads(1)
    p = hp.get_platform()
    n = p.world_size()
    meshes = {"hyper_parallel": (hp, hp.init_device_mesh(p.device_type, (n,))), "torch": (tdt, torch_mesh("cpu", (n,)))}
    torch.manual_seed(0)
    x, w, a, b = (torch.randn(16, 64), torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64))
    fns: dict[str, dict[str, Callable[[], object]]] = {}
    for impl, (module, mesh) in meshes.items():
        def dist(t: torch.Tensor, placement: object, module=module, mesh=mesh) -> object:
            return module.distribute_tensor(t, mesh, [placement])

        xd, wd = dist(x, module.Replicate()), dist(w, module.Shard(0))
        ad, bd = dist(a, module.Shard(0)), dist(b, module.Shard(0))
        wg = torch.nn.Parameter(dist(w, module.Shard(0)))
        params = [torch.nn.Parameter(dist(torch.randn(64, 64), module.Shard(0))) for _ in range(4)]
        for param in params:
            param.grad = dist(torch.randn(64, 64), module.Shard(0))
        optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)

        def fwd_bwd(xd=xd, wg=wg) -> None:
            F.linear(xd, wg).sum().backward()

        fns[impl] = {"linear": lambda xd=xd, wd=wd: F.linear(xd, wd), "add": lambda ad=ad, bd=bd: ad + bd,
                     "softmax": lambda ad=ad: torch.softmax(ad, -1), "linear fwd+bwd": fwd_bwd,
                     "AdamW step": optimizer.step}
    rows = []
    for op in OPS:
        ours, theirs, ratio = _interleaved_us((fns["hyper_parallel"][op], fns["torch"][op]), calls, iters)
        rows.append({"op": op, "impl": "hyper_parallel", "us": ours, "ratio": ratio})
        rows.append({"op": op, "impl": "torch", "us": theirs})
    # the local kernels alone (rank 0's pieces), for scale
    xl, wl, al, bl = x, w[: 64 // n], a[: 64 // n], b[: 64 // n]
    wgl = torch.nn.Parameter(wl.clone())
    plain = [torch.nn.Parameter(torch.randn(64 // n, 64)) for _ in range(4)]
    for param in plain:
        param.grad = torch.randn(64 // n, 64)
    optimizer = torch.optim.AdamW(plain, lr=1e-3, foreach=True)
    local = {"linear": lambda: F.linear(xl, wl), "add": lambda: al + bl, "softmax": lambda: torch.softmax(al, -1),
             "linear fwd+bwd": lambda: F.linear(xl, wgl).sum().backward(), "AdamW step": optimizer.step}
    for op in OPS:
        rows.append({"op": op, "impl": "local", "us": _per_call_us(local[op], calls, iters)})
    return rows


def bench_mindspore(calls: int, iters: int) -> list[dict]:
    """Runs on every rank (mindspore-cpu): MindSpore's own ops on DTensors (intercepted by
    ``__fallback__``) and the same ops on plain (local-sized) tensors."""
    import numpy as np
    from mindspore import mint

    import hyper_parallel as hp

    F = mint.nn.functional

    p = hp.get_platform()
    n = p.world_size()
    mesh = hp.init_device_mesh(p.device_type, (n,))
    rng = np.random.default_rng(0)
    x = p.from_numpy(rng.standard_normal((16, 64)).astype(np.float32))
    w = p.from_numpy(rng.standard_normal((64 // n, 64)).astype(np.float32))
    a = p.from_numpy(rng.standard_normal((64 // n, 64)).astype(np.float32))
    xd = hp.DTensor.from_local(x, mesh, [hp.Replicate()])
    wd = hp.DTensor.from_local(w, mesh, [hp.Shard(0)])
    ad = hp.DTensor.from_local(a, mesh, [hp.Shard(0)])
    fns = {
        "linear": (lambda: F.linear(xd, wd), lambda: F.linear(x, w)),
        "add": (lambda: ad + ad, lambda: a + a),
        "softmax": (lambda: F.softmax(ad, dim=-1), lambda: F.softmax(a, dim=-1)),
        "reshape": (lambda: ad.reshape(64, 8, 8), lambda: a.reshape(64 // n, 8, 8)),
    }
    rows = []
    for op, pair in fns.items():
        ours, plain, ratio = _interleaved_us(pair, calls, iters)
        rows.append({"op": op, "impl": "hyper_parallel", "us": ours, "ratio": ratio})
        rows.append({"op": op, "impl": "plain", "us": plain})
    return rows


def summarize(rows: list[dict], framework: str) -> list[dict]:
    by_op: dict[str, dict] = {}
    for row in rows:
        entry = by_op.setdefault(row["op"], {"framework": framework, "op": row["op"]})
        entry[f"{row['impl']}_us"] = row["us"]
        if "ratio" in row:
            entry["ratio"] = row["ratio"]  # the median of per-repetition ratios (torch)
    reference = "torch_us" if framework == "torch" else "plain_us"
    for entry in by_op.values():
        entry.setdefault("ratio", entry["hyper_parallel_us"] / entry[reference])
    return list(by_op.values())


def markdown(results: list[dict], world: int) -> str:
    lines = [f"# DTensor dispatch overhead per op ({world} ranks, CPU, float32, one thread)", "",
             "Microseconds per call, median of repetitions on rank 0. torch: the two DTensors alternate "
             "within each repetition, ratio = median over repetitions of hyper_parallel / "
             "torch.distributed.tensor; local = the local kernel alone. MindSpore: mint ops on DTensors "
             "(intercepted by __fallback__) alternating with the same op on plain tensors of the local size, ratio = "
             "median over repetitions of DTensor / plain.", "",
             "| framework | op | hyper_parallel µs | reference µs | local µs | ratio |", "|---|---|---:|---:|---:|---:|"]
    for e in results:
        reference = e.get("torch_us", e.get("plain_us"))
        local = e.get("local_us")
        lines.append(f"| {e['framework']} | {e['op']} | {e['hyper_parallel_us']:.0f} | {reference:.0f} | "
                     f"{'' if local is None else f'{local:.0f}'} | {e['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--iters", type=int, default=21)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--no-mindspore", action="store_true")
    parser.add_argument("--mindspore-only", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dtensor_dispatch")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank functions by name, which __main__ cannot give them.
    from benchmarks.dtensor_dispatch import bench_mindspore, bench_torch

    results = [] if args.mindspore_only else summarize(
        run_on_ranks(bench_torch, args.world_size, args.calls, args.iters, platform="torch-cpu", timeout_s=1200)[0],
        "torch")
    if not args.no_mindspore:
        results += summarize(run_on_ranks(bench_mindspore, args.world_size, args.calls // 4, args.iters,
                                          platform="mindspore-cpu", timeout_s=1200)[0], "mindspore")
    meta = {"world_size": args.world_size, "calls": args.calls, "iters": args.iters, **host_meta()}
    write_results(args.out, meta, results, markdown(results, args.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
