"""State dicts of a fully_shard model: sharded (DTensors, or one file per rank) and full.

Checkpoint layout of ``save_sharded_state_dict(module, path)``: one ``rank{r}.npz`` per
rank of the first replicate group (on HSDP the other replicas hold the same shards)
holding each managed parameter's unpadded chunk under its fqn, plus
``rank{r}.json`` with, per fqn, the global shape, the sharded dim and the chunk's
``[start, start + length)`` along it. Loading reads, for each parameter, only the
pieces that overlap this rank's chunk, so a checkpoint saved on 4 ranks loads on 2
(or on 1, or into a model that is not sharded at all).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import chunk_bounds
from hyper_parallel.core.fully_shard.hsdp_param import HSDPParam
from hyper_parallel.core.fully_shard.hsdp_state import STATE_ATTR, HSDPState
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


def _require_world_mesh(module: Any, what: str) -> None:
    """Files and full dicts describe parameters whose global shape is the fully_shard
    one; over a submesh (composition with TP) that is only the tensor-parallel shard."""
    p = get_platform()
    for hp in _managed(module).values():
        if hp.mesh.size() != p.world_size():
            raise ValueError(f"{what}: {hp.fqn} is sharded over a submesh {hp.mesh.shape} of a world of "
                             f"{p.world_size()} (fully_shard composed with tensor parallelism); this state dict "
                             "covers meshes over the whole world only; use sharded_state_dict(module), whose "
                             "DTensors are the tensor-parallel local shards sharded over the data-parallel axis")


def sharded_state_dict(module: Any) -> dict[str, Any]:
    """``{fqn: DTensor}`` for every managed parameter (the unpadded shard, placements
    ``[Shard(dim)]`` or ``[Replicate(), Shard(dim)]``; no communication), other
    parameters as the framework tensors they are."""
    p = get_platform()
    managed = _managed(module)
    return {fqn: managed[id(param)].to_dtensor() if id(param) in managed else param
            for fqn, param in p.named_parameters(module)}


def full_state_dict(module: Any) -> dict[str, np.ndarray]:
    """``{fqn: full values as numpy}`` on rank 0 and ``{}`` elsewhere. Collective: one
    **all-gather** per managed parameter over its shard axis (every rank must call)."""
    _require_world_mesh(module, "full_state_dict")
    p = get_platform()
    out = {}
    for fqn, value in sharded_state_dict(module).items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[fqn] = p.to_numpy(full)
    return out if p.rank() == 0 else {}


def load_full_state_dict(module: Any, state_dict: dict[str, np.ndarray] | None) -> None:
    """Load full values into ``module`` (sharded or not): rank 0's ``state_dict`` is
    **broadcast** (other ranks may pass ``None``), each rank keeps its chunk. The
    parameters are replaced by new objects: build the optimizer (and MindSpore's
    ``value_and_grad``) after loading.

    Raises:
        KeyError: rank 0's dict lacks a parameter of ``module`` (checked on rank 0
            before the first broadcast; the other ranks then fail in the broadcast of
            the check's outcome, with the same message).
    """
    _require_world_mesh(module, "load_full_state_dict")
    p = get_platform()
    names = [fqn for fqn, _ in p.named_parameters(module)]
    missing = sorted(set(names) - set(state_dict or {})) if p.rank() == 0 else []
    flag = p.broadcast(p.from_numpy(np.array([len(missing)], np.int64)), src=0).wait()
    if int(p.to_numpy(flag)[0]):
        raise KeyError(f"load_full_state_dict: rank 0's state_dict lacks {len(missing)} parameters "
                       f"(first: {missing[:3]} on rank 0); pass a dict with every name of named_parameters()")
    managed = _managed(module)
    # A list first: loading replaces parameters, which must not change what is iterated.
    for fqn, param in list(p.named_parameters(module)):
        hp = managed.get(id(param))
        shape = tuple(param.shape) if hp is None else hp.shape
        value = state_dict[fqn] if p.rank() == 0 else np.zeros(shape, np.float32)
        full = p.broadcast(p.to_dtype(p.from_numpy(np.ascontiguousarray(value, np.float32)), param.dtype), src=0).wait()
        _assign(p, module, fqn, param, hp, p.to_numpy(full))


def save_sharded_state_dict(module: Any, path: str) -> None:
    """Write this rank's shards to ``path`` (see the module docstring). No collective."""
    _require_world_mesh(module, "save_sharded_state_dict")
    p = get_platform()
    managed = _managed(module)
    arrays, meta = {}, {}
    replica_zero = True
    for fqn, param in p.named_parameters(module):
        hp = managed.get(id(param))
        if hp is None:
            arrays[fqn], meta[fqn] = p.to_numpy(param), {"shape": list(param.shape), "dim": 0,
                                                         "start": 0, "length": int(param.shape[0]) if param.shape else 1}
            continue
        if hp.mesh.ndim == 2 and hp.mesh.get_local_rank(0) != 0:
            replica_zero = False
        start, length = chunk_bounds(hp.shape[hp.dim], hp.shard_size, hp.shard_rank)
        arrays[fqn] = p.to_numpy(hp.local_tensor())
        meta[fqn] = {"shape": list(hp.shape), "dim": hp.dim, "start": start, "length": length}
    if not replica_zero:
        return
    os.makedirs(path, exist_ok=True)
    np.savez(os.path.join(path, f"rank{p.rank()}.npz"), **{_key(k): v for k, v in arrays.items()})
    with open(os.path.join(path, f"rank{p.rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)


def load_sharded_state_dict(module: Any, path: str) -> None:
    """Load a checkpoint of ``save_sharded_state_dict`` saved on any number of ranks:
    each parameter's chunk is assembled from the saved pieces that overlap it. No
    collective (every rank reads the files it needs). The parameters are replaced by
    new objects: build the optimizer after loading.

    Raises:
        FileNotFoundError: no ``rank*.json`` under ``path``.
        KeyError / ValueError: a parameter missing from the checkpoint, or of another shape.
    """
    _require_world_mesh(module, "load_sharded_state_dict")
    p = get_platform()
    metas = sorted(f for f in os.listdir(path) if f.startswith("rank") and f.endswith(".json")) \
        if os.path.isdir(path) else []
    if not metas:
        raise FileNotFoundError(f"load_sharded_state_dict: no rank*.json under {path!r}; "
                                "write the checkpoint with save_sharded_state_dict")
    pieces: dict[str, list[tuple[dict, str, str]]] = {}
    for name in metas:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            meta = json.load(f)
        for fqn, info in meta.items():
            pieces.setdefault(fqn, []).append((info, os.path.join(path, name[:-5] + ".npz"), fqn))
    managed = _managed(module)
    files: dict[str, Any] = {}
    for fqn, param in list(p.named_parameters(module)):  # loading replaces parameters
        hp = managed.get(id(param))
        shape = tuple(int(s) for s in (param.shape if hp is None else hp.shape))
        if fqn not in pieces:
            raise KeyError(f"load_sharded_state_dict: {fqn} is not in the checkpoint at {path!r}")
        infos = pieces[fqn]
        if len({(i["start"], i["length"]) for i, _, _ in infos}) < len(infos):
            infos = list({(i["start"], i["length"]): (i, f, k) for i, f, k in infos}.values())  # replicas
        if tuple(infos[0][0]["shape"]) != shape:
            raise ValueError(f"load_sharded_state_dict: {fqn} has shape {tuple(infos[0][0]['shape'])} in the "
                             f"checkpoint but {shape} in the model")
        dim = infos[0][0]["dim"]
        want_start, want_length = (0, shape[dim] if shape else 1) if hp is None else \
            chunk_bounds(shape[dim], hp.shard_size, hp.shard_rank)
        parts = []
        for info, file, key in sorted(infos, key=lambda item: item[0]["start"]):
            lo = max(info["start"], want_start)
            hi = min(info["start"] + info["length"], want_start + want_length)
            if hi <= lo:
                continue
            data = files.setdefault(file, np.load(file))[_key(key)]
            parts.append(np.take(data, range(lo - info["start"], hi - info["start"]), axis=dim) if shape else data)
        local = np.concatenate(parts, axis=dim) if len(parts) > 1 else parts[0] if parts else \
            np.zeros([0 if d == dim else s for d, s in enumerate(shape)], np.float32)
        _assign_local(p, module, fqn, param, hp, local)


def _key(fqn: str) -> str:
    return fqn.replace(".", "/")


def _assign(p: Any, module: Any, fqn: str, param: Any, hp: HSDPParam | None, full: np.ndarray) -> None:
    if hp is not None:
        start, length = chunk_bounds(hp.shape[hp.dim], hp.shard_size, hp.shard_rank)
        full = np.take(full, range(start, start + length), axis=hp.dim)
    _assign_local(p, module, fqn, param, hp, full)


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
