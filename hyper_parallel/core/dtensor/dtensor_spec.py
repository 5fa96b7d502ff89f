"""``DTensorSpec``: the immutable metadata of a DTensor (mesh, placements, global shape)
and the sharding arithmetic derived from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Placement, Shard, chunk_bounds


def dim_size_at(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                coordinate: Sequence[int], axis: int, dim: int) -> int:
    """The size of tensor dim ``dim`` as mesh axis ``axis`` sees it: the global size cut
    down by the axes before ``axis`` that shard the same dim (nested sharding: outer axes
    split first, each inner axis splits the chunk it is given)."""
    size = shape[dim]
    for a in range(axis):
        if placements[a] == Shard(dim):
            size = chunk_bounds(size, mesh_shape[a], coordinate[a])[1]
    return size


def local_offset(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                 coordinate: Sequence[int], dim: int) -> int:
    """Where this rank's piece starts along ``dim`` in the global tensor (nested shards:
    each axis's chunk start within the chunk the outer axes left)."""
    start, size = 0, shape[dim]
    for a, placement in enumerate(placements):
        if placement == Shard(dim):
            offset, size = chunk_bounds(size, mesh_shape[a], coordinate[a])
            start += offset
    return start


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                coordinate: Sequence[int]) -> tuple[int, ...]:
    """The local shape at mesh ``coordinate`` (uneven and empty shards included)."""
    local = list(shape)
    for a, placement in enumerate(placements):
        if isinstance(placement, Shard):
            local[placement.dim] = chunk_bounds(local[placement.dim], mesh_shape[a], coordinate[a])[1]
    return tuple(local)


def normalize_placements(placements: Sequence[Placement], mesh: DeviceMesh, ndim: int,
                         *, what: str) -> tuple[Placement, ...]:
    """Check ``placements`` against the mesh and a tensor of ``ndim`` dims; negative shard
    dims are made non-negative.

    Raises:
        TypeError: an entry is not a Placement.
        ValueError: one placement per mesh axis is not given, or a shard dim is out of range.
    """
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"{what}: placements={list(placements)} has {len(placements)} entries but the mesh "
                         f"{mesh.shape} has {mesh.ndim} axes; give one placement per mesh axis")
    out = []
    for placement in placements:
        if not isinstance(placement, Placement):
            raise TypeError(f"{what}: {placement!r} is not a Placement; use Shard(dim), Replicate() or Partial(op)")
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                raise ValueError(f"{what}: {placement} is out of range for a {ndim}-D tensor; "
                                 f"shard a dim in [{-ndim}, {ndim})")
            placement = Shard(placement.dim % ndim)
        out.append(placement)
    return tuple(out)


@dataclass(frozen=True)
class DTensorSpec:
    """Mesh, placements (one per mesh axis) and global shape of a DTensor."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]

    def __hash__(self) -> int:
        # specs key the op-plan cache; the fields never change, so the hash is computed once
        value = self.__dict__.get("_hash")
        if value is None:
            value = hash((self.mesh, self.placements, self.shape))
            object.__setattr__(self, "_hash", value)
        return value

    def local_shape(self) -> tuple[int, ...]:
        """This rank's local shape."""
        coordinate = self.mesh.get_coordinate()
        if coordinate is None:
            return tuple(0 for _ in self.shape)
        return local_shape(self.shape, self.placements, self.mesh.shape, coordinate)

    def local_offsets(self) -> tuple[int, ...]:
        """Where this rank's piece starts in the global tensor, per dim (zeros on a rank
        outside the mesh, whose piece is empty)."""
        coordinate = self.mesh.get_coordinate()
        if coordinate is None:
            return tuple(0 for _ in self.shape)
        return tuple(local_offset(self.shape, self.placements, self.mesh.shape, coordinate, d)
                     for d in range(len(self.shape)))
