"""``hyper-parallel train`` inside the framework's launcher on several machines, played by
one host: two ``torchrun`` processes started together, ``--nnodes 2 --node-rank 0|1``,
2 ranks each, exactly the command of docs/train.md ("Many machines"). The job takes its
world size from the launcher (no ``--nproc``: torchrun's own parser would claim it as an
abbreviation of ``--nproc-per-node``), trains, writes one metrics file and a checkpoint
of 4 shards, and its losses equal the single-process reference's.

MindSpore's ``msrun`` cannot play two nodes on one host; docs/train.md says what fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.platform.launch import free_port
from hyper_parallel.testing.rendezvous import framework_of, selected_platform
from hyper_parallel.train import checkpoint
from hyper_parallel.train.cli import build_parser, config_from_args
from tests.train._ranks import TEST_DATA, reference_losses

REPO = Path(__file__).resolve().parents[2]
#: seconds both nodes together may take before every process of both is killed (measured
#: 29 s on a loaded 2-core host)
TIMEOUT_S = 300


def _torchrun() -> list[str]:
    """The ``torchrun`` installed beside this interpreter (``python -m torch.distributed.run``
    is the same program)."""
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _run_nodes(commands: list[list[str]], env: dict[str, str], cwd: Path) -> list[tuple[int, str]]:
    """Start every command at once, each in its own session; wait for all. Past
    ``TIMEOUT_S`` every process group is killed and the test fails."""
    logs = [cwd / f"node{i}.log" for i in range(len(commands))]
    procs = []
    for command, log in zip(commands, logs):
        with log.open("w") as f:
            procs.append(subprocess.Popen(command, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for p in procs:  # torchrun's ranks are in sessions of their own: stopping torchrun stops them
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    outputs = [log.read_text()[-3000:] for log in logs]
    assert time.monotonic() < deadline, f"the nodes took over {TIMEOUT_S} s; killed:\n" + "\n".join(outputs)
    return [(p.returncode, text) for p, text in zip(procs, outputs)]


@pytest.mark.skipif(framework_of(selected_platform()) != "torch", reason="torchrun runs torch ranks")
def test_two_nodes_through_torchrun(run_on_ranks, tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = ["-m", "hyper_parallel.train.cli", "train", "--platform", selected_platform(), "--tp", "2", "--dp-shard",
           "2", "--model", "tiny", "--steps", "2", "--seq-len", "16", "--batch-size", "4", "--out", str(out),
           "--no-progress", "--data", *TEST_DATA]
    port = free_port()
    commands = [[*_torchrun(), "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr",
                 "127.0.0.1", "--master-port", str(port), *job] for node in (0, 1)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for code, text in _run_nodes(commands, env, tmp_path):
        assert code == 0, text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(len(row["peak_memory_bytes"]) == 4 for row in rows)  # one entry per rank of both nodes
    manifest = checkpoint.read_manifest(out / "checkpoints" / "step_00000002")
    assert manifest["world_size"] == 4 and sorted(manifest["shards"]) == [f"rank_{r:05d}.safetensors" for r in range(4)]
    # the ranks' config, as the launcher-less command line would build it for 4 ranks
    cfg = config_from_args(build_parser().parse_args([*job[2:], "--nproc", "4"]))
    ref = run_on_ranks(reference_losses, cfg.to_dict(), world_size=1, timeout_s=300)[0]
    # tp 2 x dp-shard 2 against one process: the same sums in other orders, as in
    # test_train.py's layout parity (rtol 2e-5 over a few float32 steps)
    np.testing.assert_allclose([row["loss"] for row in rows], ref[0], rtol=2e-5, atol=0)
    np.testing.assert_allclose([row["val_loss"] for row in rows if "val_loss" in row], ref[1], rtol=2e-5, atol=0)
