#!/usr/bin/env python3
"""Counts of torch's op_db on DTensors: this package's DTensor beside torch's own
``torch.distributed.tensor`` on the same cases (torch-cpu, gloo), and on MindSpore the
same samples through ``mindspore.mint``. The cases and verdicts are those of
``tests/dtensor/test_opinfo_sweep.py`` (``tests/dtensor/_opinfo_sweep.py``): every float32
op's first sample, forward and gradients, each tensor input Replicate, Shard(0),
Shard(-1) and mixed on a mesh of 2 ranks; one of (Shard(0), Shard(-1)), (Shard(-1),
Shard(0)), (Shard(0), Shard(0)) per op in turn on a 2x2 mesh (4 ranks). MindSpore runs
one mode per op on both meshes, as its test does.

Writes ``results/dtensor_opinfo.{json,md}``: ok / unchecked / refused / error / wrong per
implementation and mesh, and the ops of every case that is not ok.

    python benchmarks/dtensor_opinfo.py [--no-torch-dtensor] [--no-mindspore]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, write_results  # noqa: E402  (after the path insert)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-torch-dtensor", action="store_true", help="skip torch.distributed.tensor")
    parser.add_argument("--no-mindspore", action="store_true", help="skip the mindspore.mint sweep")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks
    from tests.dtensor import _opinfo_sweep as sweep

    runs = [("hyper_parallel (torch)", "torch-cpu", "ours"), ("torch.distributed.tensor", "torch-cpu", "torch"),
            ("hyper_parallel (MindSpore mint)", "mindspore-cpu", "mindspore")]
    rows, details = [], {}
    for label, platform, impl in runs:
        if (impl == "torch" and args.no_torch_dtensor) or (impl == "mindspore" and args.no_mindspore):
            continue
        for mesh in ((2,), (2, 2)):
            world = 2 if len(mesh) == 1 else 4
            if impl == "mindspore":
                names = sorted({op.name for op in sweep.float32_ops() if sweep.mint_function(op.name)})
                verdicts = sweep.merge(run_on_ranks(sweep.sweep_mindspore, world, mesh, sweep.portable_cases(names), True,
                                        platform=platform, timeout_s=3000))
            else:
                verdicts = sweep.merge(run_on_ranks(sweep.sweep_torch, world, impl, mesh, None, 1, len(mesh) > 1,
                                        platform=platform, timeout_s=3000))
            counts = sweep.summarize(verdicts)
            mesh_name = "x".join(map(str, mesh))
            rows.append({"implementation": label, "mesh": mesh_name, "ops": len({v.op for v in verdicts}),
                         "cases": len(verdicts), **counts})
            details[f"{label} {mesh_name}"] = [v.__dict__ for v in verdicts if v.verdict != "ok"]
            print(rows[-1], flush=True)
    columns = ["implementation", "mesh", "ops", "cases", *sweep.VERDICTS]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    write_results(REPO / "benchmarks" / "results" / "dtensor_opinfo", host_meta(), rows, "\n".join(lines) + "\n",
                  not_ok=details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
