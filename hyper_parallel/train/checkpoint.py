"""Sharded, atomic, layout-independent checkpoints: every rank writes the pieces it holds,
each described by its box in the global tensor, into one safetensors file, and a
checkpoint becomes visible only once it is complete. A checkpoint written in one layout
loads in any other, on either framework (resharding): each rank reads only the pieces
that overlap its own. The files and the index: ``checkpoint_format`` ([Note: the
checkpoint index]).

[Note: atomic checkpoints]
Layout on disk::

    <checkpoint_dir>/step_00000050/model.safetensors.index.json   written last, by rank 0
    <checkpoint_dir>/step_00000050/rank_00000.safetensors          the pieces rank 0 owns
    <checkpoint_dir>/step_00000050/rank_00001.safetensors ...

1. Rank 0 makes a fresh ``.step_00000050.tmp`` folder; barrier. The only collective of
   the steps up to 4, on the calling (training) thread, also for an asynchronous save
   (``checkpoint_async``); the ranks coordinate the rest through the folder.
2. Every rank writes ``rank_N.index.json``: the key, global shape, dtype and box of each
   piece it holds; it waits until the lower ranks' index files are there and keeps the
   pieces it owns (below).
3. Every rank writes its ``.safetensors`` there, fsyncs it, and then writes
   ``rank_N.done.json`` (its size and SHA-256) through a renamed temporary file: the mark
   that its shard is complete. A rank whose write fails writes ``rank_N.failed`` instead.
4. Rank 0 waits for every rank's mark on the filesystem (immediately there after the
   barrier of a synchronous save; polled by the background writer of an asynchronous one,
   so no collective runs off the training thread), writes the index (format, step,
   layout, model, world size, every tensor's pieces and each file's size and digest),
   fsyncs it, renames the folder to ``step_00000050`` (one atomic ``rename``) and fsyncs
   the parent. A failed mark stops it: the folder stays ``.tmp``. A synchronous save
   ends with a barrier.

A crash before step 4 ends leaves only a ``.tmp`` folder, which loading ignores and the
next save of that step replaces; the previous checkpoint is untouched. A checkpoint that
was cut off anyway (copied partially, a disk that lost a write) fails verification: a
missing index or a file whose size or digest differs. Loading then warns and falls back
to the previous checkpoint. The folder must be shared by all ranks (one machine, or a
shared filesystem). Checkpoints of format 2 (``manifest.json`` and ``.npz`` shards, the
same protocol) load as they are.

[Note: retention]
A checkpoint's index records the run that wrote it (``meta["run"]``: the run id of
``hyper-parallel train``, which a resumed run takes over from the checkpoint it continues).
After the rename of step 4, rank 0 deletes the oldest (lowest-step) checkpoints *of that
run* until ``keep`` of them are left, the one just written always among them (``keep == 0``:
none is deleted). A checkpoint of another run, one without an index, or one whose index
does not read, is never deleted: a second run writing into the same folder cannot delete
the first run's checkpoints, nor the first run's newer step numbers the second's.

[Note: shared verification]
Verifying a checkpoint means hashing every file. With ``world`` ranks, rank ``r`` hashes
the files ``r, r + world, ...`` of the index's sorted file list and the ranks agree by one
**all-reduce** (sum) of a fixed-size float64 vector per candidate checkpoint: whether the
index is unusable, how many files are missing / cut off / corrupted, and per rank the
first file it found bad. Every rank then takes the same decision (use it, or warn and fall
back to the previous one) and reads only the pieces it needs. Outside a run's world
(``latest_manifest``: the command line's checks, ``hyper-parallel export``) one process
verifies every file.

[Note: layout-independent pieces]
A piece is one rank's part of one tensor: ``"<kind>/<fqn>"`` (``param/layers.0.attention.wq.weight``,
``exp_avg/...``, ``exp_avg_sq/...``: AdamW's moments have their parameter's shape) with its
``Box`` (``hyper_parallel.core.fully_shard.Box``: the global shape, ``starts`` and
``lengths`` per dim) as ``local_boxes`` reports it: the fully_shard chunk inside the
tensor-parallel chunk, without fully_shard's padding, under the decoder's parameter names
(pipeline stages keep them). Ranks that hold the same box (replicas: ``--dp-replicate``,
and the tensor-parallel ranks of a parameter tensor parallelism does not shard) write it
once: the lowest such rank owns it, which every rank decides from the lower ranks' index
files of step 2. The index lists, for each key, its global shape, dtype and its pieces (file, box).

Loading in any layout: for each key and this rank's box, the pieces that overlap it are
read (``copy_overlap``; ``safe_open(...).get_tensor`` reads one tensor of a file at a time,
so no rank holds more than its own shard plus one saved piece), and the copied values must
cover the box. The loop pads what fully_shard pads with zeros (padding rows stay zero in
training: no gradient reaches them, and weight decay keeps zero at zero). Values are
numpy arrays on both frameworks, so a checkpoint of one framework resumes on the other.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.core.fully_shard import Box, copy_overlap
from hyper_parallel.platform import Platform
from hyper_parallel.train.checkpoint_format import (FORMAT, INDEX, READABLE_FORMATS, ShardReader, build_index,
                                                    digest, fsync_path, manifest_file, read_manifest, shard_name,
                                                    write_json_atomic, write_shard)
from hyper_parallel.core.process_groups import barrier

__all__ = ["FORMAT", "INDEX", "KEEP", "READABLE_FORMATS", "manifest_file", "Loaded", "PendingSave", "Piece",
           "begin_save", "check_compatible", "commit", "complete_steps", "describe_layout", "expired",
           "latest_manifest", "load_latest", "read_manifest", "read_pieces", "reshard_message", "run_of", "save",
           "verify", "write_pending"]

#: complete checkpoints of a run kept by default (``--keep-checkpoints``): after a save the
#: run's older ones are deleted ([Note: retention])
KEEP = 3
#: seconds rank 0 waits, at step 4, for the other ranks' marks before giving the save up
COMMIT_TIMEOUT_S = 3600.0


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _index_name(rank: int) -> str:
    return f"rank_{rank:05d}.index.json"


def _done_name(rank: int) -> str:
    return f"rank_{rank:05d}.done.json"


def _failed_name(rank: int) -> str:
    return f"rank_{rank:05d}.failed"


def _barrier(p: Platform | None, world: int) -> None:
    if world > 1:
        assert p is not None, "a save or load over more than one rank needs the platform"
        barrier()


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


@dataclass(frozen=True)
class PendingSave:
    """A save after step 1 of [Note: atomic checkpoints]: what this rank writes
    (``pieces``: host copies) and where. ``write_pending`` and, on rank 0, ``commit``
    finish it without collectives, on any thread."""

    root: Path
    tmp: Path
    step: int
    rank: int
    world: int
    meta: dict[str, Any]
    pieces: dict[str, Piece]
    keep: int = KEEP  # checkpoints of the run kept after the commit (0: all), [Note: retention]

    @property
    def final(self) -> Path:
        return _step_dir(self.root, self.step)


def _box_record(box: Box, value: np.ndarray) -> dict[str, Any]:
    return {"shape": list(box.shape), "dtype": str(value.dtype), "starts": list(box.starts),
            "lengths": list(box.lengths)}


def _same_piece(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["starts"] == b["starts"] and a["lengths"] == b["lengths"]


def begin_save(p: Platform | None, root: Path, step: int, pieces: dict[str, Piece], meta: dict[str, Any],
               world: int, rank: int, agree: Callable[[], None] | None = None, keep: int = KEEP) -> PendingSave:
    """Step 1 of [Note: atomic checkpoints]: the temporary folder. Collective over the
    ``world`` ranks, on the calling thread: one barrier (``p`` may be ``None`` when
    ``world == 1``), or ``agree``, a collective of the caller's that every rank calls here
    (``checkpoint_async`` reports the previous save's outcome with it), no data exchange.
    ``pieces`` (``{"<kind>/<fqn>": Piece}``, host arrays) are kept, not copied: the caller
    passes copies it does not change while the save is pending. ``keep``: the run's
    checkpoints left after the commit ([Note: retention])."""
    tmp = root / f".step_{step:08d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if agree is not None:
        agree()
    else:
        _barrier(p, world)
    return PendingSave(root, tmp, step, rank, world, meta, pieces, keep)


def _wait_for(pending: PendingSave, name: Callable[[int], str], ranks: range, what: str,
              timeout_s: float) -> None:
    """Poll ``pending.tmp`` until ``name(r)`` exists for every rank ``r`` of ``ranks``.

    Raises:
        RuntimeError: one of them wrote its failed mark instead, or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    waiting = list(ranks)
    while waiting:
        for r in list(waiting):
            if (pending.tmp / _failed_name(r)).exists():
                raise RuntimeError(f"checkpoint of step {pending.step}: rank {r} failed to write its shard "
                                   f"({(pending.tmp / _failed_name(r)).read_text().strip()}); {pending.tmp} stays "
                                   "incomplete and the previous checkpoint is the newest complete one")
            if (pending.tmp / name(r)).exists():
                waiting.remove(r)
        if waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"checkpoint of step {pending.step}: ranks {waiting} did not write {what} within "
                                   f"{timeout_s:.0f} s; {pending.tmp} stays incomplete")
            time.sleep(0.005)


