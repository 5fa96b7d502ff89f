"""``DTensor``: a global tensor described by a mesh, placements and a global shape,
holding this rank's local piece.

[Note: DTensor classes]
Core defines one ``DTensor`` class. A backend whose framework lets a tensor subclass
intercept its ops (``Platform.dtensor_type``) builds from it the class DTensors really
have: a subclass of both the framework's tensor and this class, whose framework ops are
routed to the sharding rules (torch: a wrapper subclass with ``__torch_dispatch__``;
MindSpore: a ``Tensor._make_subclass`` of the local tensor with ``__fallback__``).
Every DTensor is made through ``make_dtensor``, so ``isinstance(x, DTensor)`` holds on
every backend.

Autograd sits where the framework puts it. With a wrapper subclass (torch: the class
sets ``wrapper_autograd = True``), autograd records ops on the DTensors themselves (the
intercepted ops run below it on the local tensors), so ``from_local`` / ``to_local`` are
custom functions between the two levels (``_FromLocal`` / ``_ToLocal``, as torch's
DTensor has). Otherwise (core's class; MindSpore's subclass, which is its local tensor
under another Python type and shares its autograd identity) the local tensor is the
autograd node and ``from_local`` / ``to_local`` are identities on it; intercepted ops
then run above autograd through ``dispatch.dispatch``. ``redistribute`` is one
differentiable function on the local tensor (see ``redistribute.py``) in both cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec, local_shape, normalize_placements
from hyper_parallel.core.dtensor.layout import Layout
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard
from hyper_parallel.core.dtensor.redistribute import (
    gradient_placements,
    grad_to_layout,
    redistribute_local,
    redistribute_raw,
    to_local_with_grad_placements,
)
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import CustomFunction
from hyper_parallel.core.tensor_ops import clone


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class DTensor:
    """A distributed tensor. Build one with ``DTensor.from_local`` or
    ``distribute_tensor``; the constructor is internal (see ``make_dtensor``).

    On both backends a DTensor is also a framework tensor: ``torch.nn.Parameter(dt)``,
    ``torch.nn.functional.linear(x_dt, w_dt)``, ``mindspore.Parameter(dt)``,
    ``mint.nn.functional.linear``, the frameworks' optimizers and torch's
    ``clip_grad_norm_`` run on it through the sharding rules (see ``docs/dtensor.md``).
    The framework's own attributes (``shape``, ``dtype``, operators, methods) then take
    precedence over the ones below, with the same meaning.
    """

    def __init__(self, local: Any, spec: DTensorSpec) -> None:
        self._local: Any = local  # this rank's piece, shape spec.local_shape()
        self._spec: DTensorSpec = spec

    # -- construction ------------------------------------------------------------------
    @staticmethod
    def from_local(local: Any, device_mesh: DeviceMesh, placements: Sequence[Placement], *,
                   shape: Sequence[int] | None = None, stride: Sequence[int] | None = None,
                   run_check: bool = False) -> DTensor:
        """Wrap this rank's ``local`` piece (no communication; differentiable: the
        gradient of the DTensor flows to ``local`` as this rank's piece of it, laid out
        as ``placements`` with ``Partial`` read as ``Replicate``).

        Args:
            local: this rank's tensor, any shape and dtype.
            device_mesh: the mesh the DTensor lives on.
            placements: one ``Shard``/``Replicate``/``Partial`` per mesh axis.
            shape: the global shape. Needed for uneven shards; without it every
                ``Shard(d)`` is taken to be even (global size = local size x axis size).
            stride: the global stride; only the contiguous stride of ``shape`` is supported.
            run_check: accepted for torch's signature; the shape check below always runs
                (it needs no communication) and values are never compared across ranks.

        Raises:
            TypeError: ``local`` is not a framework tensor, or a placement is not a Placement.
            ValueError: placements do not fit the mesh or the tensor, ``local``'s shape
                is not this rank's piece of ``shape``, or a non-contiguous ``stride``.
        """
        p = get_platform()
        if isinstance(local, DTensor) or not p.is_tensor(local):
            raise TypeError(f"DTensor.from_local: local must be a {p.framework} tensor (not a DTensor), got "
                            f"{type(local).__name__}")
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
        return wrap_local(local, spec)

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
        if grad_placements is not None:
            grad_placements = normalize_placements(grad_placements, self._spec.mesh, len(self._spec.shape),
                                                   what="DTensor.to_local")
        if _intercepts(type(self)):
            grad = gradient_placements(self._spec.placements) if grad_placements is None else grad_placements
            return get_platform().apply_function(_ToLocal, self, tuple(grad))
        if grad_placements is None:
            return self._local
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
        spec = DTensorSpec(mesh, placements, self._spec.shape)
        if _intercepts(type(self)):
            return wrap_local(redistribute_local(self.to_local(), self._spec, placements), spec)
        return make_dtensor(redistribute_local(self._local, self._spec, placements), spec)

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
    def layout(self) -> Layout:
        """The sharding in MindSpore's terms (device matrix, tensor map, rank list; see
        ``layout.py``), built from the spec on each read. On torch the tensor's own
        ``layout`` (``torch.strided``) takes precedence: read ``Layout.of(dt.device_mesh,
        dt.placements, dt.shape)`` there."""
        return Layout.of(self._spec.mesh, self._spec.placements, self._spec.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """This rank's local shape."""
        return tuple(int(s) for s in self._local.shape)

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

    # -- what a backend's DTensor class calls (see Platform.dtensor_type) ----------------
    @staticmethod
    def entry() -> Any:
        """The one entry from a backend's DTensor class into core's planning: the module
        ``hyper_parallel.core.op_entry`` (see [Note: the backend entry] there). A backend
        hands each intercepted framework op to it and runs the local call it is given."""
        return _entry()

    @staticmethod
    def replicated(local: Any, mesh: DeviceMesh) -> DTensor:
        """``local``, which every rank of ``mesh`` makes whole, as a ``Replicate`` DTensor
        outside autograd."""
        spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(int(s) for s in local.shape))
        return make_dtensor(local, spec)

    def __repr__(self) -> str:
        return (f"DTensor(shape={self.shape}, placements={list(self.placements)}, mesh={self.device_mesh}, "
                f"local_shape={tuple(self._local.shape)})")


