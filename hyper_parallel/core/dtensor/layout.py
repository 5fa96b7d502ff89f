"""``Layout``: a DTensor's sharding in MindSpore's terms (device matrix, tensor map, rank
list), the form MindSpore's distributed-checkpoint tools and MindFormers read.

[Note: tensor maps]
MindSpore describes a sharded tensor by its device matrix (``mesh_shape``), the global
ranks of the matrix in row-major order (``rank_list``) and a **tensor map**: one entry
per tensor dim, ``-1`` for a dim that is not split, else the mesh axis that splits it
counted **from the last axis** (on a ``(dp, tp)`` mesh, ``tp`` is 0 and ``dp`` is 1), or a
tuple of such axes when several split the same dim, outermost first. A ``Layout`` is a
view of the same facts as a DTensor's ``(device_mesh, placements, shape)``, converted
both ways here, never a second source of truth: ``DTensor.layout`` builds one from the
spec. Pieces follow this project's chunk semantics (``placement_types.chunk_bounds``:
``ceil(size / n)`` rows per piece, the tail short), so the areas below are exactly what
``distribute_tensor(...).to_local()`` holds, uneven sizes included; on even sizes they
equal MindSpore's ``size / n`` slices.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor_spec import local_shape
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard, chunk_bounds

#: A tensor map entry: -1, one axis (from the last), or several (outermost first).
MapEntry = int | tuple[int, ...]


def _entry_axes(entry: MapEntry, mesh_ndim: int) -> list[int]:
    """The mesh axes (counted from the first) of one tensor-map entry, outermost first."""
    values = entry if isinstance(entry, tuple) else (entry,)
    axes = []
    for value in values:
        if value == -1:
            continue
        if not isinstance(value, int) or not 0 <= value < mesh_ndim:
            raise ValueError(f"tensor_map entry {entry!r}: {value!r} is not -1 or a mesh axis in [0, {mesh_ndim}) "
                             "counted from the last axis")
        axes.append(mesh_ndim - 1 - value)
    return axes


def _coordinate(mesh_shape: Sequence[int], index: int) -> tuple[int, ...]:
    """The row-major coordinate of position ``index`` of the device matrix."""
    size = math.prod(mesh_shape)
    if not 0 <= index < size:
        raise ValueError(f"rank index {index} is out of range for a device matrix of {size} ranks "
                         f"{tuple(mesh_shape)}; give the rank's position in rank_list")
    coordinate = []
    for extent in reversed(mesh_shape):
        coordinate.append(index % extent)
        index //= extent
    return tuple(reversed(coordinate))


def _infer_slice_area_by_rank(mesh_shape: Sequence[int], tensor_map: Sequence[MapEntry], rank_index: int,
                              full_shape: Sequence[int]) -> list[tuple[int, int]]:
    """``[(begin, end), ...]`` per tensor dim: the box of the global tensor held by the
    rank at position ``rank_index`` of the layout's ``rank_list`` (see [Note: tensor
    maps]; the name and arguments are MindSpore's, which MindFormers calls).

    Raises:
        ValueError: ``tensor_map`` and ``full_shape`` differ in length, an entry names no
            mesh axis, or ``rank_index`` is outside the device matrix.
    """
    mesh_shape = tuple(int(extent) for extent in mesh_shape)
    if len(tensor_map) != len(full_shape):
        raise ValueError(f"_infer_slice_area_by_rank: tensor_map={tuple(tensor_map)} has {len(tensor_map)} entries "
                         f"but full_shape={tuple(full_shape)} has {len(full_shape)} dims; give one entry per dim")
    coordinate = _coordinate(mesh_shape, int(rank_index))
    area = []
    for entry, size in zip(tensor_map, full_shape):
        begin, length = 0, int(size)
        for axis in _entry_axes(entry, len(mesh_shape)):  # outer axes split first
            offset, length = chunk_bounds(length, mesh_shape[axis], coordinate[axis])
            begin += offset
        area.append((begin, begin + length))
    return area


class Layout:
    """A tensor's sharding over a ``DeviceMesh`` in MindSpore's terms (see [Note: tensor
    maps]).

    Build one with ``Layout.from_device_mesh(mesh)`` and call it with one placement per
    mesh axis (``layout(Shard(0), Replicate())``) or with one mesh-axis name per tensor
    dim (``layout("dp", "None")``, ``layout(("dp", "tp"), "None")``); ``DTensor.layout``
    gives a DTensor's. Building it makes no collective.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"Layout: mesh={mesh!r} is not a DeviceMesh; build one with init_device_mesh")
        self._mesh = mesh
        self._placements: tuple[Placement, ...] | None = None
        self._tensor_map: tuple[MapEntry, ...] | None = None
        self._partial: list[str | None] = [None] * mesh.ndim
        self._global_shape: tuple[int, ...] | None = None  # known when built from a DTensor

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> Layout:
        """A layout over ``device_mesh`` with no tensor map yet."""
        return cls(device_mesh)

    @classmethod
    def of(cls, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> Layout:
        """The layout of a tensor of global ``shape`` with ``placements`` over ``mesh``."""
        layout = cls(mesh)
        layout.set_placements(placements)
        layout.placement_to_tensor_map(len(shape))
        layout._global_shape = tuple(int(size) for size in shape)
        return layout

    def __call__(self, *spec: Any) -> Layout:
        """A copy of this layout for one tensor: placements, one per mesh axis (also as
        one sequence), or mesh-axis names per tensor dim (``"None"``: not split).

        Raises:
            ValueError: an unknown axis name, an axis used twice, or a placement count
                that is not the mesh's number of axes.
        """
        out = copy.copy(self)
        out._partial = [None] * self._mesh.ndim
        out._global_shape = None
        if len(spec) == 1 and isinstance(spec[0], (list, tuple)) and spec[0] and isinstance(spec[0][0], Placement):
            spec = tuple(spec[0])
        if spec and all(isinstance(item, Placement) for item in spec):
            out.set_placements(spec)
            out._tensor_map = None
            return out
        used: set[str] = set()
        out._tensor_map = tuple(out._alias_entry(item, used) for item in spec)
        out.tensor_map_to_placement()
        return out

    def _alias_entry(self, item: str | Sequence[str], used: set[str]) -> MapEntry:
        names = self.alias_name
        entry = []
        for name in (item,) if isinstance(item, str) else tuple(item):
            if name == "None":
                continue
            if names is None or name not in names:
                raise ValueError(f"Layout: {name!r} is not an axis of the mesh; its axes are {names}")
            if name in used:
                raise ValueError(f"Layout: mesh axis {name!r} splits two tensor dims; use each axis once")
            used.add(name)
            entry.append(self._mesh.ndim - 1 - names.index(name))
        if not entry:
            return -1
        return entry[0] if len(entry) == 1 else tuple(entry)

    # -- placements and tensor maps -------------------------------------------------------
    def set_placements(self, placements: Sequence[Placement]) -> None:
        """Set one placement per mesh axis (``placement_to_tensor_map`` derives the map)."""
        placements = tuple(placements)
        if len(placements) != self._mesh.ndim:
            raise ValueError(f"Layout.set_placements: {len(placements)} placements {list(placements)} for a mesh of "
                             f"{self._mesh.ndim} axes {self._mesh.shape}; give one per mesh axis")
        for placement in placements:
            if not isinstance(placement, Placement):
                raise TypeError(f"Layout.set_placements: {placement!r} is not a Placement")
        self._placements = placements
        self._partial = [p.reduce_op if isinstance(p, Partial) else None for p in placements]

    def placement_to_tensor_map(self, ndim: int) -> list[MapEntry]:
        """Derive the tensor map of an ``ndim``-dim tensor from the placements.

        Raises:
            ValueError: no placements set, or a ``Shard`` dim out of range.
        """
        if self._placements is None:
            raise ValueError("Layout.placement_to_tensor_map: no placements; call set_placements first")
        axes_of: list[list[int]] = [[] for _ in range(ndim)]
        for axis, placement in enumerate(self._placements):
            if isinstance(placement, Shard):
                if not -ndim <= placement.dim < ndim:
                    raise ValueError(f"Layout.placement_to_tensor_map: {placement} is out of range for a "
                                     f"{ndim}-dim tensor")
                axes_of[placement.dim % ndim].append(self._mesh.ndim - 1 - axis)  # mesh order: outer first
        tensor_map = [-1 if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in axes_of]
        self._tensor_map = tuple(tensor_map)
        return tensor_map

    def tensor_map_to_placement(self) -> list[Placement]:
        """Derive the placements from the tensor map (and the partial reductions).

        Raises:
            ValueError: no tensor map, or a dim split by several axes in an order other
                than the mesh's (this project's DTensor splits outer mesh axes first).
        """
        if self._tensor_map is None:
            raise ValueError("Layout.tensor_map_to_placement: no tensor map")
        placements: list[Placement] = [Replicate()] * self._mesh.ndim
        for dim, entry in enumerate(self._tensor_map):
            axes = _entry_axes(entry, self._mesh.ndim)
            if axes != sorted(axes):
                raise ValueError(f"Layout: tensor dim {dim} is split by mesh axes {axes} inner axis first; a DTensor "
                                 "splits a dim by its mesh axes in mesh order (outer first)")
            for axis in axes:
                if not isinstance(placements[axis], Replicate):
                    raise ValueError(f"Layout: mesh axis {axis} splits two tensor dims")
                placements[axis] = Shard(dim)
        for axis, op in enumerate(self._partial):
            if op is not None:
                placements[axis] = Partial(op)
        self._placements = tuple(placements)
        return placements

    def reset_partial(self) -> None:
        """Forget pending reductions: ``Partial`` axes become ``Replicate``."""
        self._partial = [None] * self._mesh.ndim
        if self._placements is not None:
            self._placements = tuple(Replicate() if isinstance(p, Partial) else p for p in self._placements)

    # -- queries -------------------------------------------------------------------------
    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device matrix."""
        return self._mesh.shape

    @property
    def alias_name(self) -> tuple[str, ...] | None:
        """The mesh axes' names."""
        return self._mesh.mesh_dim_names

    @property
    def rank_list(self) -> tuple[int, ...]:
        """The global ranks of the device matrix, row-major."""
        return self._mesh.rank_list

    @property
    def placements(self) -> tuple[Placement, ...] | None:
        return self._placements

    @property
    def alias_placements(self) -> tuple[Placement, ...] | None:
        """The placements (the name MindFormers reads to rebuild a DTensor on ``mesh``)."""
        return self._placements

    @property
    def partial(self) -> list[str | None]:
        """Per mesh axis, the pending reduction (``"sum"``, ...) or ``None``."""
        return list(self._partial)

    def is_partial(self) -> bool:
        return any(op is not None for op in self._partial)

    @property
    def tensor_map(self) -> tuple[MapEntry, ...] | None:
        return self._tensor_map

    @property
    def alias_tensor_map(self) -> tuple[Any, ...] | None:
        """The tensor map with mesh-axis names (``"None"``: not split)."""
        if self._tensor_map is None:
            return None
        names = self.alias_name or tuple(f"axis_{a}" for a in range(self._mesh.ndim))
        out: list[Any] = []
        for entry in self._tensor_map:
            axes = _entry_axes(entry, self._mesh.ndim)
            out.append("None" if not axes else names[axes[0]] if len(axes) == 1 else tuple(names[a] for a in axes))
        return tuple(out)

    def _require_map(self, what: str) -> tuple[MapEntry, ...]:
        if self._tensor_map is None:
            raise ValueError(f"Layout.{what}: no tensor map; call placement_to_tensor_map(ndim) first")
        return self._tensor_map

    def get_global_shape(self, slice_shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape of a tensor whose piece here has ``slice_shape``: each split
        dim times its number of pieces; for a DTensor's own layout, its exact global
        shape when ``slice_shape`` is this rank's piece (uneven sizes)."""
        tensor_map = self._require_map("get_global_shape")
        if len(slice_shape) != len(tensor_map):
            raise ValueError(f"Layout.get_global_shape: slice_shape={tuple(slice_shape)} has {len(slice_shape)} "
                             f"dims but the tensor map {tensor_map} has {len(tensor_map)}")
        if self._global_shape is not None and self._placements is not None:
            coordinate = self._mesh.get_coordinate()
            if coordinate is not None and tuple(slice_shape) == local_shape(
                    self._global_shape, self._placements, self._mesh.shape, coordinate):
                return self._global_shape
        shape = []
        for entry, size in zip(tensor_map, slice_shape):
            pieces = math.prod(self._mesh.shape[a] for a in _entry_axes(entry, self._mesh.ndim))
            shape.append(int(size) * pieces)
        return tuple(shape)

    def repeat_num(self) -> int:
        """How many ranks of the device matrix hold each piece: the product of the axes
        that split no dim (``Partial`` axes count, as in MindSpore's layout)."""
        tensor_map = self._require_map("repeat_num")
        used = {a for entry in tensor_map for a in _entry_axes(entry, self._mesh.ndim)}
        return math.prod(extent for axis, extent in enumerate(self._mesh.shape) if axis not in used)

    def slice_area(self, rank: int) -> list[tuple[int, int]]:
        """The box (``[(begin, end), ...]``) of the global tensor that global ``rank``
        holds (the layout must know its global shape: a DTensor's).

        Raises:
            ValueError: ``rank`` is not in the mesh, or the global shape is unknown.
        """
        if self._global_shape is None:
            raise ValueError("Layout.slice_area: the global shape is unknown; use a DTensor's layout or "
                             "_infer_slice_area_by_rank(mesh_shape, tensor_map, index, full_shape)")
        ranks = self.rank_list
        if rank not in ranks:
            raise ValueError(f"Layout.slice_area: rank {rank} is not in the mesh's ranks {ranks}")
        return _infer_slice_area_by_rank(self.mesh_shape, self._require_map("slice_area"), ranks.index(rank),
                                         self._global_shape)

    def to_dict(self) -> dict[str, Any]:
        """``{"mesh_shape", "tensor_map", "interleaved_parallel", "alias_name", "rank_list"}``
        (MindSpore's ``Layout.to_dict`` keys)."""
        return {"mesh_shape": self.mesh_shape, "tensor_map": self._require_map("to_dict"),
                "interleaved_parallel": False, "alias_name": self.alias_name, "rank_list": self.rank_list}

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Layout) and self._mesh == other._mesh and self._tensor_map == other._tensor_map
                and self._partial == other._partial)

    def __hash__(self) -> int:
        return hash((self._mesh, self._tensor_map, tuple(self._partial)))

    def __copy__(self) -> Layout:
        out = Layout.__new__(Layout)
        out.__dict__.update(self.__dict__)
        out._partial = list(self._partial)
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Layout:
        # the mesh (and its process groups, which cannot be copied) is shared
        return self.__copy__()

    def __repr__(self) -> str:
        return (f"Layout(mesh_shape={self.mesh_shape}, alias_name={self.alias_name}, tensor_map={self._tensor_map}, "
                f"partial={self._partial}, rank_list={self.rank_list})")
