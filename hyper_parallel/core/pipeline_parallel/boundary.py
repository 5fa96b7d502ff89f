"""DTensors crossing a pipeline stage boundary.

[Note: DTensors between stages]
A stage whose output is a ``DTensor`` (tensor parallelism with sequence parallelism hands
the next layer a ``Shard(seq)`` hidden state; Megatron and MindFormers cut pipelines
there) sends its local piece; the next stage gets a ``DTensor`` again, with the same
placements and global shape, on its own mesh of the same shape. The pipeline group joins
ranks that agree on every other mesh coordinate, so in a row-major mesh the receiver's
mesh is the sender's with every rank shifted by ``receiver rank - sender rank``: the wire
carries the sender's mesh as offsets from the sender's rank, and the receiver looks that
grid up among the meshes it already holds (its parameters' meshes and their named
submeshes, and the stage's ``mesh`` root and its submeshes). Nothing is created, so no
collective runs.

The runtime differentiates a stage with respect to the local pieces: the recorded function
wraps its inputs with ``DTensor.from_local`` and unwraps its outputs with ``to_local``
(both differentiable), so input gradients are local pieces to send back and the output
gradients received are the local pieces of the next stage's input gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard

MAX_DIMS = 8  # dims of a tensor crossing a boundary (``messages`` encodes its shape in as many slots)
MAX_MESH_DIMS = 4
MAX_MESH_RANKS = 256
#: int64 slots of one tensor's layout: present, mesh ndim, mesh dims, placements,
#: global dims (the spec's ndim of them), then the mesh's rank offsets
LAYOUT_LEN = 2 + 2 * MAX_MESH_DIMS + MAX_DIMS + MAX_MESH_RANKS


@dataclass(frozen=True)
class BoundaryLayout:
    """What the next stage needs to rebuild a ``DTensor`` from its local piece.

    Attributes:
        mesh_shape: the sender's mesh shape.
        offsets: the sender's mesh ranks (row-major) minus the sender's rank.
        placements: per mesh axis, ``-1`` for ``Replicate`` or the ``Shard`` dim (>= 0).
        shape: the global shape.
    """

    mesh_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    placements: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Rebuild:
    """A resolved layout: the mesh, placements and global shape of ``DTensor.from_local``."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]

    def wrap(self, local: Any) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, shape=self.shape)


def layout_of(tensor: DTensor, rank: int, what: str) -> BoundaryLayout:
    """The wire layout of ``tensor`` sent by global rank ``rank``.

    Raises:
        TypeError: a ``Partial`` placement, or a mesh beyond ``MAX_MESH_DIMS`` axes /
            ``MAX_MESH_RANKS`` ranks.
    """
    mesh, ndim = tensor.device_mesh, len(tensor.shape)
    if mesh.ndim > MAX_MESH_DIMS or mesh.mesh.size > MAX_MESH_RANKS:
        raise TypeError(f"{what}: a DTensor on a mesh of shape {mesh.shape}; at most {MAX_MESH_DIMS} axes and "
                        f"{MAX_MESH_RANKS} ranks cross a stage boundary")
    codes = []
    for placement in tensor.placements:
        if isinstance(placement, Shard):
            codes.append(placement.dim % ndim)
        elif isinstance(placement, Replicate):
            codes.append(-1)
        else:
            raise TypeError(f"{what}: a DTensor with placements {tuple(tensor.placements)} crosses a stage "
                            "boundary; reduce the Partial placement first (redistribute to Replicate or Shard)")
    offsets = tuple(int(r) - rank for r in mesh.mesh.reshape(-1))
    return BoundaryLayout(tuple(mesh.shape), offsets, tuple(codes), tuple(int(d) for d in tensor.shape))


def encode_layout(layout: BoundaryLayout | None) -> np.ndarray:
    """``layout`` as ``[LAYOUT_LEN]`` int64 slots of the shapes message (all zero: none)."""
    slots = np.zeros(LAYOUT_LEN, np.int64)
    if layout is None:
        return slots
    n = len(layout.mesh_shape)
    slots[0], slots[1] = 1, n
    slots[2:2 + n] = layout.mesh_shape
    slots[2 + MAX_MESH_DIMS:2 + MAX_MESH_DIMS + n] = layout.placements
    base = 2 + 2 * MAX_MESH_DIMS
    slots[base:base + len(layout.shape)] = layout.shape
    slots[base + MAX_DIMS:base + MAX_DIMS + len(layout.offsets)] = layout.offsets
    return slots


