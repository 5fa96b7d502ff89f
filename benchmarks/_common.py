"""What every benchmark script shares: timing a call across ranks and writing its results.

Not a benchmark itself (``run_all.py`` skips ``_``-prefixed files)."""

from __future__ import annotations

import json
import os
import platform as host_platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def host_meta() -> dict[str, str]:
    """The machine and Python a result came from (for the JSON ``meta``)."""
    return {"host": host_platform.platform(), "python": sys.version.split()[0], "cpus": str(os.cpu_count()),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset")}


def add_step_arguments(parser: Any, iters: int, warmup: int) -> None:
    """The options of a benchmark of the job's training step: ``--model`` (a preset),
    ``--seq-len``, ``--batch-size`` (sequences per step), ``--iters`` (timed steps) and
    ``--warmup`` (untimed steps first)."""
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--warmup", type=int, default=warmup)


def step_arguments(doc: str | None, name: str, iters: int, warmup: int, world_sizes: tuple[int, ...] = ()) -> Any:
    """The parsed command line of a step benchmark: ``add_step_arguments`` and ``--out``
    (default ``benchmarks/results/<name>``), with ``doc`` as the help text; with
    ``world_sizes``, ``--world-size`` among them (default the largest)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, iters=iters, warmup=warmup)
    if world_sizes:
        parser.add_argument("--world-size", type=int, default=max(world_sizes), choices=world_sizes,
                            help="run the world sizes up to this one")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / name)
    return parser.parse_args()


def ratio_cell(entry: dict[str, Any], key: str) -> str:
    """A ratio of a results table, two decimals, or empty where ``entry`` has none."""
    return f"{entry[key]:.2f}" if key in entry else ""


def timed(fn: Callable[[], Any], warmup: int, iters: int, barrier: Callable[[], Any]) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones; every call
    starts right after ``barrier()`` so that the ranks start together."""
    times = []
    for i in range(warmup + iters):
        barrier()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return times


def peak_tensor_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of live tensors while ``fn()`` runs, by torch's
    ``torch.distributed._tools.mem_tracker.MemTracker`` (every tensor storage the call
    allocates, its inputs included, tracked through a dispatch mode; deterministic, unlike
    the RSS of a reused process, which the allocator blurs). torch only."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return int(sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values()))


def write_results(out: Path, meta: dict[str, Any], results: Any, table: str, **extra: Any) -> None:
    """Write ``out.json`` (``{"meta", "results", **extra}``) and ``out.md`` (``table``), then
    print the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results, **extra}, indent=2))
    out.with_suffix(".md").write_text(table)
    print(table)
