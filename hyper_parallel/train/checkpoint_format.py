"""The files of a ``hyper-parallel train`` checkpoint: one ``safetensors`` file per writing
rank and a global index (``checkpoint``'s notes say how a save makes them atomically).

[Note: the checkpoint index]
``model.safetensors.index.json`` follows Hugging Face's sharded-checkpoint index, extended
with each piece's box, so a checkpoint written by any layout reads back in any other, on
either framework (both read it through numpy)::

    {"metadata": {"format": 3, "step": 50, "world_size": 4, "layout": {...}, "model": {...},
                  "data": {...}, "optimizer_step": 50, "total_size": <bytes of the tensors>},
     "weight_map": {"param/layers.0.attention.wq.weight": "rank_00000.safetensors", ...},
     "tensors": {"param/layers.0.attention.wq.weight": {"shape": [32, 32], "dtype": "float32"}, ...},
     "pieces": {"param/layers.0.attention.wq.weight":
                    [{"file": "rank_00000.safetensors", "box": {"starts": [0, 0], "lengths": [16, 32]}},
                     {"file": "rank_00001.safetensors", "box": {"starts": [16, 0], "lengths": [16, 32]}}], ...},
     "files": {"rank_00000.safetensors": {"bytes": 1234, "sha256": "..."}, ...}}

Keys are ``"<kind>/<fqn>"`` (``param``, ``exp_avg``, ``exp_avg_sq``); inside a rank's file
each key names that rank's one piece of the tensor (shape: the box's ``lengths``).
``pieces`` is authoritative; ``weight_map`` names the file of each key's first piece (the
Hugging Face field, for tools that list a checkpoint's keys; a sharded tensor has more).

In memory every format is one dict, the *manifest* (``read_manifest``): ``format``,
``step``, ``world_size``, ``layout``, ``model``, ``data``, ``optimizer_step``,
``tensors`` (``{key: {"shape", "dtype", "pieces": [{"file", "starts", "lengths"}]}}``)
and ``shards`` (``{file: {"bytes", "sha256"}}``). Format 2, the ``.npz`` checkpoints
written before (``manifest.json`` holds that dict as it is), still loads: ``read_pieces``
opens either kind of file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

#: the index of a format-3 checkpoint (written last: its presence marks a complete save)
INDEX = "model.safetensors.index.json"
#: the manifest of a format-2 checkpoint (``.npz`` shards), read for old runs
LEGACY_MANIFEST = "manifest.json"
#: the format this version writes (2: ``.npz`` shards, read only; 1, without boxes, is refused)
FORMAT = 3
#: the formats this version reads
READABLE_FORMATS = (2, 3)


def shard_name(rank: int) -> str:
    """The file rank ``rank`` writes its pieces to."""
    return f"rank_{rank:05d}.safetensors"


def digest(path: Path) -> str:
    """The SHA-256 of the file at ``path`` (hex), streamed 1 MiB at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a folder) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, value: Any, durable: bool = True) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file renamed into place, so
    a reader never sees it half-written. ``durable``: fsync it first (a file that must
    survive a crash; the transient marks of a save need not)."""
    part = path.with_name(path.name + ".part")
    with part.open("w") as f:
        json.dump(value, f, indent=1)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(part, path)


def write_shard(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[int, str]:
    """Write ``arrays`` (``{key: piece}``, any shapes, numpy dtypes safetensors knows) as
    one safetensors file at ``path``, fsynced. Returns its size in bytes and SHA-256."""
    from safetensors.numpy import save_file

    save_file({key: np.ascontiguousarray(value) for key, value in arrays.items()}, str(path), metadata=metadata)
    fsync_path(path)
    return path.stat().st_size, digest(path)


def build_index(meta: dict[str, Any], step: int, world: int, held: Iterable[tuple[str, dict[str, Any]]],
                files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The index (see the note) of a checkpoint of ``step`` by ``world`` ranks:
    ``held`` yields ``(file, {key: {"shape", "dtype", "starts", "lengths"}})`` per rank in
    rank order; a box already held by a lower rank is that rank's piece (the owner);
    ``files``: ``{file: {"bytes", "sha256"}}``."""
    tensors: dict[str, dict[str, Any]] = {}
    pieces: dict[str, list[dict[str, Any]]] = {}
    total = 0
    for file, records in held:
        for key, record in records.items():
            tensors.setdefault(key, {"shape": record["shape"], "dtype": record["dtype"]})
            box = {"starts": record["starts"], "lengths": record["lengths"]}
            mine = pieces.setdefault(key, [])
            if any(piece["box"] == box for piece in mine):
                continue
            mine.append({"file": file, "box": box})
            total += int(np.prod(record["lengths"], dtype=np.int64)) * np.dtype(record["dtype"]).itemsize
    keys = sorted(tensors)
    return {"metadata": {"format": FORMAT, "step": step, "world_size": world, **meta, "total_size": total},
            "weight_map": {key: pieces[key][0]["file"] for key in keys},
            "tensors": {key: tensors[key] for key in keys},
            "pieces": {key: pieces[key] for key in keys},
            "files": dict(sorted(files.items()))}


def manifest_from_index(index: dict[str, Any]) -> dict[str, Any]:
    """The in-memory manifest (see the note) of a format-3 index."""
    meta = dict(index["metadata"])
    meta.pop("total_size", None)
    tensors = {key: {"shape": entry["shape"], "dtype": entry["dtype"],
                     "pieces": [{"file": piece["file"], "starts": piece["box"]["starts"],
                                 "lengths": piece["box"]["lengths"]} for piece in index["pieces"][key]]}
               for key, entry in index["tensors"].items()}
    return {**meta, "tensors": tensors, "shards": index["files"]}


def manifest_file(path: Path) -> Path | None:
    """The index (format 3) or the manifest (format 2) of the checkpoint folder ``path``,
    whichever it has (``None``: neither, a save that was cut off)."""
    for name in (INDEX, LEGACY_MANIFEST):
        if (path / name).is_file():
            return path / name
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """The in-memory manifest of the checkpoint folder ``path`` (either format).

    Raises:
        FileNotFoundError: the folder has neither an index nor a manifest.
        ValueError: the file is not valid JSON of a known shape.
    """
    found = manifest_file(path)
    if found is None:
        raise FileNotFoundError(f"checkpoint {path} has no {INDEX} (nor an older {LEGACY_MANIFEST})")
    try:
        data = json.loads(found.read_text())
        return manifest_from_index(data) if found.name == INDEX else data
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {found} is not a readable index ({type(err).__name__}: {err})") from err


class ShardReader:
    """Open shard files of one checkpoint lazily and read one piece at a time: a
    safetensors file through ``safe_open`` (format 3), an ``.npz`` through ``np.load``
    (format 2); both read only the asked array. Close with ``close`` (or ``with``)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._open: dict[str, Any] = {}  # file name -> safe_open handle or NpzFile

    def read(self, file: str, key: str) -> np.ndarray:
        """The piece ``key`` of ``file`` (shape: its box's lengths)."""
        handle = self._open.get(file)
        if handle is None:
            if file.endswith(".npz"):
                handle = np.load(self._path / file)
            else:
                from safetensors import safe_open

                handle = safe_open(str(self._path / file), framework="np")
            self._open[file] = handle
        return handle[key] if file.endswith(".npz") else handle.get_tensor(key)

    def close(self) -> None:
        for file, handle in self._open.items():
            if file.endswith(".npz"):
                handle.close()
        self._open.clear()  # safe_open handles close when dropped

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
