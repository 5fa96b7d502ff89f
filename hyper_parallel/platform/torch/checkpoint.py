"""``torch.distributed.checkpoint`` (DCP) on the torch DTensor class: its extension
protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``,
the methods torch's own DTensor implements in torch 2.13), so that DCP saves, loads and
reshards this project's DTensors.

[Note: DTensors in DCP checkpoints]
Each rank describes its piece as one chunk of the global tensor: its offsets and sizes
from the spec (``DTensorSpec.local_offsets`` / ``local_shape``: nested shards, uneven and
empty pieces included) and the global size. Saving writes the local tensor under that
chunk; ranks holding the same piece (replicated mesh axes) write the same chunk index,
which DCP's save planner keeps once. Loading asks DCP for the overlap of the saved
chunks with this rank's chunk and copies it into the local tensor in place, so a
checkpoint saved on one layout (fully_shard over 4, tensor parallel, a plain model)
loads into any other. A ``Partial`` DTensor (a pending sum) cannot be saved as values:
it raises, as torch's does.

``torch.save`` / ``pickle`` of a DTensor raise a ``TypeError`` that names these paths:
a pickled DTensor would hold one rank's piece and a process group.

[Note: DTensors and torch's state-dict functions]
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` and the rest,
torch 2.13) recognises torch's own ``DTensor`` by ``isinstance``: with
``full_state_dict=True`` it gathers those (``redistribute`` to ``Replicate``) and passes
every other tensor through, so this project's DTensors come back as they are: DTensors
of the global shape, not gathered, on rank 0 only with ``cpu_offload``. torch calls no
method on them there, so that path can neither be made to gather nor refuse; what a
caller then does with them as plain values refuses instead (``numpy()``, ``tolist()``,
pickling, a copy into a plain tensor: ``refuse_plain_read``), naming
``hyper_parallel.platform.torch.state_dict``, whose functions of the same names gather.
On loading a full state dict torch hands plain full tensors to
``module.load_state_dict``, which calls ``param.copy_(full)``: a ``copy_`` into a DTensor
from a plain tensor of the DTensor's global shape copies this rank's piece of it
(``copy_from_full``), so ``set_model_state_dict(full_state_dict=True)`` (and
``broadcast_from_rank0``) load correctly through torch's own code. Its optimizer
counterpart cannot: ``Optimizer.load_state_dict`` replaces the moments by the plain full
tensors (no copy), and the next step refuses them (mixed plain and DTensor operands).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


def _refuse_partial(dt: Any, what: str) -> None:
    if any(pl.is_partial() for pl in dt.placements):
        raise ValueError(f"{what}: a DTensor with placements {list(dt.placements)} holds pending sums, not values; "
                         "redistribute it (e.g. to Replicate) before checkpointing")


def chunk(dt: Any) -> ChunkStorageMetadata:
    """This rank's piece of ``dt`` as a DCP chunk (offsets and sizes in the global tensor)."""
    spec = dt._spec
    return ChunkStorageMetadata(offsets=torch.Size(spec.local_offsets()), sizes=torch.Size(spec.local_shape()))


def create_write_items(dt: Any, fqn: str) -> list[WriteItem]:
    """``__create_write_items__``: one shard write of this rank's piece.

    Raises:
        ValueError: ``dt`` has a ``Partial`` placement.
    """
    _refuse_partial(dt, f"torch.distributed.checkpoint save of {fqn}")
    piece = chunk(dt)
    return [WriteItem(index=MetadataIndex(fqn, piece.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=piece, properties=TensorProperties.create_from_tensor(dt._local),
                                                  size=torch.Size(dt._spec.shape)))]


def create_chunk_list(dt: Any) -> list[ChunkStorageMetadata]:
    """``__create_chunk_list__``: the chunk a load fills on this rank.

    Raises:
        ValueError: ``dt`` has a ``Partial`` placement.
    """
    _refuse_partial(dt, "torch.distributed.checkpoint load")
    return [chunk(dt)]


