"""The checkpoint writer of format 2 (``manifest.json`` and one ``.npz`` per rank), as
``hyper_parallel/train/checkpoint.py`` had it before the safetensors format (commit
eedeaa1), kept to write old checkpoints in the tests that resume from them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hyper_parallel.platform import Platform
from hyper_parallel.train.checkpoint_format import digest, fsync_path
from hyper_parallel.core.process_groups import barrier

if TYPE_CHECKING:
    from hyper_parallel.train.checkpoint import Piece

MANIFEST = "manifest.json"
FORMAT = 2
KEEP = 3


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.npz"


def _index_name(rank: int) -> str:
    return f"rank_{rank:05d}.index.json"


def _barrier(p: Platform, world: int) -> None:
    if world > 1:
        barrier()


def _box_record(box: Any, value: np.ndarray) -> dict[str, Any]:
    return {"shape": list(box.shape), "dtype": str(value.dtype), "starts": list(box.starts),
            "lengths": list(box.lengths)}


def _same_piece(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["starts"] == b["starts"] and a["lengths"] == b["lengths"]


def complete_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(e.name[5:]) for e in root.iterdir() if e.is_dir() and e.name.startswith("step_")
                  and e.name[5:].isdigit())


def save(p: Platform, root: Path, step: int, pieces: dict[str, Piece], meta: dict[str, Any], world: int,
         rank: int) -> Path:
    """Write this rank's ``pieces`` (``{"<kind>/<fqn>": Piece}``) as part of the checkpoint
    of ``step``, with ``meta`` (``layout``, ``model``, ``data``, ``optimizer_step``:
    JSON values, the same on every rank) in the manifest. Collective over the ``world``
    ranks: barriers, no data exchange (see the notes at the top). Returns the folder."""
    tmp = root / f".step_{step:08d}.tmp"
    final = _step_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(p, world)
    held = {key: _box_record(piece.box, piece.value) for key, piece in sorted(pieces.items())
            if piece.value.size}  # an uneven shard past the end holds nothing
    (tmp / _index_name(rank)).write_text(json.dumps(held))
    _barrier(p, world)
    # the lowest rank holding a box owns it: drop what a lower rank holds already
    owned = dict(held)
    for other in range(rank):
        theirs = json.loads((tmp / _index_name(other)).read_text())
        for key, record in theirs.items():
            if key in owned and _same_piece(owned[key], record):
                del owned[key]
    shard = tmp / _shard_name(rank)
    with shard.open("wb") as f:
        np.savez(f, **{key: np.ascontiguousarray(pieces[key].value) for key in owned})
        f.flush()
        os.fsync(f.fileno())
    (tmp / (shard.name + ".sha256")).write_text(f"{shard.stat().st_size} {digest(shard)}\n")
    _barrier(p, world)
    if rank == 0:
        _write_manifest(tmp, step, world, meta)
        if final.exists():  # a checkpoint of the same step from an earlier run
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(root)
        for old in complete_steps(root)[:-KEEP]:
            shutil.rmtree(_step_dir(root, old), ignore_errors=True)
    _barrier(p, world)
    return final


def _write_manifest(tmp: Path, step: int, world: int, meta: dict[str, Any]) -> None:
    """Rank 0, step 4 of the note: every key's pieces (owner: the lowest rank holding the
    box) and every shard's size and digest, fsynced."""
    tensors: dict[str, dict[str, Any]] = {}
    shards = {}
    for r in range(world):
        index = tmp / _index_name(r)
        for key, record in json.loads(index.read_text()).items():
            entry = tensors.setdefault(key, {"shape": record["shape"], "dtype": record["dtype"], "pieces": []})
            if not any(_same_piece(piece, record) for piece in entry["pieces"]):
                entry["pieces"].append({"file": _shard_name(r), "starts": record["starts"],
                                        "lengths": record["lengths"]})
        size, digest = (tmp / (_shard_name(r) + ".sha256")).read_text().split()
        shards[_shard_name(r)] = {"bytes": int(size), "sha256": digest}
    for r in range(world):  # the manifest holds what they said
        (tmp / _index_name(r)).unlink()
    manifest = {"format": FORMAT, "step": step, "world_size": world, **meta, "tensors": dict(sorted(tensors.items())),
                "shards": shards}
    with (tmp / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())

