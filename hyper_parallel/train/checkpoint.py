"""Sharded, atomic, layout-independent checkpoints: every rank writes the pieces it holds,
each described by its box in the global tensor, and a checkpoint becomes visible only once
it is complete. A checkpoint written in one layout loads in any other (resharding): each
rank reads only the pieces that overlap its own.

[Note: atomic checkpoints]
Layout on disk::

    <checkpoint_dir>/step_00000050/manifest.json      written last, by rank 0
    <checkpoint_dir>/step_00000050/rank_00000.npz     the pieces rank 0 owns
    <checkpoint_dir>/step_00000050/rank_00001.npz ...

1. Rank 0 makes a fresh ``.step_00000050.tmp`` folder; barrier.
2. Every rank writes ``rank_N.index.json``: the key and box of each piece it holds; barrier.
3. Every rank writes its ``.npz`` there (the pieces it owns, see below), fsyncs it and
   writes its size and SHA-256 beside it; barrier.
4. Rank 0 writes ``manifest.json`` (format, step, layout, model, world size, every
   tensor's pieces and each shard's size and digest), fsyncs it, renames the folder to
   ``step_00000050`` (one atomic ``rename``) and fsyncs the parent; barrier.

A crash before step 4 leaves only a ``.tmp`` folder, which loading ignores and the next
save replaces; the previous checkpoint is untouched. A checkpoint that was cut off anyway
(copied partially, a disk that lost a write) fails verification: a missing manifest or a
shard whose size or digest differs. Loading then warns and falls back to the previous
checkpoint. Every rank verifies the same files, so all ranks pick the same one.
The folder must be shared by all ranks (one machine, or a shared filesystem).

[Note: layout-independent pieces]
A piece is one rank's part of one tensor: ``"<kind>/<fqn>"`` (``param/layers.0.attention.wq.weight``,
``exp_avg/...``, ``exp_avg_sq/...``: AdamW's moments have their parameter's shape) with its
``Box`` (``hyper_parallel.core.fully_shard.Box``: the global shape, ``starts`` and
``lengths`` per dim) as ``local_boxes`` reports it: the fully_shard chunk inside the
tensor-parallel chunk, without fully_shard's padding, under the decoder's parameter names
(pipeline stages keep them). Ranks that hold the same box (replicas: ``--dp-replicate``,
and the tensor-parallel ranks of a parameter tensor parallelism does not shard) write it
once: the lowest such rank owns it, which every rank decides from the index files of
step 2. The manifest lists, for each key, its global shape and its pieces (file, box).

Loading in any layout: for each key and this rank's box, the pieces that overlap it are
read (``copy_overlap``; ``np.load`` of an ``.npz`` reads one array at a time, so no rank
holds more than its own shard plus one saved piece), and the copied values must cover
the box. The loop pads what fully_shard pads with zeros (padding rows stay zero in
training: no gradient reaches them, and weight decay keeps zero at zero).
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

from hyper_parallel.core.fully_shard import Box, copy_overlap
from hyper_parallel.platform import Platform

MANIFEST = "manifest.json"
#: the manifest's ``format``: 2 = pieces with boxes (format 1, per-rank arrays of one layout, is refused)
FORMAT = 2
#: complete checkpoints kept (older ones are deleted after a save)
KEEP = 3


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.npz"


def _index_name(rank: int) -> str:
    return f"rank_{rank:05d}.index.json"


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
class Piece:
    """This rank's part of one tensor: its ``box`` and the values (shape ``box.lengths``)."""

    box: Box
    value: np.ndarray


@dataclass(frozen=True)
class Loaded:
    """A verified checkpoint: its step, manifest, and this rank's pieces.

    ``arrays``: ``{"<kind>/<fqn>": array of the asked box's lengths}`` for every key the
    checkpoint holds. ``resharded``: it was written by another layout or world size."""

    step: int
    path: Path
    manifest: dict[str, Any]
    arrays: dict[str, np.ndarray]
    resharded: bool


def _box_record(box: Box, value: np.ndarray) -> dict[str, Any]:
    return {"shape": list(box.shape), "dtype": str(value.dtype), "starts": list(box.starts),
            "lengths": list(box.lengths)}


