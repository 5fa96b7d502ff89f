"""Tensor-parallel styles: Megatron-style column/row parallel linear layers, sequence
parallel and input preparation, each applied to one module over a 1-D mesh.

[Note: parameters hold the local shard]
A sharded parameter stays a framework parameter whose data is this rank's shard (the
DTensor's local tensor); ``parameter_placements()`` of each style says its placements.
The module computes on local tensors, and the style's hooks convert activations at the
module's edges with DTensor redistributions, so both frameworks run the module's own
forward unchanged and their optimizers step the local shards. For element-wise
optimizers (SGD, Adam, AdamW) that is the unsharded step, shard by shard.

Collectives (mesh of n ranks, ``x``: activations, ``W``: ``[out, in]`` linear weight):
- ColwiseParallel: ``W``/``bias`` ``Shard(0)``; input to Replicate (all-gather when it
  arrives sequence-sharded), its gradient all-reduced (it is Partial after the local
  GEMM); output ``Shard(-1)`` (or redistributed to ``output_layouts``).
- RowwiseParallel: ``W`` ``Shard(1)``, ``bias`` Replicate; input ``Shard(-1)``; the
  output is Partial and is all-reduced (Replicate) or reduce-scattered (``Shard(1)``,
  sequence parallel); the bias is added once, after the reduction.
- SequenceParallel: parameters replicated, activations sharded on the sequence dim; the
  parameters' gradients are all-reduced (each rank saw part of the sequence).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.distribute_module import distribute_parameter
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.platform import get_platform

#: Set on a module whose parameters carry SequenceParallel's gradient hooks: the tp
#: group their gradients are all-reduced over (fully_shard, which replaces the
#: parameter objects, all-reduces the gathered parameter's gradient over it instead).
SEQUENCE_PARALLEL_ATTR = "_sequence_parallel_grad_hooks"
#: Set on a module whose parameters a style sharded: ``{name: (mesh, Shard, global shape)}``
#: (read by fully_shard's state dicts, which rebuild the whole parameter from TP shards).
TP_SHARDS_ATTR = "_tensor_parallel_shards"


def _check_1d(mesh: DeviceMesh, style: str) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"{style}: tensor parallelism takes a 1-D mesh, got a {mesh.ndim}-D mesh {mesh.shape}; "
                         "pass the tensor-parallel submesh, e.g. mesh['tp']")


def _as_dtensor(x: Any, mesh: DeviceMesh, layout: Placement) -> DTensor:
    """An activation as a DTensor: a DTensor passes through, a local tensor is taken to be
    laid out as ``layout`` (evenly, when sharded)."""
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [layout])


def _own_parameter(module: Any, name: str) -> Any:
    return dict(get_platform().named_parameters(module)).get(name)


def _linear_weight(module: Any, style: str) -> Any:
    """The ``[out, in]`` weight of a linear layer, or a ValueError naming the style."""
    weight = _own_parameter(module, "weight")
    if weight is None or weight.ndim != 2:
        raise ValueError(f"{style}: {type(module).__name__} has no 2-D 'weight' ([out, in]); apply it to a linear layer")
    return weight


def _shard_parameter(module: Any, name: str, placement: Shard, mesh: DeviceMesh) -> None:
    """Replace ``module.<name>`` (if it has one) by this rank's ``placement`` shard, rank 0's
    values broadcast first so that ranks initialised differently still agree."""
    own = _own_parameter(module, name)
    if own is not None:
        shape = tuple(int(d) for d in own.shape)
        distribute_parameter(module, name, mesh, [placement])
        vars(module).setdefault(TP_SHARDS_ATTR, {})[name] = (mesh, placement, shape)


class ParallelStyle(ABC):
    """A way to parallelize one module over a 1-D mesh; applied by ``parallelize_module``."""

    @abstractmethod
    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        """Shard ``module``'s parameters and register its hooks; returns ``module``.
        Collective (parameters are broadcast from mesh rank 0).

        Raises:
            ValueError: the mesh is not 1-D, or the module does not fit the style.
        """

    def parameter_placements(self) -> dict[str, Placement]:
        """The placement of each parameter this style shards or replicates, by name."""
        return {}


class ColwiseParallel(ParallelStyle):
    """Shard a linear layer's output features (weight ``[out, in]`` rows, bias).

    Args:
        input_layouts: how the input arrives (``Replicate()``; ``Shard(1)`` after sequence
            parallel, all-gathered here).
        output_layouts: the output's layout (``Shard(-1)``: the local GEMM's result).
        use_local_output: return the local tensor (True) or the DTensor.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layout: Placement = input_layouts or Replicate()
        self.output_layout: Placement = output_layouts or Shard(-1)
        self.use_local_output = use_local_output

    def parameter_placements(self) -> dict[str, Placement]:
        return {"weight": Shard(0), "bias": Shard(0)}

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        _check_1d(device_mesh, "ColwiseParallel")
        p = get_platform()
        weight = _linear_weight(module, "ColwiseParallel")
        out_features = int(weight.shape[0])
        for name in ("weight", "bias"):
            _shard_parameter(module, name, Shard(0), device_mesh)
        mesh, in_layout, out_layout = device_mesh, self.input_layout, self.output_layout

        def prepare_input(_module: Any, args: tuple) -> tuple:
            x = _as_dtensor(args[0], mesh, in_layout).redistribute(mesh, [Replicate()])
            # After the local GEMM with a row shard of W, x's gradient is a partial sum.
            return (x.to_local(grad_placements=[Partial()]), *args[1:])

        def prepare_output(_module: Any, _args: tuple, y: Any) -> Any:
            shape = (*tuple(y.shape[:-1]), out_features)
            out = DTensor.from_local(y, mesh, [Shard(y.ndim - 1)], shape=shape).redistribute(mesh, [out_layout])
            return out.to_local() if self.use_local_output else out

        p.register_forward_pre_hook(module, prepare_input)
        p.register_forward_hook(module, prepare_output)
        return module


