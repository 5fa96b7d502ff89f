"""State dicts of a fully_shard model: sharded (DTensors, or one file per rank) and full.

Checkpoint layout of ``save_sharded_state_dict(module, path)``: one ``rank{r}.npz`` per
rank of the first replicate group (on HSDP the other replicas hold the same shards)
holding each parameter's piece (a managed parameter's unpadded chunk) under its fqn,
plus ``rank{r}.json`` with, per fqn, the **global** shape and the piece's box in it
(``starts``, ``lengths`` per dim). Loading reads, for each parameter, only the pieces
that overlap this rank's box, so a checkpoint saved on 4 ranks loads on 2 (or on 1,
or into a model that is not sharded at all).

Composition with tensor parallelism (fully_shard over ``mesh2d["dp"]`` after
``parallelize_module`` over ``mesh2d["tp"]``): a parameter's "full" tensor for
fully_shard is this rank's TP shard; the TP style records its placement and global
shape on the module (``TP_SHARDS_ATTR``), so the box is the dp chunk inside the TP
chunk, ``full_state_dict`` all-gathers over dp and then over tp, and
``load_full_state_dict`` keeps the dp chunk of the TP chunk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Shard, chunk_bounds
from hyper_parallel.core.fully_shard.hsdp_param import HSDPParam
from hyper_parallel.core.fully_shard.hsdp_state import STATE_ATTR, HSDPState
from hyper_parallel.core.tensor_parallel.style import TP_SHARDS_ATTR
from hyper_parallel.platform import get_platform


def _managed(module: Any) -> dict[int, HSDPParam]:
    """``id(sharded parameter) -> HSDPParam`` for every unit under ``module``."""
    p = get_platform()
    out: dict[int, HSDPParam] = {}
    for _, sub in p.named_modules(module):
        state: HSDPState | None = vars(sub).get(STATE_ATTR)
        if state is not None:
            out.update({id(hp.sharded): hp for hp in state.params})
    return out


def _tp_shard(hp: HSDPParam | None, module: Any, fqn: str) -> tuple[Any, Shard, tuple[int, ...]] | None:
    """``(tp mesh, Shard(dim), global shape)`` when a tensor-parallel style sharded the
    parameter (recorded on its module by the style), else ``None``."""
    if hp is not None:
        return hp.tp
    owner_name, _, leaf = fqn.rpartition(".")
    owner = dict(get_platform().named_modules(module)).get(owner_name)
    return None if owner is None else vars(owner).get(TP_SHARDS_ATTR, {}).get(leaf)


def _global_shape(param: Any, hp: HSDPParam | None, tp: Any) -> tuple[int, ...]:
    if tp is not None:
        return tuple(tp[2])
    return tuple(int(d) for d in (param.shape if hp is None else hp.shape))


def _box(param: Any, hp: HSDPParam | None, tp: Any) -> tuple[list[int], list[int]]:
    """``(starts, lengths)``: this rank's unpadded piece in the global tensor: the dp
    chunk (fully_shard) inside the tp chunk (tensor parallelism)."""
    shape = _global_shape(param, hp, tp)
    starts, lengths = [0] * len(shape), list(shape)
    if tp is not None:
        mesh, placement, _ = tp
        dim = placement.dim % len(shape)
        starts[dim], lengths[dim] = chunk_bounds(shape[dim], mesh.size(0), mesh.get_local_rank(0))
    if hp is not None:
        start, length = chunk_bounds(hp.shape[hp.dim], hp.shard_size, hp.shard_rank)
        starts[hp.dim] += start
        lengths[hp.dim] = length
    return starts, lengths


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
    rank's unpadded piece (the fully_shard chunk inside the tensor-parallel chunk; the
    whole tensor for a parameter neither shards). The local parameter holds the piece in
    its leading ``lengths`` entries along each dim (fully_shard pads at the end of its
    shard dim). No communication."""
    p = get_platform()
    managed = _managed(module)
    out = {}
    for fqn, param in p.named_parameters(module):
        hp = managed.get(id(param))
        tp = _tp_shard(hp, module, fqn)
        starts, lengths = _box(param, hp, tp)
        out[fqn] = Box(_global_shape(param, hp, tp), tuple(starts), tuple(lengths))
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
    """``{fqn: DTensor}`` for every managed parameter (the unpadded shard, placements
    ``[Shard(dim)]`` or ``[Replicate(), Shard(dim)]`` over the fully_shard mesh; under
    tensor parallelism its global shape is the TP shard's; no communication), other
    parameters as the framework tensors they are."""
    p = get_platform()
    managed = _managed(module)
    return {fqn: managed[id(param)].to_dtensor() if id(param) in managed else param
            for fqn, param in p.named_parameters(module)}


