#!/usr/bin/env python3
"""The experts' grouped GEMM (``Platform.grouped_matmul``) beside what it replaces and
what it calls, one process, forward + backward: the platform member (torch's
``torch.nn.functional.grouped_mm`` where ``Capability.GROUPED_MATMUL``, else one matmul
per expert), torch's ``grouped_mm`` called directly (the member's overhead) and one
``x_e @ w_e^T`` per expert concatenated (the loop the job ran before, and torchtitan's
``_run_experts_for_loop``). The three alternate within each repetition; ratio = the median
over repetitions of the member / the loop, and of the member / the direct call.

Shapes: ``[tokens, dim]`` rows grouped over ``experts`` (uneven: expert ``e`` gets a share
proportional to ``e + 1``), weights ``[experts, hidden, dim]`` (Linear's layout per
expert), float32. Milliseconds per forward + backward (``out.sum()`` backward).

    python benchmarks/grouped_matmul.py [--iters 21] [--calls 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, write_results  # noqa: E402  (after the path insert)

#: (name, tokens, dim, hidden, experts): moe-small's expert GEMM at a step's tokens, and wider ones
CASES = [("moe-small", 2048, 128, 96, 8), ("wide", 4096, 256, 512, 8), ("many experts", 4096, 256, 256, 32)]


def _ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def run_case(tokens: int, dim: int, hidden: int, experts: int, iters: int, calls: int) -> dict:
    import torch

    from hyper_parallel.platform import Capability, get_platform

    p = get_platform()
    torch.manual_seed(0)
    weights = [e + 1 for e in range(experts)]
    sizes = [tokens * w // sum(weights) for w in weights]
    sizes[-1] += tokens - sum(sizes)
    x = torch.randn(tokens, dim, requires_grad=True)
    w = torch.randn(experts, hidden, dim, requires_grad=True)
    offsets = torch.tensor(list(torch.tensor(sizes).cumsum(0)), dtype=torch.int32)

    def member() -> None:
        p.grouped_matmul(x, w, sizes).sum().backward()

    def direct() -> None:
        torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=offsets).backward(torch.ones(tokens, hidden))

    def loop() -> None:
        parts = torch.split(x, sizes)
        torch.cat([part @ w[e].t() for e, part in enumerate(parts)]).sum().backward()

    fns = {"member": member, "direct": direct, "loop": loop}
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(iters):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for name in order:
            samples[name].append(_ms(fns[name], calls))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {**{f"{name}_ms": round(value, 3) for name, value in medians.items()},
            "member_over_loop": round(statistics.median(m / l for m, l in zip(samples["member"], samples["loop"])), 3),
            "member_over_direct": round(statistics.median(m / d for m, d in zip(samples["member"], samples["direct"])),
                                        3),
            "kernel": Capability.GROUPED_MATMUL in p.capabilities()}


def markdown(rows: list[dict]) -> str:
    lines = ["# Grouped expert GEMM: Platform.grouped_matmul beside torch's grouped_mm and a per-expert loop "
             "(torch-cpu, float32, forward + backward, one process)", "",
             "Median ms per forward + backward; the three alternate within each repetition; ratios are medians of "
             "per-repetition ratios.", "",
             "| case | tokens x dim -> hidden, experts | member ms | grouped_mm ms | loop ms | member / loop | "
             "member / grouped_mm |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['tokens']} x {r['dim']} -> {r['hidden']}, {r['experts']} | {r['member_ms']} "
                     f"| {r['direct_ms']} | {r['loop_ms']} | {r['member_over_loop']:.2f} | "
                     f"{r['member_over_direct']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=21)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "grouped_matmul")
    args = parser.parse_args()
    os.environ["HYPER_PARALLEL_PLATFORM"] = "torch-cpu"  # the backend selection rule; set before the first use
    rows = []
    for case, tokens, dim, hidden, experts in CASES:
        row = run_case(tokens, dim, hidden, experts, args.iters, args.calls)
        rows.append({"case": case, "tokens": tokens, "dim": dim, "hidden": hidden, "experts": experts, **row})
        print(rows[-1], flush=True)
    write_results(args.out, {**host_meta(), "platform": "torch-cpu"}, rows, markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
