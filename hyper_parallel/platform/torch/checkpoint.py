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


def refuse_pickle(dt: Any) -> None:
    """What ``__reduce_ex__`` does: raise.

    Raises:
        TypeError: always, naming the ways to save a DTensor.
    """
    raise TypeError(f"a hyper_parallel DTensor (global shape {tuple(dt._spec.shape)}, placements "
                    f"{list(dt._spec.placements)}) cannot be pickled or torch.save'd: it holds one rank's piece. "
                    "Save a state dict with torch.distributed.checkpoint.save (each rank writes its piece, and "
                    "loading reshards), or save dt.full_tensor() / dt.to_local() explicitly")
