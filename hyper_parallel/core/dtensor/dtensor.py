"""``DTensor``: a global tensor described by a mesh, placements and a global shape,
holding this rank's local piece.

The local tensor is the autograd node: ``from_local`` and ``to_local`` are identities
on it, and ``redistribute`` is one differentiable function (see ``redistribute.py``),
so gradients flow on both frameworks through the platform's custom functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec, local_shape, normalize_placements
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard
from hyper_parallel.core.dtensor.redistribute import redistribute_local, to_local_with_grad_placements
from hyper_parallel.platform import get_platform


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class DTensor:
    """A distributed tensor. Build one with ``DTensor.from_local`` or
    ``distribute_tensor``; the constructor is internal."""

    __slots__ = ("_local", "_spec")

    def __init__(self, local: Any, spec: DTensorSpec) -> None:
        self._local: Any = local  # this rank's piece, shape spec.local_shape()
        self._spec: DTensorSpec = spec

    # -- construction ------------------------------------------------------------------
    @staticmethod
    def from_local(local: Any, device_mesh: DeviceMesh, placements: Sequence[Placement], *,
                   shape: Sequence[int] | None = None, stride: Sequence[int] | None = None) -> DTensor:
        """Wrap this rank's ``local`` piece (no communication; differentiable: the
        gradient of the DTensor's local tensor flows to ``local`` unchanged).

        Args:
            local: this rank's tensor, any shape and dtype.
            device_mesh: the mesh the DTensor lives on.
            placements: one ``Shard``/``Replicate``/``Partial`` per mesh axis.
            shape: the global shape. Needed for uneven shards; without it every
                ``Shard(d)`` is taken to be even (global size = local size x axis size).
            stride: the global stride; only the contiguous stride of ``shape`` is supported.

        Raises:
            TypeError: ``local`` is not a framework tensor, or a placement is not a Placement.
            ValueError: placements do not fit the mesh or the tensor, ``local``'s shape
                is not this rank's piece of ``shape``, or a non-contiguous ``stride``.
        """
        p = get_platform()
        if not p.is_tensor(local):
            raise TypeError(f"DTensor.from_local: local must be a {p.framework} tensor, got {type(local).__name__}")
        local_dims = tuple(int(s) for s in local.shape)
        placements = normalize_placements(placements, device_mesh, len(local_dims), what="DTensor.from_local")
        if shape is None:
            global_shape = list(local_dims)
            for axis, placement in enumerate(placements):
                if isinstance(placement, Shard):
                    global_shape[placement.dim] *= device_mesh.shape[axis]
            shape = tuple(global_shape)
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(local_dims):
            raise ValueError(f"DTensor.from_local: shape={shape} has {len(shape)} dims but local has "
                             f"{len(local_dims)} ({local_dims})")
        if stride is not None and tuple(stride) != _contiguous_stride(shape):
            raise ValueError(f"DTensor.from_local: stride={tuple(stride)} is not the contiguous stride "
                             f"{_contiguous_stride(shape)} of shape {shape}; only contiguous layouts are supported")
        spec = DTensorSpec(device_mesh, placements, shape)
        coordinate = device_mesh.get_coordinate()
        if coordinate is not None:
            expected = local_shape(shape, placements, device_mesh.shape, coordinate)
            if expected != local_dims:
                raise ValueError(
                    f"DTensor.from_local: on rank {p.rank()} (mesh coordinate {coordinate}) local has shape "
                    f"{local_dims}, but {list(placements)} of global shape {shape} gives this rank {expected}; "
                    "pass the global shape= of uneven shards, or a local piece of the expected shape"
                )
        return DTensor(local, spec)

    # -- conversions -------------------------------------------------------------------
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> Any:
        """This rank's local tensor (differentiable identity).

        Args:
            grad_placements: how the gradient of the returned local tensor will be laid
                out, when that is not this DTensor's placements. The typical case: a
                replicated input multiplied locally by a sharded weight receives a
                ``Partial()`` gradient, and passing ``[Partial()]`` makes the backward
                all-reduce it into the replicated gradient. ``None``: the gradient has
                this DTensor's placements (``Partial`` read as ``Replicate``).

        Raises:
            ValueError: ``grad_placements`` does not fit the mesh or the tensor.
        """
        if grad_placements is None:
            return self._local
        grad_placements = normalize_placements(grad_placements, self._spec.mesh, len(self._spec.shape),
                                               what="DTensor.to_local")
        return to_local_with_grad_placements(self._local, self._spec, grad_placements)

    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Placement] | None = None) -> DTensor:
        """The same global tensor with new placements on the same mesh; differentiable.

        Per mesh axis: Shard -> Replicate all-gather; Partial -> Replicate all-reduce;
        Partial -> Shard reduce-scatter; Shard(i) -> Shard(j) all-to-all; Replicate ->
        Shard local chunk (no communication); Replicate -> Partial local (no
        communication). See ``redistribute.py`` for the plan and the backward.

        Raises:
            ValueError: another mesh (redistributing across meshes is not supported),
                or placements that do not fit.
        """
        mesh = self._spec.mesh if device_mesh is None else device_mesh
        if mesh != self._spec.mesh:
            raise ValueError(f"DTensor.redistribute: device_mesh {mesh} is not this DTensor's mesh "
                             f"{self._spec.mesh}; redistribution stays on one mesh")
        placements = self._spec.placements if placements is None else placements
        placements = normalize_placements(placements, mesh, len(self._spec.shape), what="DTensor.redistribute")
        local = redistribute_local(self._local, self._spec, placements)
        return DTensor(local, DTensorSpec(mesh, placements, self._spec.shape))

    def full_tensor(self) -> Any:
        """The whole global tensor on every rank (redistribute to all-Replicate, then
        ``to_local``); differentiable."""
        return self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim).to_local()

    # -- metadata ----------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def spec(self) -> DTensorSpec:
        return self._spec

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""
        return self._spec.shape

    @property
    def ndim(self) -> int:
        return len(self._spec.shape)

    @property
    def dtype(self) -> Any:
        return self._local.dtype

    # -- ops (sharding propagation: see op_rules.py; the functions live in functional.py) --
    def __add__(self, other: Any) -> DTensor:
        return _functional().add(self, other)

    def __radd__(self, other: Any) -> DTensor:
        return _functional().add(other, self)

    def __sub__(self, other: Any) -> DTensor:
        return _functional().sub(self, other)

    def __rsub__(self, other: Any) -> DTensor:
        return _functional().sub(other, self)

    def __mul__(self, other: Any) -> DTensor:
        return _functional().mul(self, other)

    def __rmul__(self, other: Any) -> DTensor:
        return _functional().mul(other, self)

    def __truediv__(self, other: Any) -> DTensor:
        return _functional().div(self, other)

    def __rtruediv__(self, other: Any) -> DTensor:
        return _functional().div(other, self)

    def __neg__(self) -> DTensor:
        return _functional().neg(self)

    def __pow__(self, exponent: float) -> DTensor:
        return _functional().pow(self, exponent)

    def __matmul__(self, other: Any) -> DTensor:
        return _functional().matmul(self, other)

    def sum(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> DTensor:
        """See ``functional.sum``."""
        return _functional().sum(self, dim, keepdim)

    def mean(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> DTensor:
        """See ``functional.mean``."""
        return _functional().mean(self, dim, keepdim)

    def amax(self, dim: int | Sequence[int], keepdim: bool = False) -> DTensor:
        """See ``functional.amax``."""
        return _functional().amax(self, dim, keepdim)

    def exp(self) -> DTensor:
        return _functional().exp(self)

    def log(self) -> DTensor:
        return _functional().log(self)

    def float(self) -> DTensor:
        """float32 (see ``functional.to_float``)."""
        return _functional().to_float(self)

    def reshape(self, *shape: int) -> DTensor:
        """See ``functional.reshape``."""
        return _functional().reshape(self, *shape)

    def view(self, *shape: int) -> DTensor:
        """See ``functional.view``."""
        return _functional().view(self, *shape)

    def transpose(self, dim0: int, dim1: int) -> DTensor:
        """See ``functional.transpose``."""
        return _functional().transpose(self, dim0, dim1)

    def permute(self, *dims: int) -> DTensor:
        """See ``functional.permute``."""
        return _functional().permute(self, *dims)

    def __repr__(self) -> str:
        return (f"DTensor(shape={self.shape}, placements={list(self.placements)}, mesh={self.device_mesh}, "
                f"local_shape={tuple(self._local.shape)})")


def _functional() -> Any:
    # functional.py builds on this module (dispatch wraps results in DTensors), so the
    # operators import it on use rather than at import time.
    from hyper_parallel.core.dtensor import functional

    return functional


def distribute_tensor(tensor: Any, device_mesh: DeviceMesh, placements: Sequence[Placement], *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Split a full ``tensor`` into a DTensor with ``placements``.

    With ``src_data_rank=0`` the tensor of the rank at mesh coordinate ``(0, ..., 0)`` is
    **broadcast** along every axis first, so ranks whose copies differ still agree;
    ``None`` trusts every rank to pass the same values (no communication for
    Shard/Replicate). The result is detached from ``tensor``'s autograd graph (a new
    leaf, as torch's ``distribute_tensor`` makes).

    Raises:
        ValueError: ``src_data_rank`` other than 0 or None, or placements that do not fit.
    """
    p = get_platform()
    if src_data_rank not in (0, None):
        raise ValueError(f"distribute_tensor: src_data_rank={src_data_rank!r}; use 0 (broadcast from mesh "
                         "coordinate 0) or None (every rank passes the same tensor)")
    placements = normalize_placements(placements, device_mesh, tensor.ndim, what="distribute_tensor")
    local = p.detach(tensor)
    if src_data_rank == 0 and device_mesh.get_coordinate() is not None:
        for axis in range(device_mesh.ndim):
            if device_mesh.shape[axis] > 1:
                local = p.broadcast(local, 0, group=device_mesh.get_group(axis)).wait()
    shape = tuple(int(s) for s in tensor.shape)
    replicated = DTensor(local, DTensorSpec(device_mesh, (Replicate(),) * device_mesh.ndim, shape))
    with p.no_grad():
        return replicated.redistribute(placements=placements)
