"""``DeviceMesh``: ranks arranged in an n-D grid with named axes, one process group per axis.

*Axis* means a mesh axis throughout (a tensor dimension is a *dim*). Groups come from
the platform (``split_group``), created once per rank tuple; creating a mesh, and
``flatten``, are collective over the world: every rank calls them in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform, mesh_device_types
from hyper_parallel.core.process_groups import split_group


def _axis_lines(mesh: np.ndarray, axes: Sequence[int]) -> list[list[int]]:
    """The rank lists that vary only along ``axes`` (row-major inside each list): one
    process group per list makes the group of that set of axes."""
    others = [a for a in range(mesh.ndim) if a not in axes]
    moved = np.transpose(mesh, others + list(axes))
    return [list(map(int, block.reshape(-1))) for block in moved.reshape(-1, int(np.prod([mesh.shape[a] for a in axes])))]


class DeviceMesh:
    """An n-D grid of global ranks with optional axis names.

    Args:
        device_type: the platform's device type (``"cpu"``, ``"cuda"``, ``"npu"``,
            ``"ascend"``); a different one raises.
        mesh: nested sequence or array of global ranks, each rank of the world once.
        mesh_dim_names: one distinct name per axis (``("dp", "tp")``).

    Raises:
        ValueError: the mesh does not hold each rank of the world exactly once, the
            names are duplicated or of the wrong count, or ``device_type`` is not the
            platform's.
    """

    def __init__(self, device_type: str, mesh: Any, *, mesh_dim_names: Sequence[str] | None = None) -> None:
        p = get_platform()
        ranks = np.asarray(mesh, dtype=np.int64)
        if ranks.ndim == 0:
            ranks = ranks.reshape(1)
        world = p.world_size()
        if sorted(ranks.reshape(-1).tolist()) != list(range(world)):
            raise ValueError(
                f"DeviceMesh: mesh {ranks.tolist()} (shape {tuple(ranks.shape)}) must hold each of the {world} ranks "
                f"of the world exactly once; use init_device_mesh(device_type, shape) with prod(shape) == {world}"
            )
        self._init(device_type, ranks, mesh_dim_names)
        self._root: DeviceMesh = self
        self._root_axes: tuple[int, ...] = tuple(range(ranks.ndim))  # this mesh's axes as root axes
        self._groups: tuple[Any, ...] = tuple(split_group(_axis_lines(ranks, [a])) for a in range(ranks.ndim))
        # the mesh this one was unflattened from (itself if none): ``_flatten(name)`` of any
        # mesh derived from it registers the flattened mesh there, under ``name``
        self._origin: DeviceMesh = self
        self._flattened: dict[str, DeviceMesh] = {}

    def _init(self, device_type: str, ranks: np.ndarray, names: Sequence[str] | None) -> None:
        p = get_platform()
        if device_type not in mesh_device_types(p.name):
            raise ValueError(f"DeviceMesh: device_type={device_type!r} but the platform {p.name} computes on "
                             f"{p.device_type!r}; pass {p.device_type!r}")
        if device_type != p.device_type:
            # MindSpore: "npu" (MindFormers' spelling of Ascend) names the backend's device
            if p.device_type != "ascend":
                warnings.warn(f"DeviceMesh: device_type={device_type!r} on {p.name} is taken as {p.device_type!r}: "
                              "MindSpore places tensors by its context, not by the mesh", RuntimeWarning, stacklevel=3)
            device_type = p.device_type
        if names is not None:
            names = tuple(names)
            if len(names) != ranks.ndim or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"DeviceMesh: mesh_dim_names={names} must be {ranks.ndim} distinct strings, "
                                 f"one per axis of the {tuple(ranks.shape)} mesh")
        self._device_type: str = device_type
        self._mesh: np.ndarray = ranks  # n-D array of global ranks
        self._names: tuple[str, ...] | None = names
        me = p.rank()
        where = np.argwhere(ranks == me)
        self._coordinate: tuple[int, ...] | None = tuple(int(c) for c in where[0]) if len(where) else None

    # -- queries -----------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def mesh(self) -> np.ndarray:
        """The grid of global ranks (a copy)."""
        return self._mesh.copy()

    @property
    def ndim(self) -> int:
        return self._mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self._mesh.shape)

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._names

    def size(self, axis: int | str | None = None) -> int:
        """The number of ranks in the mesh, or along ``axis``."""
        return int(self._mesh.size) if axis is None else self.shape[self._axis(axis)]

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along each axis; ``None`` if the rank is not in the mesh."""
        return self._coordinate

    def get_local_rank(self, axis: int | str | None = None) -> int:
        """This rank's index along ``axis`` (may be omitted on a 1-D mesh).

        Raises:
            ValueError: unknown axis, or ``None`` on a mesh of several axes.
            RuntimeError: this rank is not in the mesh.
        """
        coordinate = self._require_coordinate("get_local_rank")
        return coordinate[self._axis(axis)]

    def get_group(self, axis: int | str | None = None) -> Any:
        """The platform process group of ``axis`` that holds this rank.

        Raises:
            ValueError: unknown axis, or ``None`` on a mesh of several axes.
            RuntimeError: this rank is not in the mesh.
        """
        self._require_coordinate("get_group")
        if isinstance(axis, str) and (self._names is None or axis not in self._names):
            flat = self.root_mesh._flattened.get(axis)
            if flat is not None:  # torch's root_mesh.get_group("dp_cp") after _flatten("dp_cp")
                return flat._groups[0]
        return self._groups[self._axis(axis)]

    def _require_coordinate(self, what: str) -> tuple[int, ...]:
        if self._coordinate is None:
            raise RuntimeError(f"DeviceMesh.{what}: rank {get_platform().rank()} is not in mesh {self._mesh.tolist()}")
        return self._coordinate

    def _axis(self, axis: int | str | None) -> int:
        if axis is None:
            if self.ndim != 1:
                raise ValueError(f"DeviceMesh: axis=None is ambiguous on a {self.ndim}-D mesh; name an axis "
                                 f"({self._names or tuple(range(self.ndim))})")
            return 0
        if isinstance(axis, str):
            if self._names is None or axis not in self._names:
                raise ValueError(f"DeviceMesh: no axis named {axis!r}; the axes are {self._names}")
            return self._names.index(axis)
        if not isinstance(axis, int) or isinstance(axis, bool) or not -self.ndim <= axis < self.ndim:
            raise ValueError(f"DeviceMesh: axis={axis!r} is out of range for a {self.ndim}-D mesh")
        return axis % self.ndim

    # -- submeshes ---------------------------------------------------------------------
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The submesh over the named axes that holds this rank (``mesh["tp"]``,
        ``mesh["dp", "cp"]``); its groups are this mesh's, nothing is created."""
        names = (names,) if isinstance(names, str) else tuple(names)
        axes = [self._axis(name) for name in names]
        if len(set(axes)) != len(axes):
            raise ValueError(f"DeviceMesh: axes {names} repeat an axis")
        if axes == list(range(self.ndim)):
            return self
        coordinate = self._require_coordinate("__getitem__")
        index = tuple(slice(None) if a in axes else coordinate[a] for a in range(self.ndim))
        order = sorted(axes)  # numpy keeps the sliced axes in increasing order
        ranks = np.transpose(self._mesh[index], [order.index(a) for a in axes])
        sub = DeviceMesh.__new__(DeviceMesh)
        sub._init(self._device_type, np.ascontiguousarray(ranks),
                  tuple(self._names[a] for a in axes) if self._names else None)
        sub._root = self._root
        sub._root_axes = tuple(self._root_axes[a] for a in axes)
        sub._groups = tuple(self._groups[a] for a in axes)
        return sub

    def flatten(self, name: str | None = None) -> DeviceMesh:
        """A 1-D mesh over this mesh's ranks in row-major order, with its own group.

        Collective: every rank of the world calls it on its own (sub)mesh of the same axes.
        """
        if self.ndim == 1 and name is None:
            return self
        root = self._root
        lines = _axis_lines(root._mesh, list(self._root_axes))
        group = split_group(lines)
        flat = DeviceMesh.__new__(DeviceMesh)
        flat_name = name if name is not None else "_".join(self._names) if self._names else None
        flat._init(self._device_type, self._mesh.reshape(-1), None if flat_name is None else (flat_name,))
        flat._root = root
        flat._root_axes = self._root_axes
        flat._groups = (group,)
        return flat

    # -- the names MindFormers and torch's private API use -----------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The grid's shape (MindSpore's name for ``shape``)."""
        return self.shape

    @property
    def rank_list(self) -> tuple[int, ...]:
        """The grid's global ranks in row-major order."""
        return tuple(int(r) for r in self._mesh.reshape(-1))

    @property
    def root_mesh(self) -> DeviceMesh:
        """The mesh every mesh derived from this one comes from: the one built with
        ``init_device_mesh`` (through ``_unflatten``, submeshes and ``flatten``)."""
        return self._root._origin

    def get_rank_list_along_axis(self, axis: int | str) -> list[int]:
        """The global ranks of ``axis``'s line through this rank (its group's ranks).

        Raises:
            ValueError: unknown axis. RuntimeError: this rank is not in the mesh.
        """
        coordinate = self._require_coordinate("get_rank_list_along_axis")
        a = self._axis(axis)
        index = tuple(slice(None) if i == a else c for i, c in enumerate(coordinate))
        return [int(r) for r in self._mesh[index]]

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """``flatten(name)``, and the flattened mesh registered on ``root_mesh`` under its
        name (torch's ``DeviceMesh._flatten``): ``root_mesh.get_group(name)`` then gives
        its group. Collective as ``flatten``.

        Raises:
            ValueError: the name is taken by another flattening of other axes.
        """
        name = mesh_dim_name if mesh_dim_name is not None else "_".join(self._names) if self._names else None
        registry = self.root_mesh._flattened
        known = registry.get(name) if name is not None else None
        if known is not None and known.rank_list != self.rank_list:  # checked before the collective
            raise ValueError(f"DeviceMesh._flatten: {name!r} already names the flattened mesh {known.rank_list}, "
                             f"not these ranks {self.rank_list}; choose another name")
        flat = self.flatten(mesh_dim_name)
        if name is not None:
            registry[name] = flat
        return flat

    def _unflatten(self, dim: int | str, sizes: Sequence[int], names: Sequence[str], *,
                   backend_override: dict[str, Any] | None = None) -> DeviceMesh:
        """Split axis ``dim`` into axes of ``sizes`` named ``names`` (torch's
        ``DeviceMesh._unflatten``; row-major, so rank order is kept): a new mesh over the
        same ranks with a process group per axis, whose ``root_mesh`` is this mesh's.
        Collective over the world (group creation): every rank calls it in the same order.

        ``backend_override`` (``{axis name: "fake" | None}``) is accepted and every axis
        gets a real group anyway: a ``"fake"`` axis (no group, in MindFormers' meshes for
        size-1 axes and the data-loading ``batch`` axis) would fail where a collective
        reaches it, a real one only costs its creation.

        Raises:
            ValueError: ``prod(sizes)`` is not the axis's size, ``names`` do not fit
                (count, duplicates, clash with the other axes), a ``backend_override``
                key that is not in ``names``, or a mesh that does not hold every rank of
                the world (unflatten the world mesh).
        """
        a = self._axis(dim)
        sizes = tuple(int(size) for size in sizes)
        names = tuple(names)
        if int(np.prod(sizes)) != self.shape[a] or any(size < 1 for size in sizes):
            raise ValueError(f"DeviceMesh._unflatten: sizes={sizes} multiply to {int(np.prod(sizes))} but axis {dim!r} "
                             f"has {self.shape[a]} ranks; give sizes whose product is {self.shape[a]}")
        if len(names) != len(sizes):
            raise ValueError(f"DeviceMesh._unflatten: {len(names)} names {names} for {len(sizes)} sizes {sizes}; "
                             "give one name per size")
        others = tuple(n for i, n in enumerate(self._names or ()) if i != a)
        if self._names is None and self.ndim > 1:
            raise ValueError("DeviceMesh._unflatten: the mesh has no axis names; name its axes (mesh_dim_names)")
        unknown = sorted(set(backend_override or {}) - set(names))
        if unknown:
            raise ValueError(f"DeviceMesh._unflatten: backend_override names {unknown}, which are not among the new "
                             f"axes {names}")
        world = get_platform().world_size()
        if sorted(self.rank_list) != list(range(world)):
            raise ValueError(f"DeviceMesh._unflatten: the mesh holds ranks {self.rank_list}, not the whole world of "
                             f"{world}; unflatten the world mesh (init_device_mesh) instead")
        shape = self.shape[:a] + sizes + self.shape[a + 1:]
        all_names = (others[:a] + names + others[a:]) if self._names is not None else names
        out = DeviceMesh(self._device_type, self._mesh.reshape(shape), mesh_dim_names=all_names)
        out._origin = self.root_mesh
        return out

    # -- identity ----------------------------------------------------------------------
    def _key(self) -> tuple[Any, ...]:
        # a mesh never changes after construction, and every DTensor op compares and
        # hashes meshes: the key is computed once
        key = self.__dict__.get("_cached_key")
        if key is None:
            key = self._device_type, self.shape, tuple(self._mesh.reshape(-1).tolist()), self._names
            self.__dict__["_cached_key"] = key
        return key

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key() == other._key())

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._names}" if self._names else ""
        return f"DeviceMesh({self._device_type!r}, {self._mesh.tolist()}{names})"


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """A mesh of ``mesh_shape`` over ranks ``0 .. world - 1`` in row-major order.

    Raises:
        ValueError: ``prod(mesh_shape)`` is not the world size (on every rank, before
            any group is created), or the names do not fit.
    """
    shape = tuple(int(s) for s in mesh_shape)
    world = get_platform().world_size()
    if not shape or any(s < 1 for s in shape) or int(np.prod(shape)) != world:
        raise ValueError(f"init_device_mesh: mesh_shape={shape} holds {int(np.prod(shape)) if shape else 0} ranks but "
                         f"the world has {world}; give a shape whose product is {world}")
    return DeviceMesh(device_type, np.arange(world).reshape(shape), mesh_dim_names=mesh_dim_names)


