"""State dicts of a fully_shard / tensor-parallel model: sharded (DTensors, or one file
per rank) and full.

Every parameter fully_shard or a tensor-parallel style placed is a DTensor parameter
(see ``hsdp_param`` and ``core/tensor_parallel/style.py``), so this rank's piece of it
and where that piece lies in the global tensor (its box) come from the DTensor's spec
alone: composition with tensor parallelism is the joint ``(tp, dp...)`` mesh with the
tp placement first. A plain parameter is its own whole box.

Checkpoint layout of ``save_sharded_state_dict(module, path)``: one ``rank{r}.npz`` per
rank holding the pieces this rank is the first replica of (on HSDP the other replicas
hold the same chunks; a parameter replicated over an axis is written by the ranks at
coordinate 0 there), under their fqns, plus ``rank{r}.json`` with, per fqn, the
**global** shape and the piece's box in it (``starts``, ``lengths`` per dim). Loading
reads, for each parameter, only the pieces that overlap this rank's box, so a
checkpoint saved on 4 ranks loads on 2 (or on 1, or into a model that is not sharded).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.dtensor_spec import local_offset
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.fully_shard.hsdp_param import HSDPParam
from hyper_parallel.core.fully_shard.hsdp_state import units_in
from hyper_parallel.platform import get_platform


def _managed(module: Any) -> dict[int, HSDPParam]:
    """``id(sharded parameter) -> HSDPParam`` for every unit under ``module``."""
    return {id(hp.sharded): hp for state in units_in(module) for hp in state.params}


def _plain(param: Any) -> Any:
    """A parameter's local tensor (a DTensor parameter's piece), the tensor itself otherwise."""
    return param._local if isinstance(param, DTensor) else param


def _global_shape(param: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in param.shape)


def _box(param: Any) -> tuple[list[int], list[int]]:
    """``(starts, lengths)``: this rank's piece in the global tensor."""
    shape = _global_shape(param)
    if not isinstance(param, DTensor):
        return [0] * len(shape), list(shape)
    spec = param.spec
    coordinate = spec.mesh.get_coordinate()
    assert coordinate is not None, "a parameter's DTensor lives on a mesh that holds this rank"
    starts = [local_offset(shape, spec.placements, spec.mesh.shape, coordinate, d) for d in range(len(shape))]
    return starts, list(spec.local_shape())


def _first_replica(param: Any) -> bool:
    """Whether this rank writes ``param``'s piece: coordinate 0 on every mesh axis that
    does not shard it (the other ranks there hold the same piece)."""
    if not isinstance(param, DTensor):
        return True  # every rank writes a plain parameter; loading keeps one copy of a box
    coordinate = param.device_mesh.get_coordinate()
    return all(c == 0 for c, pl in zip(coordinate, param.placements) if not isinstance(pl, Shard))


def _take(array: np.ndarray, starts: list[int], lengths: list[int]) -> np.ndarray:
    return array[tuple(slice(s, s + n) for s, n in zip(starts, lengths))]


@dataclass(frozen=True)
class Box:
    """Where one rank's piece of a parameter lies in the global (unsharded) tensor:
    ``shape`` the global shape, the piece ``[starts[d], starts[d] + lengths[d])`` along
    each dim ``d``. A length may be 0 (an uneven shard past the end)."""

    shape: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]


def local_boxes(module: Any) -> dict[str, Box]:
    """``{fqn: Box}`` for every entry of ``named_parameters(module)``: the box of this
    rank's piece, the DTensor parameter's local tensor (the fully_shard chunk inside the
    tensor-parallel chunk; the whole tensor for a parameter neither shards). No
    communication."""
    out = {}
    for fqn, param in get_platform().named_parameters(module):
        starts, lengths = _box(param)
        out[fqn] = Box(_global_shape(param), tuple(starts), tuple(lengths))
    return out