class RowwiseParallel(ParallelStyle):
    """Shard a linear layer's input features (weight ``[out, in]`` columns); the partial
    outputs are reduced, and the bias (replicated) is added once after the reduction.

    Args:
        input_layouts: how the input arrives (``Shard(-1)``: a ColwiseParallel output).
        output_layouts: ``Replicate()`` (all-reduce) or ``Shard(1)`` (reduce-scatter on
            the sequence dim, for sequence parallel).
        use_local_output: return the local tensor (True) or the DTensor.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layout: Placement = input_layouts or Shard(-1)
        self.output_layout: Placement = output_layouts or Replicate()
        self.use_local_output = use_local_output

    def parameter_placements(self) -> dict[str, Placement]:
        return {"weight": Shard(1), "bias": Replicate()}

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        _check_1d(device_mesh, "RowwiseParallel")
        p = get_platform()
        weight = _linear_weight(module, "RowwiseParallel")
        in_features = int(weight.shape[1])
        _shard_parameter(module, "weight", Shard(1), device_mesh)
        mesh, in_layout, out_layout = device_mesh, self.input_layout, self.output_layout

        def prepare_input(_module: Any, args: tuple) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):
                shape = (*tuple(x.shape[:-1]), in_features) if in_layout == Shard(-1) else None
                x = DTensor.from_local(x, mesh, [in_layout], shape=shape)
            return (x.redistribute(mesh, [Shard(x.ndim - 1)]).to_local(), *args[1:])

        def prepare_output(_module: Any, _args: tuple, y: Any) -> Any:
            # The tensor the module computed with: a fully_shard unit around this module
            # substitutes the gathered bias for the registered (dp-sharded) parameter.
            bias = getattr(_module, "bias") if _own_parameter(_module, "bias") is not None else None
            partial = y - bias if bias is not None else y  # add the bias once, after the sum
            out = DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [out_layout])
            if bias is not None:
                if out_layout.is_shard():
                    # Each rank adds the bias to its own rows only, so the bias gradient
                    # is a partial sum over the ranks: declare it, to all-reduce it.
                    bias = DTensor.from_local(bias, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
                out = DTensor.from_local(out.to_local() + bias, mesh, out.placements, shape=out.shape)
            return out.to_local() if self.use_local_output else out

        p.register_forward_pre_hook(module, prepare_input)
        p.register_forward_hook(module, prepare_output)
        return module


class SequenceParallel(ParallelStyle):
    """Run a module (a norm, a dropout) on this rank's slice of the sequence dim.

    Parameters stay replicated; because each rank sees only part of the sequence, their
    gradients are all-reduced over the mesh by a gradient hook. Inputs arrive as local
    sequence shards (or DTensors, redistributed to ``Shard(sequence_dim)``).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = True) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        _check_1d(device_mesh, "SequenceParallel")
        p = get_platform()
        mesh, seq = device_mesh, self.sequence_dim
        group = mesh.get_group()
        for _, param in p.named_parameters(module):
            p.register_tensor_hook(param, lambda grad: p.all_reduce(grad, "sum", group=group).wait())
        # The hooks live on these parameter objects: fully_shard, which replaces
        # parameters, reads the group here and does the all-reduce itself.
        vars(module)[SEQUENCE_PARALLEL_ATTR] = group

        def prepare_input(_module: Any, args: tuple) -> tuple:
            x = args[0]
            if isinstance(x, DTensor):
                x = x.redistribute(mesh, [Shard(seq % x.ndim)]).to_local()
            return (x, *args[1:])

        def prepare_output(_module: Any, _args: tuple, y: Any) -> Any:
            return y if self.use_local_output else DTensor.from_local(y, mesh, [Shard(seq % y.ndim)])

        p.register_forward_pre_hook(module, prepare_input)
        p.register_forward_hook(module, prepare_output)
        return module


class PrepareModuleInput(ParallelStyle):
    """Redistribute a module's positional inputs before its forward.

    Args:
        input_layouts: how each positional input arrives (``None`` leaves one untouched).
        desired_input_layouts: the layout the module wants for each.
        use_local_output: pass local tensors (True) or DTensors to the module.
    """

    def __init__(self, *, input_layouts: Sequence[Placement | None], desired_input_layouts: Sequence[Placement | None],
                 use_local_output: bool = True) -> None:
        if len(input_layouts) != len(desired_input_layouts):
            raise ValueError(f"PrepareModuleInput: {len(input_layouts)} input_layouts but "
                             f"{len(desired_input_layouts)} desired_input_layouts; give one of each per input")
        self.input_layouts = tuple(input_layouts)
        self.desired_input_layouts = tuple(desired_input_layouts)
        self.use_local_output = use_local_output

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        _check_1d(device_mesh, "PrepareModuleInput")
        mesh = device_mesh

        def prepare_input(_module: Any, args: tuple) -> tuple:
            out = list(args)
            for i, (have, want) in enumerate(zip(self.input_layouts, self.desired_input_layouts)):
                if have is None or want is None or i >= len(out):
                    continue
                x = _as_dtensor(out[i], mesh, have).redistribute(mesh, [want])
                out[i] = x.to_local() if self.use_local_output else x
            return tuple(out)

        get_platform().register_forward_pre_hook(module, prepare_input)
        return module
