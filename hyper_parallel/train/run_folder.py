"""Run folders of ``hyper-parallel train``: each run writes its own folder, and no run writes
into another's. Decided by the launching process before any rank starts.

[Note: run folders]
* Without ``--out`` a run gets a new folder ``runs/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ...
  when that name is taken; created with ``mkdir``, which fails if another launch took it
  first), or ``runs/<NAME>`` with ``--run-name NAME``, and ``runs/latest`` becomes a
  symbolic link to it once every check passed. ``--resume`` without ``--out`` or
  ``--run-name`` continues the run ``runs/latest`` links to.
* A folder that holds another run (its ``config.json`` or ``metrics.jsonl``, or
  checkpoints in its checkpoint folder) is refused unless ``--resume`` (continue that run:
  the same model, ``preflight.check_resume``) or ``--overwrite`` (its outputs are deleted
  first: ``PREVIOUS_RUN`` and the checkpoint folder's ``step_*``, nothing else).
* Every run has an id (``new_run_id``), recorded in each checkpoint's index; retention
  deletes only checkpoints of the same id (``checkpoint``'s [Note: retention]).
* Inside torchrun/msrun every rank runs the command line itself, so the ranks could not
  agree on a date and time: there ``--out`` or ``--run-name`` is required (or ``--resume``,
  which reads the link), and only the launcher's rank 0 updates ``runs/latest``.

Every refusal is a ``ValueError`` naming the flag, the value, the rule and the fix.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

from hyper_parallel.train.checkpoint import complete_steps
from hyper_parallel.train.config import TrainConfig
from hyper_parallel.train.exits import ERROR_DIR
from hyper_parallel.train.metrics import METRICS_FILE, PLOT_FILE

#: where runs without ``--out`` go (relative to the working directory)
RUNS = Path("runs")
#: the link in ``RUNS`` to the newest run
LATEST = "latest"
#: what a run writes into its folder besides its checkpoints (``launch``, ``loop``, ``cli``)
CONFIG_FILE = "config.json"
PREVIOUS_RUN = (CONFIG_FILE, METRICS_FILE, PLOT_FILE, "parity.json", "reference", ERROR_DIR)
#: the files whose presence says a folder holds a run
RUN_MARKERS = (CONFIG_FILE, METRICS_FILE)


def new_run_id() -> str:
    """``"20250102-030405-1a2b3c4d"``: the launch's local date and time and 32 random bits."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def check_run_name(name: str) -> None:
    """``ValueError`` unless ``name`` is one folder name under ``runs/`` other than the link."""
    if not name or name in (".", "..", LATEST) or name.startswith(".") or os.sep in name or "/" in name:
        raise ValueError(f"--run-name={name!r} must be a folder name under {RUNS}/ (no '/', not starting with '.', "
                         f"not {LATEST!r}: {RUNS / LATEST} links to the newest run); use e.g. --run-name tp2-tiny")


def latest_target(runs: Path = RUNS) -> Path:
    """The run folder ``runs/latest`` names (the link's target, or the folder itself if an
    earlier version left a real folder there).

    Raises:
        ValueError: there is no ``runs/latest``, or it links to a folder that is gone.
    """
    link = runs / LATEST
    if link.is_symlink():
        target = runs / os.readlink(link)
        if not target.is_dir():
            raise ValueError(f"--resume without --out continues the run {link} links to, {str(target)!r}, which does "
                             "not exist; give --out (or --run-name) with the run folder to continue")
        return target
    if link.is_dir():
        return link
    raise ValueError(f"--resume without --out continues the newest run, {str(link)!r}, which does not exist here "
                     f"({Path.cwd()}); give --out (or --run-name) with the run folder to continue, or drop --resume")


def choose(out: str | None, run_name: str | None, resume: bool, runs: Path = RUNS) -> tuple[str, bool]:
    """The run folder of the flags, and whether ``runs/latest`` is to link to it: ``--out``
    as given (no link); ``runs/<run_name>``; with ``resume`` ``runs/latest``'s run; else
    ``runs/<date-time>`` (not created here: ``claim``). No side effects."""
    if out is not None and run_name is not None:
        raise ValueError(f"--out={out!r} and --run-name={run_name!r} both name the run folder; give one of them "
                         f"(--run-name NAME writes {RUNS}/NAME)")
    if out is not None:
        return out, False
    if run_name is not None:
        check_run_name(run_name)
        return str(runs / run_name), True
    if resume:
        return str(latest_target(runs)), False
    return str(runs / time.strftime("%Y%m%d-%H%M%S")), True