def write_pending(pending: PendingSave, timeout_s: float = COMMIT_TIMEOUT_S) -> None:
    """Steps 2 and 3: this rank's index file, which pieces it owns (from the lower ranks'
    index files, waited for on the filesystem), its safetensors file and its mark. File
    I/O only (no collective), so it may run on a background thread. On failure it writes
    the failed mark (the other ranks stop waiting) and re-raises."""
    tmp, rank = pending.tmp, pending.rank
    try:
        held = {key: _box_record(piece.box, piece.value) for key, piece in sorted(pending.pieces.items())
                if piece.value.size}  # an uneven shard past the end holds nothing
        # transient (rank 0 folds it into the index): renamed into place for readers, not fsynced
        write_json_atomic(tmp / _index_name(rank), held, durable=False)
        _wait_for(pending, _index_name, range(rank), "their index files", timeout_s)
        # the lowest rank holding a box owns it: drop what a lower rank holds already
        owned = dict(held)
        for other in range(rank):
            for key, record in json.loads((tmp / _index_name(other)).read_text()).items():
                if key in owned and _same_piece(owned[key], record):
                    del owned[key]
        size, sha = write_shard(tmp / shard_name(rank), {key: pending.pieces[key].value for key in owned},
                                {"step": str(pending.step), "rank": str(rank)})
        write_json_atomic(tmp / _done_name(rank), {"bytes": size, "sha256": sha}, durable=False)
    except BaseException as err:
        try:
            (tmp / _failed_name(rank)).write_text(f"{type(err).__name__}: {err}\n")
        except OSError:
            pass  # the folder is gone too: rank 0 times out, the save stays incomplete either way
        raise


