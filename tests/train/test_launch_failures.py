"""``hyper-parallel train``'s launcher when a rank fails in the middle of a run: the
launcher, not the framework's heartbeat, finds the failed rank (its process exits), kills
every process of the run, and names the rank and its error. MindSpore's node timeout is
the run's ``--timeout`` (``train/launch.py``), so this is the only prompt way a MindSpore
run can learn of a failure; torch goes through torchrun.

The failure is injected with a ``sitecustomize`` module on the ranks' ``PYTHONPATH``
(Python imports it at start-up): in rank 1 only, it wraps ``loop._train_step`` so step 2
raises, after step 1's collectives ran on every rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hyper_parallel.testing.rendezvous import selected_platform
from tests.train._ranks import TEST_DATA

REPO = Path(__file__).resolve().parents[2]

#: The injected module. ``RANK`` is torchrun's; ``MS_NODE_ID`` the MindSpore worker's.
SITECUSTOMIZE = '''
import importlib.abc
import importlib.machinery
import os
import sys

RANK = os.environ.get("RANK") or (os.environ.get("MS_NODE_ID") if os.environ.get("MS_ROLE") == "MS_WORKER" else None)


class _FailStepTwo(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != "hyper_parallel.train.loop":
            return None
        sys.meta_path.remove(self)
        self.spec = importlib.machinery.PathFinder.find_spec(name, path)
        self.inner = self.spec.loader
        self.spec.loader = self
        return self.spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.inner.exec_module(module)
        train_step = module._train_step

        def failing(run, step):
            if step == 2:
                raise RuntimeError("injected failure at step 2")
            return train_step(run, step)

        module._train_step = failing


if RANK == "1":
    sys.meta_path.insert(0, _FailStepTwo())
'''


def test_failed_rank_is_named_and_the_run_stops(tmp_path: Path) -> None:
    """2 ranks, pp 2 (on MindSpore the node timeout is then the run's --timeout, 600 s):
    rank 1 raises at step 2 while rank 0 waits for its pipeline messages. The launch
    exits with 1 well before --timeout; the message names rank 1 and its error (a peer
    may fail too, of the connection rank 1 dropped), and no
    process of the run is left (every one was started in its own session and killed)."""
    platform = selected_platform()
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(inject), os.environ.get("PYTHONPATH", "")])}
    args = ["train", "--platform", platform, "--pp", "2", "--microbatches", "2", "--nproc", "2", "--model", "tiny",
            "--steps", "4", "--seq-len", "16", "--batch-size", "2", "--checkpoint-every", "0", "--timeout", "600",
            "--out", str(out), "--no-progress", "--data", *TEST_DATA]
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hyper_parallel.train.cli", *args], env=env, capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    elapsed = time.monotonic() - began
    text = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 1, text
    # MindSpore's workers are the launcher's own processes; torch's are torchrun's children
    assert ("rank 1 exited with code" if platform.startswith("mindspore") else "torchrun exited with code") in text, text
    assert "rank 1 failed: RuntimeError: injected failure at step 2" in text, text
    assert "exceeded --timeout" not in text, text
    # a liveness bound, not a speed figure: --timeout (600 s) would be the only other way out
    assert elapsed < 300, f"the failure took {elapsed:.0f} s to report"
    traceback = (out / ".ranks" / "rank_1.error").read_text()
    assert "injected failure at step 2" in traceback
    leftover = subprocess.run(["pgrep", "-f", str(out / "config.json")], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes of the run are left: {leftover.stdout}"
