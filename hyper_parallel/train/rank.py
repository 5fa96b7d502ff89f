"""The process of one rank: ``python -m hyper_parallel.train.rank CONFIG.json``, started by
the framework's launcher (torchrun, msrun, or ``launch.py``'s MindSpore scheduler+workers),
or run in place by ``hyper-parallel train`` when it finds itself inside such a launcher.

A rank that fails writes its traceback to ``<out>/.ranks/rank_N.error``; started by
``launch.py`` it also runs under a supervisor that records how it exited
(``<out>/.ranks/rank_N.exit``), so the launching process names the first rank to fail and
how ([Note: the first rank to fail] in ``exits.py``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from hyper_parallel.platform.launch import run_scheduler
from hyper_parallel.train.config import TrainConfig
from hyper_parallel.train.exits import ERROR_DIR, stacks_on_timeout, supervise
from hyper_parallel.train.exits import error_path as _error_path
from hyper_parallel.core.process_groups import barrier

__all__ = ["ERROR_DIR", "error_path", "in_launcher", "launcher_rank", "launcher_world_size", "main", "run_rank"]


def launcher_rank() -> int | None:
    """This process's rank as the launcher gave it, or ``None`` outside a launcher
    (torchrun: ``RANK``; msrun / MindSpore env launch: ``MS_NODE_ID`` or ``RANK_ID`` with ``MS_ROLE``)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    if os.environ.get("MS_ROLE") == "MS_WORKER":
        for name in ("MS_NODE_ID", "RANK_ID"):
            value = os.environ.get(name, "")
            if value.isdigit():
                return int(value)
        return 0
    return None


def launcher_world_size() -> int | None:
    """The number of ranks the launcher starts over all machines, or ``None`` outside a
    launcher (torchrun: ``WORLD_SIZE``; msrun / MindSpore env launch: ``MS_WORKER_NUM``)."""
    if not in_launcher():
        return None
    for name in ("WORLD_SIZE", "MS_WORKER_NUM"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def in_launcher() -> bool:
    """True inside torchrun/msrun (or our own launch): the ranks already exist."""
    return launcher_rank() is not None or os.environ.get("MS_ROLE") == "MS_SCHED"


def error_path(cfg: TrainConfig, rank: int) -> Path:
    """Where rank ``rank`` writes its traceback when it fails."""
    return _error_path(cfg.run_dir, rank)


def run_rank(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Join the world the launcher set up, train, leave. Returns the metrics rows."""
    if os.environ.get("MS_ROLE") == "MS_SCHED":  # msrun-style scheduler process
        run_scheduler()
        return []
    rank = launcher_rank() or 0
    # a run past --timeout leaves each rank's stacks for the launcher's report
    # ([Note: stacks of a hung run] in exits.py)
    with stacks_on_timeout(cfg.run_dir, rank, cfg.timeout_s):
        return _run_worker(cfg, rank)


def _run_worker(cfg: TrainConfig, rank: int) -> list[dict[str, Any]]:
    import hyper_parallel as hp

    # on MindSpore CPU, init_process_group launches operations blocking ([Note: MindSpore
    # CPU ranks launch blocking] in platform/launch.py)
    p = hp.init(cfg.platform)
    try:
        if p.device_type != "cpu":
            p.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        p.init_process_group()
        if p.world_size() != cfg.nproc:
            raise ValueError(f"the launcher started {p.world_size()} ranks but the layout {cfg.layout.describe()} "
                             f"needs --nproc {cfg.nproc}; launch {cfg.nproc} ranks")
        from hyper_parallel.train.loop import train

        rows = train(cfg)
        # Leave in order: no rank tears its connections down while a peer still uses
        # them. Without this the process group went down in the interpreter's exit, and
        # one CI run (pp 2 with --async-checkpoint) saw a rank abort there in native code
        # ("terminate called without an active exception") after a complete run.
        barrier()
        p.destroy_process_group()
        return rows
    except BaseException:
        path = error_path(cfg, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(traceback.format_exc())
        raise


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hyper_parallel.train.rank CONFIG.json", file=sys.stderr)
        return 2
    cfg = TrainConfig.from_dict(json.loads(Path(args[0]).read_text()))
    rank = launcher_rank()
    supervised = rank is not None and os.environ.get("MS_ROLE") != "MS_SCHED"
    if supervised:
        supervise(cfg.run_dir, rank)  # returns in the child process, which runs the rank
    run_rank(cfg)
    if supervised:
        # The forked child ends as multiprocessing's fork children do (popen_fork:
        # os._exit after the target returns), skipping the interpreter's teardown: the
        # run is complete, its files closed and the process group destroyed, but native
        # threads of the framework (gloo's workers, the store) still got destroyed while
        # joinable there and aborted a finished rank ("terminate called without an
        # active exception", seen twice in CI: pp 2 with --async-checkpoint, and tp 2).
        # A failing rank still exits normally, so its traceback prints.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