def commit(pending: PendingSave, timeout_s: float = COMMIT_TIMEOUT_S) -> Path:
    """Step 4, on rank 0 only: wait for every rank's mark, write the index, rename the
    folder into place, then delete the run's older checkpoints beyond ``pending.keep``
    ([Note: retention]). No collective. Returns the checkpoint's folder.

    Raises:
        RuntimeError: a rank marked its write failed, or not every rank marked its shard
            within ``timeout_s`` seconds; the save is left incomplete (``.tmp``), the
            previous checkpoint stays the newest complete one.
    """
    tmp, world = pending.tmp, pending.world
    _wait_for(pending, _done_name, range(world), "their shards", timeout_s)
    held = [(shard_name(r), json.loads((tmp / _index_name(r)).read_text())) for r in range(world)]
    files = {shard_name(r): json.loads((tmp / _done_name(r)).read_text()) for r in range(world)}
    index = build_index(pending.meta, pending.step, world, held, files)
    for r in range(world):  # the index holds what they said
        (tmp / _index_name(r)).unlink()
        (tmp / _done_name(r)).unlink()
    write_json_atomic(tmp / INDEX, index)
    final, root = pending.final, pending.root
    if final.exists():  # the same step, written before a resume (the command line refuses another run's folder)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    for old in expired(root, pending.step, pending.meta.get("run", ""), pending.keep):
        shutil.rmtree(old, ignore_errors=True)
    return final


def run_of(path: Path) -> str | None:
    """The run id in the index of the checkpoint at ``path`` (``""`` for a checkpoint
    written without one, by an earlier version or the API without ``meta["run"]``), or
    ``None`` if its index is missing or unreadable."""
    try:
        return str(read_manifest(path).get("run", ""))
    except (OSError, ValueError, KeyError):
        return None


def expired(root: Path, step: int, run: str, keep: int) -> list[Path]:
    """[Note: retention]: the checkpoints under ``root`` that a commit of ``step`` by the
    run ``run`` deletes with ``keep`` (0: none), oldest (lowest step) first."""
    if keep == 0:
        return []
    older = [_step_dir(root, s) for s in complete_steps(root) if s != step]
    mine = [path for path in older if run_of(path) == run]
    return mine[:max(0, len(mine) - (keep - 1))]