def decode_layout(slots: np.ndarray, ndim: int) -> BoundaryLayout | None:
    """Inverse of ``encode_layout`` for a tensor of ``ndim`` dims."""
    if not int(slots[0]):
        return None
    n = int(slots[1])
    mesh_shape = tuple(int(d) for d in slots[2:2 + n])
    base = 2 + 2 * MAX_MESH_DIMS
    size = int(np.prod(mesh_shape))
    return BoundaryLayout(mesh_shape, tuple(int(o) for o in slots[base + MAX_DIMS:base + MAX_DIMS + size]),
                          tuple(int(c) for c in slots[2 + MAX_MESH_DIMS:2 + MAX_MESH_DIMS + n]),
                          tuple(int(d) for d in slots[base:base + ndim]))


def _named_submeshes(mesh: DeviceMesh) -> Iterator[DeviceMesh]:
    """``mesh`` and, when its axes are named, its submeshes over every ordered choice of
    them that keeps the mesh's axis order (``mesh["tp"]``, ``mesh["dp", "tp"]``, ...)."""
    yield mesh
    names = mesh.mesh_dim_names
    if not names or mesh.get_coordinate() is None:
        return
    for mask in range(1, 2 ** len(names) - 1):
        yield mesh[tuple(name for i, name in enumerate(names) if mask >> i & 1)]


def candidate_meshes(stage: Any) -> Iterator[DeviceMesh]:
    """The meshes a receiving stage already holds (see [Note: DTensors between stages])."""
    seen: set[int] = set()
    roots = []
    for _, param in stage.named_params:
        if isinstance(param, DTensor) and id(param.device_mesh) not in seen:
            seen.add(id(param.device_mesh))
            roots.append(param.device_mesh)
    if stage.mesh is not None:
        roots += [stage.mesh, stage.mesh.root_mesh]
    for root in roots:
        yield from _named_submeshes(root)


def resolve(stage: Any, layout: BoundaryLayout, rank: int, what: str) -> Rebuild:
    """The receiving ``stage``'s mesh for ``layout`` (global rank ``rank``).

    Raises:
        ValueError: none of the stage's meshes holds the shifted ranks.
    """
    want = np.asarray(layout.offsets, np.int64).reshape(layout.mesh_shape) + rank
    for mesh in candidate_meshes(stage):
        if tuple(mesh.shape) == layout.mesh_shape and np.array_equal(mesh.mesh, want):
            placements = tuple(Replicate() if code < 0 else Shard(code) for code in layout.placements)
            return Rebuild(mesh, placements, layout.shape)
    raise ValueError(f"{what}: a DTensor arrives on a mesh of ranks {want.tolist()} (the sender's, shifted along "
                     f"the pipeline), but {stage!r} holds no such mesh among its parameters' meshes and its mesh's "
                     "root; give the stage a DTensor parameter on it, or mesh= a pipeline mesh whose root has "
                     "that axis")


def rebuilds_of(outputs: Sequence[Any]) -> tuple[Rebuild | None, ...]:
    """The sender's own layouts of its outputs (a local handover needs no lookup)."""
    return tuple(Rebuild(t.device_mesh, tuple(t.placements), tuple(int(d) for d in t.shape))
                 if isinstance(t, DTensor) else None for t in outputs)


def wrap_inputs(tensors: Sequence[Any], rebuilds: Sequence[Rebuild | None] | None) -> tuple[Any, ...]:
    """A stage's inputs as it takes them: each local piece with a layout rebuilt as a
    ``DTensor`` (differentiable: the gradient flows to the piece)."""
    if not rebuilds:
        return tuple(tensors)
    return tuple(t if r is None else r.wrap(t) for t, r in zip(tensors, rebuilds))


def unwrap_outputs(out: Any) -> Any:
    """A stage's output (a tensor or a tuple) as it crosses: each ``DTensor`` as its local
    piece (differentiable), the structure kept."""
    if isinstance(out, tuple):
        return tuple(t.to_local() if isinstance(t, DTensor) else t for t in out)
    return out.to_local() if isinstance(out, DTensor) else out