def _joint_mesh(outer: DeviceMesh, inner: DeviceMesh) -> DeviceMesh:
    """The mesh whose axes are ``outer``'s single axis followed by ``inner``'s, over the
    ranks of both (the mesh of a tensor-parallel parameter that fully_shard shards again:
    ``(tp, dp...)``, so that left-to-right nested sharding, tp chunk first, is how the
    data lies). Its groups are the two meshes' own: nothing is created.

    ``inner``'s root mesh must have an axis that runs along ``outer`` (the two come from
    one ``init_device_mesh``, or from meshes of the same row-major layout).

    Raises:
        ValueError: ``outer`` is not 1-D, or no axis of ``inner``'s root runs along it.
    """
    if outer.ndim != 1:
        raise ValueError(f"_joint_mesh: the outer mesh must be 1-D, got {outer.shape}")
    root = inner._root
    me = get_platform().rank()
    where = np.argwhere(root._mesh == me)
    line = outer._mesh.tolist()
    axis = None
    if len(where):
        coordinate = tuple(int(c) for c in where[0])
        for a in range(root.ndim):
            if a in inner._root_axes:
                continue
            index = tuple(slice(None) if b == a else c for b, c in enumerate(coordinate))
            if root._mesh[index].tolist() == line:
                axis = a
                break
    if axis is None:
        raise ValueError(f"the meshes {outer} and {inner} do not come from one layout: no axis of {root} runs "
                         f"along {line}; build both as submeshes of one init_device_mesh (e.g. mesh2d['tp'] "
                         "and mesh2d['dp'])")
    axes = [axis, *inner._root_axes]
    index = tuple(slice(None) if b in axes else c for b, c in enumerate(coordinate))
    order = sorted(axes)  # numpy keeps the sliced axes in increasing order
    ranks = np.transpose(root._mesh[index], [order.index(a) for a in axes])
    names = (*outer._names, *inner._names) if outer._names and inner._names else None
    joint = DeviceMesh.__new__(DeviceMesh)
    joint._init(outer._device_type, np.ascontiguousarray(ranks).reshape((outer.size(), *inner.shape)), names)
    joint._root = root
    joint._root_axes = tuple(axes)
    joint._groups = (*outer._groups, *inner._groups)
    return joint