def full_state_dict(module: Any) -> dict[str, np.ndarray]:
    """``{fqn: full values as numpy}`` on rank 0 and ``{}`` elsewhere. Collective: one
    **all-gather** per managed parameter over its shard axis, then, for a
    tensor-parallel shard, one over the tp mesh (every rank must call)."""
    p = get_platform()
    managed = _managed(module)
    out = {}
    for fqn, param in p.named_parameters(module):
        hp = managed.get(id(param))
        full = param if hp is None else hp.to_dtensor().full_tensor()
        tp = _tp_shard(hp, module, fqn)
        if tp is not None:
            mesh, placement, shape = tp
            full = DTensor.from_local(full, mesh, [placement], shape=shape).full_tensor()
        out[fqn] = p.to_numpy(full)
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
    shapes = {fqn: _global_shape(param, managed.get(id(param)), _tp_shard(managed.get(id(param)), module, fqn))
              for fqn, param in params}
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
        hp = managed.get(id(param))
        if broadcast_from_rank0:
            value = given[fqn] if p.rank() == 0 else np.zeros(shapes[fqn], np.float32)
            full = p.to_numpy(p.broadcast(p.to_dtype(p.from_numpy(np.ascontiguousarray(value, np.float32)),
                                                     param.dtype), src=0).wait())
        else:
            full = np.asarray(given[fqn])
        starts, lengths = _box(param, hp, _tp_shard(hp, module, fqn))
        _assign_local(p, module, fqn, param, hp, np.ascontiguousarray(_take(full, starts, lengths)))


def save_sharded_state_dict(module: Any, path: str) -> None:
    """Write this rank's pieces to ``path`` (see the module docstring). No collective."""
    p = get_platform()
    managed = _managed(module)
    arrays, meta = {}, {}
    replica_zero = True
    for fqn, param in p.named_parameters(module):
        hp = managed.get(id(param))
        tp = _tp_shard(hp, module, fqn)
        starts, lengths = _box(param, hp, tp)
        if hp is not None and hp.mesh.ndim == 2 and hp.mesh.get_local_rank(0) != 0:
            replica_zero = False
        arrays[fqn] = p.to_numpy(param if hp is None else hp.local_tensor())
        meta[fqn] = {"shape": list(_global_shape(param, hp, tp)), "starts": starts, "lengths": lengths}
    if not replica_zero:
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
        hp = managed.get(id(param))
        tp = _tp_shard(hp, module, fqn)
        shape = _global_shape(param, hp, tp)
        if fqn not in pieces:
            raise KeyError(f"load_sharded_state_dict: {fqn} is not in the checkpoint at {path!r}")
        infos = list(pieces[fqn].values())
        if tuple(infos[0][0]["shape"]) != shape:
            raise ValueError(f"load_sharded_state_dict: {fqn} has shape {tuple(infos[0][0]['shape'])} in the "
                             f"checkpoint but {shape} in the model")
        want_starts, want_lengths = _box(param, hp, tp)
        local = np.zeros(want_lengths, np.float32)
        covered = 0
        for info, file in infos:
            covered += copy_overlap(local, want_starts, info["starts"], info["lengths"],
                                    lambda file=file: files.setdefault(file, np.load(file))[_key(fqn)])
        if covered != local.size:
            raise ValueError(f"load_sharded_state_dict: the pieces of {fqn} at {path!r} cover {covered} of the "
                             f"{local.size} values this rank needs; the checkpoint is incomplete")
        _assign_local(p, module, fqn, param, hp, local)


def _key(fqn: str) -> str:
    return fqn.replace(".", "/")


def _assign_local(p: Any, module: Any, fqn: str, param: Any, hp: HSDPParam | None, local: np.ndarray) -> None:
    """Replace ``param`` by a new parameter holding ``local`` (this rank's unpadded
    chunk, padded here). A new object: build the optimizer after loading."""
    if hp is not None:
        pad = [(0, 0)] * local.ndim
        pad[hp.dim] = (0, hp.chunk - local.shape[hp.dim])
        local = np.pad(local, pad)
    with p.no_grad():
        value = p.to_dtype(p.from_numpy(np.ascontiguousarray(local)), param.dtype)
        if hp is not None:
            value = hp.to_home(value)  # host memory under CPUOffloadPolicy
    new = p.make_parameter(value, requires_grad=bool(getattr(param, "requires_grad", True)))
    if hp is None:
        p.set_parameter(module, fqn, new)
        return
    hp.sharded = new
    hp.drop_unsharded()  # gathered from the old values
    hp.block = None
    for owner, name in hp.uses:
        p.set_parameter(owner, name, new)