def _same_piece(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["starts"] == b["starts"] and a["lengths"] == b["lengths"]


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
    (tmp / (shard.name + ".sha256")).write_text(f"{shard.stat().st_size} {_digest(shard)}\n")
    _barrier(p, world)
    if rank == 0:
        _write_manifest(tmp, step, world, meta)
        if final.exists():  # a checkpoint of the same step from an earlier run
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
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


def describe_layout(layout: dict[str, Any], world: int) -> str:
    """``"tp=2 x dp_shard=2 (4 ranks)"``, ``"pp=2 (2 ranks, 4 pipeline stages)"`` for a
    manifest's ``layout`` record."""
    parts = [f"{axis}={degree}" for axis, degree in layout["degrees"].items() if degree > 1]
    stages = f", {layout['pipeline_stages']} pipeline stages" if "pipeline_stages" in layout else ""
    return f"{' x '.join(parts) or 'single rank'} ({world} rank{'s' if world > 1 else ''}{stages})"


def check_compatible(path: Path, manifest: dict[str, Any], model: dict[str, Any]) -> None:
    """Raise ``ValueError`` if the checkpoint at ``path`` cannot be loaded into a run of
    ``model`` (the model record, ``loop.model_record``) in any layout: it has another
    format, or another model (other sizes give other tensors; other constants another
    function)."""
    if manifest.get("format") != FORMAT:
        raise ValueError(f"--resume: checkpoint {path} has format {manifest.get('format', 1)} (per-rank arrays of one "
                         f"layout, without their boxes), this version reads format {FORMAT}; resume with the version "
                         "that wrote it, or start a new --checkpoint-dir")
    saved = manifest["model"]
    differ = sorted(name for name in set(saved) | set(model) if saved.get(name) != model.get(name))
    if differ:
        params = parameter_differences(manifest, model)
        shown = "; ".join(params[:SHOWN_DIFFERENCES])
        more = f" (and {len(params) - SHOWN_DIFFERENCES} more)" if len(params) > SHOWN_DIFFERENCES else ""
        raise ValueError(f"--resume: checkpoint {path} holds another model"
                         + (f": {shown}{more}" if params else "") + "; it was written with "
                         f"{', '.join(f'{name}={saved.get(name)!r}' for name in differ)}, this run has "
                         f"{', '.join(f'{name}={model.get(name)!r}' for name in differ)}; resume with the model that "
                         "wrote it (--model and the size flags) or start a new --checkpoint-dir (the layout may "
                         "differ: checkpoints are resharded)")


#: mismatching parameters named in the message of ``check_compatible`` (the rest are counted)
SHOWN_DIFFERENCES = 3


def parameter_differences(manifest: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """The parameters whose global shape differs between the checkpoint (``manifest``) and
    a decoder of the model record ``model`` (``loop.model_record``), or that only one of
    them has, in the decoder's parameter order then the checkpoint's extra ones:
    ``"layers.0.attention.wq.weight has shape (32, 32) in the checkpoint, (64, 64) in this
    run"``. Empty when every shape matches (the models may still differ in a constant,
    ``rope_theta`` say)."""
    from hyper_parallel.train.config import ModelConfig
    from hyper_parallel.train.model import parameter_shapes

    try:
        mine = parameter_shapes(ModelConfig(**model))
    except (TypeError, ValueError):  # a model record this version cannot build
        return []
    theirs = {key.split("/", 1)[1]: tuple(entry["shape"]) for key, entry in manifest.get("tensors", {}).items()
              if key.startswith("param/")}
    out = []
    for name, shape in mine.items():
        if name not in theirs:
            out.append(f"{name} {shape} is not in the checkpoint")
        elif theirs[name] != shape:
            out.append(f"{name} has shape {theirs[name]} in the checkpoint, {shape} in this run")
    out.extend(f"{name} {theirs[name]} in the checkpoint is not in this run's model" for name in theirs
               if name not in mine)
    return out


def reshard_message(path: Path, manifest: dict[str, Any], layout: dict[str, Any], world: int) -> str | None:
    """What a resume in another layout says (``None`` in the same layout)."""
    if manifest["layout"] == layout and manifest["world_size"] == world:
        return None
    return (f"--resume: checkpoint {path} (step {manifest['step']}) was written by layout "
            f"{describe_layout(manifest['layout'], manifest['world_size'])}; resharding it into layout "
            f"{describe_layout(layout, world)} (each rank reads the pieces that overlap its own)")


def read_pieces(path: Path, manifest: dict[str, Any], boxes: dict[str, Box]) -> dict[str, np.ndarray]:
    """This rank's values of each key of ``boxes`` (``{"<kind>/<fqn>": Box}``) that the
    checkpoint holds, assembled from the overlapping pieces (no communication).

    Raises:
        ValueError: a key's global shape differs from the checkpoint's, or its pieces do
            not cover the box (a checkpoint that was edited).
    """
    tensors = manifest["tensors"]
    files: dict[str, Any] = {}
    out = {}
    try:
        for key, box in boxes.items():
            if key not in tensors:
                continue
            entry = tensors[key]
            if tuple(entry["shape"]) != box.shape:
                raise ValueError(f"--resume: {key} has shape {tuple(entry['shape'])} in checkpoint {path} but "
                                 f"{box.shape} in this run's model")
            local = np.zeros(box.lengths, np.dtype(entry["dtype"]))
            covered = 0
            for piece in entry["pieces"]:
                name = piece["file"]

                def read(name: str = name, key: str = key) -> np.ndarray:
                    if name not in files:
                        files[name] = np.load(path / name)
                    return files[name][key]

                covered += copy_overlap(local, box.starts, piece["starts"], piece["lengths"], read)
            if covered != local.size:
                raise ValueError(f"--resume: the pieces of {key} in checkpoint {path} cover {covered} of the "
                                 f"{local.size} values this rank needs; the checkpoint is incomplete")
            out[key] = local
    finally:
        for data in files.values():
            data.close()
    return out


def load_latest(root: Path, boxes: dict[str, Box], layout: dict[str, Any], model: dict[str, Any],
                world: int) -> Loaded | None:
    """The newest complete checkpoint under ``root``, this rank's pieces of ``boxes``
    (``{"<kind>/<fqn>": Box}``); ``None`` if there is none. An incomplete newer one is
    skipped with a warning naming why. ``layout``, ``world``: this run's (another
    layout reshards, ``Loaded.resharded``). No communication.

    Raises:
        ValueError: the checkpoint has another format or model (``check_compatible``),
            lacks a parameter of ``boxes`` (``param/...``), or a shape differs.
    """
    found = latest_manifest(root)
    if found is None:
        return None
    path, manifest = found
    check_compatible(path, manifest, model)
    missing = sorted(key for key in boxes if key.startswith("param/") and key not in manifest["tensors"])
    if missing:
        raise ValueError(f"--resume: checkpoint {path} lacks {len(missing)} parameters of this run's model (first: "
                         f"{missing[:3]}); resume with the model that wrote it or start a new --checkpoint-dir")
    arrays = read_pieces(path, manifest, boxes)
    resharded = reshard_message(path, manifest, layout, world) is not None
    return Loaded(int(manifest["step"]), path, manifest, arrays, resharded)
