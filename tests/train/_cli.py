"""``hyper-parallel`` from a shell, as the tests run it: one definition of the command,
its environment and its bounds."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: ``--timeout`` of a ``train`` launched by a test (a run here takes 20-120 s): past it the
#: launcher kills every process and quotes where each rank was ([Note: stacks of a hung
#: run] in train/exits.py), which a kill by pytest-timeout would not show.
LAUNCH_TIMEOUT_S = 300
#: how much longer the test waits for the launcher itself, which never hangs after its --timeout
_LAUNCHER_MARGIN_S = 120


def run_cli(args: Sequence[str], cwd: Path, *, env: Mapping[str, str] | None = None, check: bool = True,
            timeout_s: int = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``python -m hyper_parallel.train.cli *args`` in ``cwd`` with this checkout first on
    ``PYTHONPATH`` (``env``: extra variables). A ``train`` without ``--timeout`` gets
    ``--timeout timeout_s``. ``check``: assert it exited 0, quoting its output's tails."""
    args = list(args)
    if args and args[0] == "train" and "--timeout" not in args:
        args[1:1] = ["--timeout", str(timeout_s)]
    extra = dict(env or {})
    path = os.pathsep.join(x for x in (str(REPO), extra.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")) if x)
    done = subprocess.run([sys.executable, "-m", "hyper_parallel.train.cli", *args],  # noqa: S603
                          env={**os.environ, **extra, "PYTHONPATH": path}, capture_output=True, text=True,
                          timeout=timeout_s + _LAUNCHER_MARGIN_S, cwd=cwd)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
