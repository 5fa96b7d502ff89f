"""Starting the ranks of a run from a plain shell, through the framework's own launcher.

torch: ``python -m torch.distributed.run --standalone --nproc-per-node N -m
hyper_parallel.train.rank CONFIG.json`` (torchrun). MindSpore: one scheduler
(``MS_ROLE=MS_SCHED``, ``hyper_parallel.platform.launch.run_scheduler()``) plus N workers
(``MS_ROLE=MS_WORKER``, ``MS_NODE_ID``), all dialling ``MS_SCHED_HOST:MS_SCHED_PORT``, the
environment launch msrun itself performs; the same command runs under ``msrun`` on many machines.
Which processes and which environment: ``platform/launch.py``, shared with the test harness.

Every process is started in its own session, so a kill reaches everything it started.
A rank that fails, or a run past ``timeout_s``, kills the whole group; the error names the
first rank to fail and how (exit code or signal), then the others' errors as its
consequences ([Note: the first rank to fail] in ``exits.py``); past the timeout it quotes
where each rank was ([Note: stacks of a hung run]).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hyper_parallel.platform.launch import common_env, launch_commands, port_in_use
from hyper_parallel.train.config import TrainConfig
from hyper_parallel.train.exits import ERROR_DIR, describe_exit, hung_report, report

#: seconds a MindSpore scheduler may outlive its workers before it is stopped
SCHEDULER_GRACE_S = 10.0
#: seconds the launcher waits past --timeout for the ranks' stack dumps ([Note: stacks of
#: a hung run] in exits.py: a rank that started late dumps a little late)
STACKS_WAIT_S = 3.0
#: starts of a MindSpore run whose scheduler finds its port taken (``free_port`` picks a
#: port that another process can take before the scheduler binds it)
PORT_ATTEMPTS = 3
#: seconds the processes of a stopped run get to end on SIGTERM before SIGKILL
TERM_GRACE_S = 20.0


class LaunchError(RuntimeError):
    """A rank failed or the run timed out; the message names the rank(s)."""


def _base_env(cfg: TrainConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.update(common_env(cfg.platform))
    # the package this process imported, first on the ranks' path
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(x for x in (package_root, env.get("PYTHONPATH", "")) if x)
    return env


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL)  # noqa: S603


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop every process of the run. SIGTERM first: torchrun starts each rank in a
    session of its own, which a kill of torchrun's group does not reach, and stops its
    ranks itself on SIGTERM (each rank's supervisor ends on it, and its child with it:
    ``exits.supervise``); what is left after ``TERM_GRACE_S`` is SIGKILLed."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    for proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    for proc in running:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _commands(cfg: TrainConfig, config_path: Path) -> list[tuple[str, list[str], dict[str, str], bool]]:
    """``(label, argv, env, is_scheduler)`` per process to start (``launch_commands``)."""
    env = _base_env(cfg)
    rank_cmd = ["-m", "hyper_parallel.train.rank", str(config_path)]
    # node_timeout_s: MindSpore's heartbeat bound also caps how long a CPU receive waits for its message,
    # and a pipeline stage waits for its neighbour's whole forward or backward: with a
    # bound of a minute, a loaded 2-core host failed a pp 2 x dp-replicate 2 run in CI. A
    # failed rank is not found by this bound but by launch() (its process exits and the
    # group is killed: seconds, test_launch_failures), so it only has to outlast the run's
    # own --timeout.
    return [(command.label, list(command.argv), {**env, **command.env}, command.scheduler)
            for command in launch_commands(cfg.platform, cfg.nproc, rank_cmd, node_timeout_s=cfg.timeout_s)]


def launch(cfg: TrainConfig) -> None:
    """Run ``cfg`` on ``cfg.nproc`` local ranks and wait for them.

    Raises:
        LaunchError: a rank failed (named, with its last error line), MindSpore's
            scheduler failed (not for a taken port: then the run starts again on
            another, at most ``PORT_ATTEMPTS`` times), or the run exceeded
            ``cfg.timeout_s`` (every process is killed first).
    """
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    config_path = cfg.run_dir / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=1))
    deadline = time.monotonic() + cfg.timeout_s
    for attempt in range(1, PORT_ATTEMPTS + 1):
        shutil.rmtree(cfg.run_dir / ERROR_DIR, ignore_errors=True)
        try:
            _run(cfg, _commands(cfg, config_path), deadline)
            return
        except _PortTaken as taken:
            if attempt == PORT_ATTEMPTS:
                raise LaunchError(f"MindSpore's scheduler could not listen on port {taken.port}, nor on "
                                  f"{PORT_ATTEMPTS - 1} other free ports after it: another process took each before "
                                  "the scheduler bound it; retry the run") from None
            print(f"hyper-parallel train: port {taken.port} was taken before MindSpore's scheduler bound it; "
                  "starting the run again on another port", file=sys.stderr, flush=True)


class _PortTaken(Exception):
    """MindSpore's scheduler exited because another process holds its port."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.port = port


def _run(cfg: TrainConfig, specs: list[tuple[str, list[str], dict[str, str], bool]], deadline: float) -> None:
    """One start of the run's processes, watched until the workers end (see ``launch``).

    Raises:
        _PortTaken: MindSpore's scheduler found its port taken (its workers would wait for
            it until the node timeout, which is --timeout).
    """
    procs = [(label, _spawn(cmd, env), scheduler) for label, cmd, env, scheduler in specs]
    workers = [(label, proc) for label, proc, scheduler in procs if not scheduler]
    schedulers = [(proc, int(env["MS_SCHED_PORT"])) for (_, proc, scheduler), (_, _, env, _) in zip(procs, specs)
                  if scheduler]
    try:
        while True:
            codes = {label: proc.poll() for label, proc in workers}
            failed = {label: code for label, code in codes.items() if code not in (None, 0)}
            if failed:
                time.sleep(1.0)  # let a failing rank finish writing its error file
                names = ", ".join(f"{label} exited with code {code}" if code > 0 else f"{label} was {describe_exit(code)}"
                                  for label, code in failed.items())
                detail = report(cfg.run_dir)
                raise LaunchError(f"the run failed: {names}" + (f"\n{detail}" if detail else ""))
            if all(code == 0 for code in codes.values()):
                return
            for proc, port in schedulers:  # the workers would wait for a failed scheduler until the node timeout
                code = proc.poll()
                if code not in (None, 0):
                    if port_in_use(port):
                        raise _PortTaken(port)
                    raise LaunchError(f"MindSpore's scheduler ended ({describe_exit(code)}) before the ranks "
                                      "finished (its output is above); killed every process")
            if time.monotonic() > deadline:
                running = [label for label, code in codes.items() if code is None]
                time.sleep(STACKS_WAIT_S)  # the ranks' stack dumps come due about now
                detail = "\n".join(part for part in (report(cfg.run_dir), hung_report(cfg.run_dir)) if part)
                raise LaunchError(f"the run exceeded --timeout {cfg.timeout_s:g} s; killed every process "
                                  f"({', '.join(running)} still running)" + (f"\n{detail}" if detail else ""))
            time.sleep(0.2)
    except KeyboardInterrupt:
        raise LaunchError("interrupted; killed every process of the run") from None
    finally:
        for proc, _ in schedulers:  # it returns once every worker has left; give it a moment
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=SCHEDULER_GRACE_S if all(p.poll() == 0 for _, p in workers) else 0.1)
        _kill([proc for _, proc, _ in procs])