def save(p: Platform | None, root: Path, step: int, pieces: dict[str, Piece], meta: dict[str, Any], world: int,
         rank: int, keep: int = KEEP) -> Path:
    """Write this rank's ``pieces`` (``{"<kind>/<fqn>": Piece}``) as part of the checkpoint
    of ``step``, with ``meta`` (``layout``, ``model``, ``data``, ``optimizer_step``:
    JSON values, the same on every rank) in the index. Synchronous: returns once the
    checkpoint is complete on every rank. Collective over the ``world`` ranks: barriers,
    no data exchange ([Note: atomic checkpoints]). Returns the folder. ``keep``: the
    checkpoints of the run (``meta["run"]``) left afterwards, this one included (0: all;
    [Note: retention]).

    Raises:
        RuntimeError: rank 0 could not commit (a rank's write failed); OSError from the
            writes of this rank.
    """
    pending = begin_save(p, root, step, pieces, meta, world, rank, keep=keep)
    write_pending(pending)
    _barrier(p, world)
    if rank == 0:
        commit(pending)  # after the barrier every mark is there (a shared filesystem may show it late)
    _barrier(p, world)
    return pending.final


def complete_steps(root: Path) -> list[int]:
    """Steps of the ``step_*`` folders under ``root`` (verified or not), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith("step_") and entry.name[5:].isdigit():
            steps.append(int(entry.name[5:]))
    return sorted(steps)


#: kinds of a file that fails verification, as counted in the agreed vector (see the note)
_MISSING, _CUT_OFF, _CORRUPTED = 1, 2, 3
_KIND_WORDS = {_MISSING: "missing", _CUT_OFF: "cut off mid-write (its size differs from the index)",
               _CORRUPTED: "corrupted (its SHA-256 differs from the index)"}


def _load_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The manifest of ``path`` or why there is none usable."""
    if manifest_file(path) is None:
        return None, f"it has no {INDEX} (it was cut off before it was complete)"
    try:
        return read_manifest(path), None
    except (OSError, ValueError) as err:
        return None, f"its index is unreadable ({err})"


