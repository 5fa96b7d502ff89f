"""``hyper-parallel train``'s launcher when a rank fails in the middle of a run: the
launcher, not the framework's heartbeat, finds the failed rank (its process exits), kills
every process of the run, and names the rank and its error. MindSpore's node timeout is
the run's ``--timeout`` (``train/launch.py``), so this is the only prompt way a MindSpore
run can learn of a failure; torch goes through torchrun.

The failure is injected with a ``sitecustomize`` module on the ranks' ``PYTHONPATH``
(Python imports it at start-up): in one rank only, it wraps ``loop._train_step`` so step 2
raises, or the rank SIGKILLs itself (as the out-of-memory killer would), after step 1's
collectives ran on every rank. The report must name that rank first, and how it ended,
however the other ranks fail after it ([Note: the first rank to fail] in train/exits.py).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from hyper_parallel.testing.rendezvous import selected_platform
from tests.train._cli import run_cli
from tests.train._ranks import TEST_DATA


#: The injected module. ``RANK`` is torchrun's; ``MS_NODE_ID`` the MindSpore worker's.
SITECUSTOMIZE = '''
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time

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
            if step == 2 and ACTION == "raise":
                raise RuntimeError("injected failure at step 2")
            if step == 2 and ACTION == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 2 and ACTION == "hang":
                time.sleep(3600)
            return train_step(run, step)

        module._train_step = failing


if RANK == FAILING_RANK:
    sys.meta_path.insert(0, _FailStepTwo())
'''


def _launch_failing(tmp_path: Path, rank: int, action: str, layout: list[str],
                    timeout_s: int = 600) -> tuple[int, str, float, Path]:
    """``hyper-parallel train`` on the selected backend with rank ``rank`` failing at step 2
    (``action``: ``"raise"``, ``"sigkill"`` or ``"hang"``): exit status, output tail,
    seconds, --out."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(f"FAILING_RANK = {str(rank)!r}\nACTION = {action!r}\n" + SITECUSTOMIZE)
    out = tmp_path / "run"
    # MindSpore's node timeout at least 600 s (it is --timeout unless set), so only the
    # launcher noticing the failed process, or its own --timeout, can end the run
    env = {"PYTHONPATH": str(inject), "MS_NODE_TIMEOUT": "600", "MS_HEARTBEAT_RETRY_TIMEOUT": "600"}
    args = ["train", "--platform", selected_platform(), *layout, "--model", "tiny", "--steps", "4", "--seq-len", "16",
            "--checkpoint-every", "0", "--timeout", str(timeout_s), "--out", str(out), "--no-progress", "--data",
            *TEST_DATA]
    began = time.monotonic()
    # a hung launcher would be killed by run_cli's subprocess bound (the launcher's own group
    # kill is what is under test, so it cannot be the only bound)
    done = run_cli(args, tmp_path, env=env, check=False, timeout_s=timeout_s)
    return done.returncode, done.stdout[-4000:] + done.stderr[-4000:], time.monotonic() - began, out