def claim(folder: Path) -> Path:
    """Create the new folder ``folder`` (a date-time name from ``choose``), or the first of
    ``folder-2``, ``folder-3``, ... that does not exist; returns it. ``mkdir`` fails when
    the name exists, so two launches in the same second get different folders. Another
    ``OSError`` is left to ``preflight.check_output_folders`` to report."""
    for n in range(1, 1000):
        candidate = folder if n == 1 else folder.with_name(f"{folder.name}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
        except OSError:
            return candidate
    raise ValueError(f"--out: {folder} and 998 numbered folders beside it exist; give --out or --run-name")


def previous_run(cfg: TrainConfig) -> list[str]:
    """What of another run ``cfg``'s folders hold: ``["config.json", "metrics.jsonl",
    "3 checkpoints (step_00000050 ... step_00000150) in runs/a/checkpoints"]``, empty if none."""
    found = [name for name in RUN_MARKERS if (cfg.run_dir / name).is_file()]
    steps = complete_steps(cfg.checkpoint_path)
    if steps:
        span = f"step_{steps[0]:08d}" + (f" ... step_{steps[-1]:08d}" if len(steps) > 1 else "")
        found.append(f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''} ({span}) in {cfg.checkpoint_path}")
    return found


def check_not_another_run(cfg: TrainConfig, overwrite: bool) -> None:
    """[Note: run folders]: ``ValueError`` if ``cfg``'s folders hold another run and neither
    ``cfg.resume`` nor ``overwrite`` is given, or if both are."""
    if overwrite and cfg.resume:
        raise ValueError("--overwrite deletes the run in the folder and --resume continues it; give one of them")
    if cfg.resume or overwrite:
        return
    found = previous_run(cfg)
    if found:
        flag = "--checkpoint-dir" if cfg.checkpoint_dir is not None and not any(
            (cfg.run_dir / name).is_file() for name in RUN_MARKERS) else "--out"
        value = cfg.checkpoint_dir if flag == "--checkpoint-dir" else cfg.out
        raise ValueError(f"{flag}={value!r} holds another run ({', '.join(found)}); a run never writes into "
                         f"another run's folder (its checkpoints would mix with this run's); leave --out out (each "
                         f"run gets a new folder under {RUNS}/), give a new {flag}, --resume to continue that run "
                         "(same model), or --overwrite to delete it and start over")


def clear_previous_run(cfg: TrainConfig) -> list[str]:
    """``--overwrite``: delete what a run wrote into ``cfg``'s folders (``PREVIOUS_RUN`` in
    the run folder, ``step_*`` and unfinished ``.step_*.tmp`` folders in the checkpoint
    folder; nothing else). Returns what was deleted, as ``previous_run`` describes it."""
    found = previous_run(cfg)
    for name in PREVIOUS_RUN:
        path = cfg.run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink(missing_ok=True)
    root = cfg.checkpoint_path
    if root.is_dir():
        for entry in root.iterdir():
            if entry.is_dir() and (entry.name.startswith("step_") or
                                   (entry.name.startswith(".step_") and entry.name.endswith(".tmp"))):
                shutil.rmtree(entry, ignore_errors=True)
    return found


def link_latest(folder: Path, runs: Path = RUNS) -> str | None:
    """Point ``runs/latest`` at ``folder`` (a folder in ``runs``), replacing the old link
    atomically (a new link, then ``os.replace``). Returns why it was left alone (an earlier
    version's real folder named ``latest``), else ``None``."""
    link = runs / LATEST
    if link.exists() and not link.is_symlink():
        return (f"{link} is a run folder of an earlier version, not a link; it is left as it is (move it away to "
                f"let {link} follow the newest run)")
    runs.mkdir(parents=True, exist_ok=True)
    tmp = runs / f".{LATEST}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(folder, runs), tmp)
    os.replace(tmp, link)
    return None