def dtensor_class() -> type:
    """The class DTensors have on the current backend (see [Note: DTensor classes])."""
    return get_platform().dtensor_type(DTensor)


def _intercepts(cls: type) -> bool:
    """Whether autograd records ops on ``cls``'s instances themselves (a wrapper
    subclass: torch), rather than on their local tensors (core's class; MindSpore's
    subclass, which shares its local tensor's autograd identity)."""
    return bool(getattr(cls, "wrapper_autograd", False))


def make_dtensor(local: Any, spec: DTensorSpec) -> DTensor:
    """A DTensor of ``local`` and ``spec``, outside autograd (no check, no communication):
    what an op on DTensors returns below autograd, or a wrap whose gradient is handled
    elsewhere."""
    return dtensor_class()(local, spec)


class _FromLocal(CustomFunction):
    """Local tensor -> DTensor. Backward: the DTensor gradient taken to the layout of
    the DTensor's gradient (its placements, ``Partial`` read as ``Replicate``: an
    all-reduce of a ``Partial`` gradient), then its local tensor."""

    @staticmethod
    def forward(ctx: Any, local: Any, spec: DTensorSpec) -> Any:
        ctx.spec = spec
        return make_dtensor(local, spec)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        if not isinstance(grad, DTensor):
            return grad, None
        target = gradient_placements(ctx.spec.placements)
        return redistribute_raw(grad._local, grad.spec, target), None


class _ToLocal(CustomFunction):
    """DTensor -> its local tensor (a new view of it, so the DTensor's own local tensor
    never becomes an autograd output). Backward: the local gradient, laid out as
    ``grad_placements``, taken to the DTensor's gradient layout and wrapped."""

    @staticmethod
    def forward(ctx: Any, dt: Any, grad_placements: tuple[Placement, ...]) -> Any:
        ctx.spec, ctx.grad_placements = dt.spec, grad_placements
        local = dt._local
        return local.view(tuple(local.shape))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        spec = ctx.spec
        local = grad_to_layout(grad, spec, ctx.grad_placements)
        return make_dtensor(local, DTensorSpec(spec.mesh, gradient_placements(spec.placements), spec.shape)), None


def wrap_local(local: Any, spec: DTensorSpec) -> DTensor:
    """``local`` as a DTensor of ``spec``, differentiable (see ``_FromLocal``)."""
    cls = dtensor_class()
    if not _intercepts(cls):
        return cls(local, spec)
    return get_platform().apply_function(_FromLocal, local, spec)


def _entry() -> Any:
    # [Note: the backend entry] in core/op_entry.py: the one import back up from this
    # module, made at call time (op_entry plans with dispatch.py, which builds on this
    # module); the import-linter contract lists it as the one allowed exception.
    from hyper_parallel.core import op_entry

    return op_entry


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
    replicated = DTensorSpec(device_mesh, (Replicate(),) * device_mesh.ndim, shape)
    with p.no_grad():
        # a copy of its own, not a view of ``tensor``: the result is a new leaf that
        # optimizers update in place (MindSpore's Assign refuses a view)
        piece = clone(redistribute_local(local, replicated, placements))
        return make_dtensor(piece, DTensorSpec(device_mesh, placements, shape))