def tensor_shard(dt: Any, index: MetadataIndex) -> torch.Tensor:
    """``__get_tensor_shard__``: the local tensor (the one chunk every rank has; DCP
    writes it, or copies a load into it in place).

    Raises:
        ValueError: ``dt`` has a ``Partial`` placement, or ``index`` names another chunk.
    """
    _refuse_partial(dt, f"torch.distributed.checkpoint of {index.fqn}")
    if index.offset is not None and tuple(index.offset) != tuple(dt._spec.local_offsets()):
        raise ValueError(f"{index.fqn}: this rank's piece starts at {tuple(dt._spec.local_offsets())}, not at "
                         f"{tuple(index.offset)}")
    return dt._local


SUPPORTED = ("torch.distributed.checkpoint.save / load of model.state_dict() (each rank writes its piece, "
             "loading reshards), or hyper_parallel.platform.torch.state_dict.get_model_state_dict / "
             "get_optimizer_state_dict with StateDictOptions(full_state_dict=True) for plain full tensors")


def refuse_plain_read(dt: Any, what: str) -> None:
    """What ``numpy()``, ``tolist()`` and a copy into a plain tensor do with a DTensor:
    raise (see [Note: DTensors and torch's state-dict functions]).

    Raises:
        RuntimeError: always (the type torch raises for these calls on a tensor subclass).
    """
    raise RuntimeError(f"{what} of a hyper_parallel DTensor (global shape {tuple(dt._spec.shape)}, placements "
                       f"{list(dt._spec.placements)}): it holds only this rank's piece. Call dt.full_tensor() on "
                       "every rank for the whole value (torch.distributed.checkpoint.state_dict's "
                       "get_model_state_dict(full_state_dict=True) does not gather this DTensor class). "
                       f"For checkpoints: {SUPPORTED}")


def copy_from_full(dt: Any, src: torch.Tensor, non_blocking: bool = False) -> Any:
    """``dt.copy_(src)`` for a plain ``src``: ``src`` is the whole value, which every rank
    holds (what ``module.load_state_dict`` of a full state dict passes), and this rank
    copies its piece of it into its local tensor. No communication. Returns ``dt``.

    Raises:
        RuntimeError: ``src`` is not of ``dt``'s global shape (a plain tensor is never
            taken as this rank's piece: wrap a piece with ``DTensor.from_local``), ``src``
            requires grad (this copy is not differentiable), or ``dt`` has a ``Partial``
            placement (a pending sum has no piece to copy).
    """
    spec = dt._spec
    if tuple(src.shape) != tuple(spec.shape):
        raise RuntimeError(f"copy_ into a DTensor of global shape {tuple(spec.shape)} from a torch.Tensor of shape "
                           f"{tuple(src.shape)}: a plain tensor is taken as the whole value, so it must have the "
                           "global shape; wrap a piece with DTensor.from_local(piece, mesh, placements) instead")
    if src.requires_grad:
        raise RuntimeError("copy_ into a DTensor from a plain tensor that requires grad is not differentiable; "
                           "pass src.detach(), or wrap src with DTensor.from_local / distribute_tensor")
    if any(pl.is_partial() for pl in spec.placements):
        raise RuntimeError(f"copy_ of a whole value into a DTensor with placements {list(spec.placements)}: a "
                           "Partial DTensor holds pending sums, not pieces; redistribute it first")
    box = tuple(slice(o, o + n) for o, n in zip(spec.local_offsets(), spec.local_shape()))
    dt._local.copy_(src[box], non_blocking=non_blocking)
    return dt


def refuse_pickle(dt: Any) -> None:
    """What ``__reduce_ex__`` does: raise.

    Raises:
        TypeError: always, naming the ways to save a DTensor.
    """
    raise TypeError(f"a hyper_parallel DTensor (global shape {tuple(dt._spec.shape)}, placements "
                    f"{list(dt._spec.placements)}) cannot be pickled or torch.save'd: it holds one rank's piece. "
                    f"Save a state dict with {SUPPORTED}; or save dt.full_tensor() / dt.to_local() explicitly")