def _no_process_left(out: Path) -> None:
    leftover = subprocess.run(["pgrep", "-f", str(out / "config.json")], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes of the run are left: {leftover.stdout}"


def test_failed_rank_is_named_and_the_run_stops(tmp_path: Path) -> None:
    """2 ranks, pp 2 (on MindSpore the node timeout is then the run's --timeout, 600 s):
    rank 1 raises at step 2 while rank 0 waits for its pipeline messages. The launch
    exits with 1 well before --timeout; the message names rank 1 and its error first (a
    peer may fail too, of the connection rank 1 dropped: a consequence), and no
    process of the run is left (every one was started in its own session and killed)."""
    code, text, elapsed, out = _launch_failing(
        tmp_path, 1, "raise", ["--pp", "2", "--microbatches", "2", "--nproc", "2", "--batch-size", "2"])
    assert code == 1, text
    # MindSpore's workers are the launcher's own processes; torch's are torchrun's children
    launcher = "rank 1 exited with code 1" if selected_platform().startswith("mindspore") else "torchrun exited with code"
    assert launcher in text, text
    assert "first failure: rank 1 failed: RuntimeError: injected failure at step 2 (exit code 1; traceback:" in text, text
    assert "exceeded --timeout" not in text, text
    # a liveness bound, not a speed figure: --timeout (600 s) would be the only other way out
    assert elapsed < 300, f"the failure took {elapsed:.0f} s to report"
    traceback = (out / ".ranks" / "rank_1.error").read_text()
    assert "injected failure at step 2" in traceback
    _no_process_left(out)


def test_killed_rank_is_named_first(tmp_path: Path) -> None:
    """4 ranks (dp-shard 4): rank 2 is SIGKILLed at step 2 and leaves no traceback; the
    others then fail of the dropped connections (gloo: "Connection reset by peer") or are
    stopped by the launcher. The report names rank 2 first, with its signal, and the
    survivors only after it, as consequences; the run ends promptly, no process left."""
    code, text, elapsed, out = _launch_failing(tmp_path, 2, "sigkill", ["--nproc", "4", "--batch-size", "4"])
    assert code == 1, text
    if selected_platform().startswith("mindspore"):
        assert "rank 2 was killed by signal 9 (SIGKILL)" in text, text
    report = text[text.index("first failure: "):]
    assert report.startswith("first failure: rank 2 failed: killed by signal 9 (SIGKILL) without a Python error"), text
    later = report.split("\n", 1)[1] if "\n" in report else ""
    # every other rank named is named after the cause, as its consequence
    if "rank " in later.replace("rank 2's", ""):
        assert later.startswith("then, as consequences of rank 2's failure:"), text
    assert "exceeded --timeout" not in text, text
    assert elapsed < 300, f"the failure took {elapsed:.0f} s to report"
    record = (out / ".ranks" / "rank_2.exit").read_text()
    assert f'"exit_code": -{int(signal.SIGKILL)}' in record, record
    _no_process_left(out)


def test_hung_rank_is_shown_where_it_waits(tmp_path: Path) -> None:
    """2 ranks (dp-shard 2): rank 1 stops at step 2 (a sleep: a rank stuck outside any
    collective) and rank 0 blocks in the step's first collective. Nothing fails, so only
    --timeout (60 s) ends the run: the launcher kills every process and quotes where each
    rank was from the stacks the ranks wrote just before the timeout ([Note: stacks of a
    hung run] in train/exits.py): rank 1 in the injected sleep, rank 0 elsewhere."""
    code, text, elapsed, out = _launch_failing(tmp_path, 1, "hang", ["--nproc", "2", "--batch-size", "2"],
                                               timeout_s=60)
    assert code == 1, text
    assert "the run exceeded --timeout 60 s" in text, text
    assert "where the ranks were at the timeout (innermost frame first):" in text, text
    where = text[text.index("where the ranks were"):]
    rank_1 = where[where.index("rank 1 ("):]
    assert "sitecustomize.py" in rank_1 and "in failing" in rank_1, text
    rank_0 = where[where.index("rank 0 ("):where.index("rank 1 (")]
    assert "in failing" not in rank_0 and "hyper_parallel" in rank_0, text
    assert elapsed < 200, f"the timeout took {elapsed:.0f} s to report"
    _no_process_left(out)


def test_taken_scheduler_port_starts_the_run_again(tmp_path: Path, monkeypatch, capfd) -> None:
    """MindSpore: another process holds the port picked for the scheduler (``free_port``
    can only pick a port free at that moment). The scheduler exits at once and its workers
    would wait for it until the node timeout (the run's --timeout): the launcher sees the
    scheduler's exit and the taken port, and starts the run again on another port."""
    if not selected_platform().startswith("mindspore"):
        pytest.skip("torchrun binds its own rendezvous port; the scheduler is MindSpore's")
    import socket

    from hyper_parallel.platform import launch as platform_launch
    from hyper_parallel.train.launch import launch
    from tests.train._ranks import tiny_config

    with socket.socket() as holder:
        holder.bind((platform_launch.HOST, 0))
        holder.listen()
        taken = holder.getsockname()[1]
        picks = iter([taken])
        free_port = platform_launch.free_port
        monkeypatch.setattr(platform_launch, "free_port",
                            lambda host=platform_launch.HOST: next(picks, 0) or free_port(host))
        cfg = tiny_config(str(tmp_path / "run"), steps=1, eval_every=1, timeout_s=300, platform=selected_platform())
        began = time.monotonic()
        launch(cfg)
    assert f"port {taken} was taken before MindSpore's scheduler bound it" in capfd.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert time.monotonic() - began < 200, "the run waited for the dead scheduler"
