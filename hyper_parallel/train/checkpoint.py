"""Sharded, atomic checkpoints: every rank writes its own shard, and a checkpoint becomes
visible only once it is complete.

[Note: atomic checkpoints]
Layout on disk::

    <checkpoint_dir>/step_00000050/manifest.json      written last, by rank 0
    <checkpoint_dir>/step_00000050/rank_00000.npz     parameters (local shards) + optimizer state
    <checkpoint_dir>/step_00000050/rank_00001.npz ...

1. Rank 0 makes a fresh ``.step_00000050.tmp`` folder; barrier.
2. Every rank writes its ``.npz`` there, fsyncs it and writes its size and SHA-256 beside it; barrier.
3. Rank 0 writes ``manifest.json`` (step, layout, world size, each shard's size and
   digest), fsyncs it, renames the folder to ``step_00000050`` (one atomic ``rename``) and
   fsyncs the parent; barrier.

A crash before step 3 leaves only a ``.tmp`` folder, which loading ignores and the next
save replaces; the previous checkpoint is untouched. A checkpoint that was cut off anyway
(copied partially, a disk that lost a write) fails verification: a missing manifest or a
shard whose size or digest differs. Loading then warns and falls back to the previous
checkpoint. Every rank verifies the same files, so all ranks pick the same one.
The folder must be shared by all ranks (one machine, or a shared filesystem).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.platform import Platform

MANIFEST = "manifest.json"
#: complete checkpoints kept (older ones are deleted after a save)
KEEP = 3


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.npz"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(p: Platform, world: int) -> None:
    if world > 1:
        p.barrier().wait()


@dataclass(frozen=True)
class Loaded:
    """A verified checkpoint: its step and this rank's arrays."""

    step: int
    path: Path
    arrays: dict[str, np.ndarray]


def save(p: Platform, root: Path, step: int, arrays: dict[str, np.ndarray], layout: dict[str, Any],
         world: int, rank: int) -> Path:
    """Write this rank's ``arrays`` as part of the checkpoint of ``step`` (collective over
    the ``world`` ranks: barriers; see the note at the top). Returns the checkpoint folder."""
    tmp = root / f".step_{step:08d}.tmp"
    final = _step_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(p, world)
    shard = tmp / _shard_name(rank)
    with shard.open("wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    (tmp / (shard.name + ".sha256")).write_text(f"{shard.stat().st_size} {_digest(shard)}\n")
    _barrier(p, world)
    if rank == 0:
        shards = {}
        for r in range(world):
            size, digest = (tmp / (_shard_name(r) + ".sha256")).read_text().split()
            shards[_shard_name(r)] = {"bytes": int(size), "sha256": digest}
        manifest = {"step": step, "world_size": world, "layout": layout, "shards": shards}
        with (tmp / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # a checkpoint of the same step from an earlier run
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        for old in complete_steps(root)[:-KEEP]:
            shutil.rmtree(_step_dir(root, old), ignore_errors=True)
    _barrier(p, world)
    return final


def complete_steps(root: Path) -> list[int]:
    """Steps of the ``step_*`` folders under ``root`` (verified or not), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith("step_") and entry.name[5:].isdigit():
            steps.append(int(entry.name[5:]))
    return sorted(steps)


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is unusable, or ``None`` if it is complete."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "it has no manifest.json (it was cut off before it was complete)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        return f"its manifest.json is unreadable ({err})"
    for name, expected in sorted(manifest["shards"].items()):
        shard = path / name
        if not shard.is_file():
            return f"shard {name} is missing"
        size = shard.stat().st_size
        if size != expected["bytes"]:
            return f"shard {name} has {size} bytes, the manifest says {expected['bytes']} (cut off mid-write)"
        if _digest(shard) != expected["sha256"]:
            return f"shard {name} does not match its SHA-256 digest (corrupted)"
    return None


def latest_manifest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint under ``root`` that verifies, and its manifest (``None`` if
    none does). Incomplete newer ones are skipped with a warning that says why."""
    for step in reversed(complete_steps(root)):
        path = _step_dir(root, step)
        problem = verify(path)
        if problem is not None:
            warnings.warn(f"checkpoint {path} is unusable: {problem}; falling back to the previous checkpoint",
                          RuntimeWarning, stacklevel=2)
            continue
        return path, json.loads((path / MANIFEST).read_text())
    return None


def check_layout(path: Path, manifest: dict[str, Any], layout: dict[str, Any], world: int) -> None:
    """Raise ``ValueError`` if the checkpoint at ``path`` was written with another layout or
    world size (its shards hold other slices; resharding on load is not supported)."""
    if manifest["world_size"] != world or manifest["layout"] != layout:
        raise ValueError(f"--resume: checkpoint {path} was written by {manifest['world_size']} ranks with layout "
                         f"{manifest['layout']}, but this run has {world} ranks with layout {layout}; resume with "
                         "the same layout (or start a new --checkpoint-dir)")


def load_latest(root: Path, layout: dict[str, Any], world: int, rank: int) -> Loaded | None:
    """The newest complete checkpoint under ``root``, this rank's arrays; ``None`` if there is
    none. An incomplete newer one is skipped with a warning naming why.

    Raises:
        ValueError: the checkpoint was written with another layout or world size (its
            shards hold other slices; resharding on load is not supported).
    """
    found = latest_manifest(root)
    if found is None:
        return None
    path, manifest = found
    check_layout(path, manifest, layout, world)
    with np.load(path / _shard_name(rank)) as data:
        arrays = {key: data[key] for key in data.files}
    return Loaded(int(manifest["step"]), path, arrays)