def copy_overlap(dst: np.ndarray, dst_starts: tuple[int, ...] | list[int], src_starts: tuple[int, ...] | list[int],
                 src_lengths: tuple[int, ...] | list[int], read: Callable[[], np.ndarray]) -> int:
    """Copy the overlap of a saved piece (global box ``src_starts``/``src_lengths``) into
    ``dst`` (the piece of global box ``dst_starts``/``dst.shape``). ``read`` returns the
    saved piece and is called only when the boxes overlap, so a loader reads only the
    pieces it needs. Returns the number of values copied."""
    lo = [max(s, w) for s, w in zip(src_starts, dst_starts)]
    hi = [min(s + n, w + m) for s, n, w, m in zip(src_starts, src_lengths, dst_starts, dst.shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return 0
    data = read()
    src = tuple(slice(l - s, h - s) for l, h, s in zip(lo, hi, src_starts))
    dst[tuple(slice(l - w, h - w) for l, h, w in zip(lo, hi, dst_starts))] = data[src]
    return int(np.prod([h - l for l, h in zip(lo, hi)]))


def sharded_state_dict(module: Any) -> dict[str, Any]:
    """``{fqn: parameter}``: the DTensor parameters (a fully_shard parameter's unpadded
    chunk with placements ``[Shard(dim)]`` or ``[Replicate(), Shard(dim)]``, tensor
    parallelism's tp placement first on the joint mesh; global shapes; no
    communication), other parameters as the framework tensors they are."""
    return dict(get_platform().named_parameters(module))


def full_state_dict(module: Any) -> dict[str, np.ndarray]:
    """``{fqn: full values as numpy}`` on rank 0 and ``{}`` elsewhere. Collective: one
    **all-gather** per sharded mesh axis of each DTensor parameter (``full_tensor``;
    every rank must call)."""
    p = get_platform()
    out = {}
    with p.no_grad():
        for fqn, param in p.named_parameters(module):
            out[fqn] = p.to_numpy(param.full_tensor() if isinstance(param, DTensor) else param)
    return out if p.rank() == 0 else {}


def load_full_state_dict(module: Any, state_dict: dict[str, np.ndarray] | None, *,
                         broadcast_from_rank0: bool = True) -> None:
    """Load full values into ``module`` (sharded or not, tensor-parallel or not); each
    rank keeps its piece. The parameters are replaced by new objects: build the
    optimizer (and MindSpore's ``value_and_grad``) after loading.

    Args:
        state_dict: ``{fqn: full array}`` (global shapes).
        broadcast_from_rank0: ``True`` (FSDP2's ``StateDictOptions(broadcast_from_rank0=True)``):
            only rank 0's ``state_dict`` is read and **broadcast**, one parameter at a
            time; other ranks may pass ``None``. ``False``: every rank passes the full
            dict and reads its piece from it (no communication).

    Raises:
        KeyError: a parameter of ``module`` missing from the dict, or of another shape
            (with broadcast: checked on rank 0 and its outcome broadcast first, so
            every rank raises before any parameter is sent).
    """
    p = get_platform()
    managed = _managed(module)
    params = list(p.named_parameters(module))  # loading replaces parameters
    shapes = {fqn: _global_shape(param) for fqn, param in params}
    reads = (p.rank() == 0) or not broadcast_from_rank0
    given = state_dict or {}
    bad = sorted(fqn for fqn, shape in shapes.items()
                 if fqn not in given or tuple(np.shape(given[fqn])) != shape) if reads else []
    if broadcast_from_rank0:
        flag = p.broadcast(p.from_numpy(np.array([len(bad)], np.int64)), src=0).wait()
        count = int(p.to_numpy(flag)[0])
    else:
        count = len(bad)
    if count:
        where = "rank 0's state_dict" if broadcast_from_rank0 else f"rank {p.rank()}'s state_dict"
        raise KeyError(f"load_full_state_dict: {where} lacks {count} parameters or has them in another shape "
                       f"(first: {[(f, shapes[f]) for f in bad[:3]]}); pass every name of named_parameters() "
                       "with its global shape")
    for fqn, param in params:
        if broadcast_from_rank0:
            value = given[fqn] if p.rank() == 0 else np.zeros(shapes[fqn], np.float32)
            full = p.to_numpy(p.broadcast(p.to_dtype(p.from_numpy(np.ascontiguousarray(value, np.float32)),
                                                     param.dtype), src=0).wait())
        else:
            full = np.asarray(given[fqn])
        starts, lengths = _box(param)
        _assign_local(p, module, fqn, param, managed.get(id(param)), np.ascontiguousarray(_take(full, starts, lengths)))


def save_sharded_state_dict(module: Any, path: str) -> None:
    """Write this rank's pieces to ``path`` (see the module docstring). No collective."""
    p = get_platform()
    arrays, meta = {}, {}
    for fqn, param in p.named_parameters(module):
        if not _first_replica(param):
            continue
        starts, lengths = _box(param)
        arrays[fqn] = p.to_numpy(_plain(param))
        meta[fqn] = {"shape": list(_global_shape(param)), "starts": starts, "lengths": lengths}
    if not arrays:
        return
    os.makedirs(path, exist_ok=True)
    np.savez(os.path.join(path, f"rank{p.rank()}.npz"), **{_key(k): v for k, v in arrays.items()})
    with open(os.path.join(path, f"rank{p.rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
def load_sharded_state_dict(module: Any, path: str) -> None:
    """Load a checkpoint of ``save_sharded_state_dict`` saved on any number of ranks and
    any layout: each parameter's piece is assembled from the saved pieces that overlap
    it. No collective (every rank reads the files it needs). The parameters are
    replaced by new objects: build the optimizer after loading.

    Raises:
        FileNotFoundError: no ``rank*.json`` under ``path``.
        KeyError / ValueError: a parameter missing from the checkpoint, of another
            global shape, or not covered by its pieces.
    """
    p = get_platform()
    metas = sorted(f for f in os.listdir(path) if f.startswith("rank") and f.endswith(".json")) \
        if os.path.isdir(path) else []
    if not metas:
        raise FileNotFoundError(f"load_sharded_state_dict: no rank*.json under {path!r}; "
                                "write the checkpoint with save_sharded_state_dict")
    pieces: dict[str, dict[tuple, tuple[dict, str]]] = {}
    for name in metas:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            meta = json.load(f)
        for fqn, info in meta.items():  # replicas write the same box: keep one
            box = (tuple(info["starts"]), tuple(info["lengths"]))
            pieces.setdefault(fqn, {}).setdefault(box, (info, os.path.join(path, name[:-5] + ".npz")))
    managed = _managed(module)
    files: dict[str, Any] = {}
    for fqn, param in list(p.named_parameters(module)):  # loading replaces parameters
        shape = _global_shape(param)
        if fqn not in pieces:
            raise KeyError(f"load_sharded_state_dict: {fqn} is not in the checkpoint at {path!r}")
        infos = list(pieces[fqn].values())
        if tuple(infos[0][0]["shape"]) != shape:
            raise ValueError(f"load_sharded_state_dict: {fqn} has shape {tuple(infos[0][0]['shape'])} in the "
                             f"checkpoint but {shape} in the model")
        want_starts, want_lengths = _box(param)
        local = np.zeros(want_lengths, np.float32)
        covered = 0
        for info, file in infos:
            covered += copy_overlap(local, want_starts, info["starts"], info["lengths"],
                                    lambda file=file: files.setdefault(file, np.load(file))[_key(fqn)])
        if covered != local.size:
            raise ValueError(f"load_sharded_state_dict: the pieces of {fqn} at {path!r} cover {covered} of the "
                             f"{local.size} values this rank needs; the checkpoint is incomplete")
        _assign_local(p, module, fqn, param, managed.get(id(param)), local)


def materialize(module: Any, values: Callable[[str, Box], np.ndarray]) -> None:
    """Give every parameter of ``module`` this rank's piece, and storage for that piece
    alone: ``values(fqn, box)`` (float32 of ``box.lengths``) for the box ``local_boxes``
    names. The end of a delayed initialisation: a model built on the meta device (torch
    ``torch.device("meta")``, MindSpore ``mindspore.DeviceCtx("meta")``) and parallelized
    there (fully_shard, tensor parallelism) holds DTensor parameters with meta local
    tensors; each becomes a new parameter of the same spec holding its piece, and
    fully_shard's units use the new ones (the path ``load_sharded_state_dict`` takes).
    No whole tensor of a sharded parameter is made; a parameter nothing shards is made
    whole. Build the optimizer after. No communication.

    Raises:
        ValueError: a value whose shape is not its box's lengths (naming the parameter).
    """
    p = get_platform()
    managed = _managed(module)
    for fqn, param in list(p.named_parameters(module)):
        starts, lengths = _box(param)
        local = values(fqn, Box(_global_shape(param), tuple(starts), tuple(lengths)))
        if tuple(local.shape) != tuple(lengths):
            raise ValueError(f"materialize: the value of {fqn} has shape {tuple(local.shape)}, but this rank's piece "
                             f"of it is {tuple(lengths)} (starts {tuple(starts)} of {_global_shape(param)})")
        _assign_local(p, module, fqn, param, managed.get(id(param)), local)


def _key(fqn: str) -> str:
    return fqn.replace(".", "/")


def _assign_local(p: Any, module: Any, fqn: str, param: Any, hp: HSDPParam | None, local: np.ndarray) -> None:
    """Replace ``param`` by a new parameter holding ``local`` (this rank's piece; a DTensor
    parameter of the same spec again). A new object: build the optimizer after loading."""
    with p.no_grad():
        value = p.to_dtype(p.from_numpy(np.ascontiguousarray(local)), param.dtype)
        if hp is not None:
            value = hp.to_home(value)  # host memory under CPUOffloadPolicy
        if isinstance(param, DTensor):
            value = DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape)
    new = p.make_parameter(value, requires_grad=bool(getattr(param, "requires_grad", True)))
    if hp is None:
        p.set_parameter(module, fqn, new)
        return
    hp.sharded = new
    hp.drop_unsharded()  # gathered from the old values
    hp.block = None
    for owner, name in hp.uses:
        p.set_parameter(owner, name, new)