def _check_file(path: Path, name: str, expected: dict[str, Any]) -> tuple[int, str] | None:
    """``(kind, why)`` if the shard ``name`` fails verification, else ``None``."""
    shard = path / name
    if not shard.is_file():
        return _MISSING, f"shard {name} is missing"
    size = shard.stat().st_size
    if size != expected["bytes"]:
        return _CUT_OFF, f"shard {name} has {size} bytes, the index says {expected['bytes']} (cut off mid-write)"
    if digest(shard) != expected["sha256"]:
        return _CORRUPTED, f"shard {name} does not match its SHA-256 digest (corrupted)"
    return None


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` (either format) is unusable, or ``None`` if it is
    complete. Reads every file (one process; a run's ranks share the work: ``load_latest``)."""
    manifest, problem = _load_manifest(path)
    if manifest is None:
        return problem
    for name, expected in sorted(manifest.get("shards", {}).items()):
        found = _check_file(path, name, expected)
        if found is not None:
            return found[1]
    return None


def _verify_shared(p: Platform | None, path: Path, rank: int, world: int) -> tuple[dict[str, Any] | None, str | None]:
    """[Note: shared verification]: this rank checks its share of the files, one
    all-reduce (sum) over the world agrees. Returns the manifest or why the checkpoint is
    unusable, the same decision on every rank."""
    manifest, problem = _load_manifest(path)
    files = sorted(manifest.get("shards", {}).items()) if manifest is not None else []
    # [index unusable, missing, cut off, corrupted, then per rank: 1 + its first bad file's position]
    agreed = np.zeros(4 + world, np.float64)
    agreed[0] = manifest is None
    mine: str | None = None
    for position in range(rank, len(files), world):
        name, expected = files[position]
        found = _check_file(path, name, expected)
        if found is not None:
            agreed[found[0]] += 1
            if mine is None:
                mine, agreed[4 + rank] = found[1], position + 1
    if world > 1:
        assert p is not None
        agreed = p.to_numpy(p.all_reduce(p.from_numpy(agreed), "sum").wait())
    if agreed[0]:
        return None, problem or "its index is unusable on another rank (a filesystem not shared by every rank?)"
    if not agreed[1:4].any():
        return manifest, None
    kinds = ", ".join(f"{int(agreed[kind])} {_KIND_WORDS[kind]}" for kind in (_MISSING, _CUT_OFF, _CORRUPTED)
                      if agreed[kind])
    if mine is not None:
        return None, f"{mine} ({kinds} in all)"
    first = next(r for r in range(world) if agreed[4 + r])
    return None, (f"shard {files[int(agreed[4 + first]) - 1][0]} failed rank {first}'s verification "
                  f"(shards {kinds})")


def _latest(root: Path, check: Any) -> tuple[Path, dict[str, Any]] | None:
    for step in reversed(complete_steps(root)):
        path = _step_dir(root, step)
        manifest, problem = check(path)
        if manifest is None:
            warnings.warn(f"checkpoint {path} is unusable: {problem}; falling back to the previous checkpoint",
                          RuntimeWarning, stacklevel=3)
            continue
        return path, manifest
    return None


def latest_manifest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint under ``root`` that verifies (either format; this process
    reads every file), and its in-memory manifest (``checkpoint_format``'s note: keys
    ``format``, ``step``, ``world_size``, ``layout``, ``model``, ``data``,
    ``optimizer_step``, ``tensors``, ``shards``); ``None`` if none does. Incomplete newer
    ones are skipped with a warning that says why. No communication."""
    def check(path: Path) -> tuple[dict[str, Any] | None, str | None]:
        problem = verify(path)
        return (read_manifest(path), None) if problem is None else (None, problem)

    return _latest(root, check)


def describe_layout(layout: dict[str, Any], world: int) -> str:
    """``"tp=2 x dp_shard=2 (4 ranks)"``, ``"pp=2 (2 ranks, 4 pipeline stages)"`` for a
    manifest's ``layout`` record."""
    parts = [f"{axis}={degree}" for axis, degree in layout["degrees"].items() if degree > 1]
    stages = f", {layout['pipeline_stages']} pipeline stages" if "pipeline_stages" in layout else ""
    return f"{' x '.join(parts) or 'single rank'} ({world} rank{'s' if world > 1 else ''}{stages})"


def check_compatible(path: Path, manifest: dict[str, Any], model: dict[str, Any]) -> None:
    """Raise ``ValueError`` if the checkpoint at ``path`` cannot be loaded into a run of
    ``model`` (the model record, ``records.model_record``) in any layout: it has another
    format, or another model (other sizes give other tensors; other constants another
    function). Formats 2 (``.npz``) and 3 (safetensors) both load."""
    if manifest.get("format") not in READABLE_FORMATS:
        raise ValueError(f"--resume: checkpoint {path} has format {manifest.get('format', 1)} (per-rank arrays of one "
                         f"layout, without their boxes), this version reads formats "
                         f"{', '.join(map(str, READABLE_FORMATS))} (2: .npz shards, {FORMAT}: safetensors shards); "
                         "resume with the version that wrote it, or start a new --checkpoint-dir")
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
    a decoder of the model record ``model`` (``records.model_record``), or that only one of
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
    checkpoint at ``path`` (either format; ``manifest`` from ``latest_manifest`` or
    ``read_manifest``) holds, assembled from the overlapping pieces: arrays of each box's
    ``lengths``, of the checkpoint's dtype (float32). A full box gives the whole tensor.
    One saved piece is in memory at a time besides the result. No communication.

    Raises:
        ValueError: a key's global shape differs from the checkpoint's, or its pieces do
            not cover the box (a checkpoint that was edited).
    """
    tensors = manifest["tensors"]
    out = {}
    with ShardReader(path) as reader:
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
                covered += copy_overlap(local, box.starts, piece["starts"], piece["lengths"],
                                        lambda file=piece["file"], key=key: reader.read(file, key))
            if covered != local.size:
                raise ValueError(f"--resume: the pieces of {key} in checkpoint {path} cover {covered} of the "
                                 f"{local.size} values this rank needs; the checkpoint is incomplete")
            out[key] = local
    return out


def load_latest(p: Platform | None, root: Path, boxes: dict[str, Box], layout: dict[str, Any], model: dict[str, Any],
                world: int, rank: int) -> Loaded | None:
    """The newest complete checkpoint under ``root`` (either format), this rank's pieces
    of ``boxes`` (``{"<kind>/<fqn>": Box}``); ``None`` if there is none. An incomplete
    newer one is skipped with a warning naming why. ``layout``, ``world``: this run's
    (another layout reshards, ``Loaded.resharded``).

    Collective over the ``world`` ranks (``p`` may be ``None`` for one): one all-reduce
    per checkpoint examined ([Note: shared verification]), so every rank loads the same.

    Raises:
        ValueError: the checkpoint has another format or model (``check_compatible``),
            lacks a parameter of ``boxes`` (``param/...``), or a shape differs.
    """
    found = _latest(root, lambda path: _verify_shared(p, path, rank, world))
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
