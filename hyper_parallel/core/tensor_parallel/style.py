"""Tensor-parallel styles: Megatron-style column/row parallel linear layers, sequence
parallel and input preparation, each applied to one module over a 1-D mesh.

[Note: parameters are DTensors, forwards compute on local tensors]
A style replaces each parameter it places by a framework parameter made from a DTensor
(``Parameter(distribute_tensor(w, mesh, [placement]))``, as torch's styles do): global
shape, the mesh and placements, this rank's piece as its local tensor. So the
framework's tools that read parameters see the whole tensor: ``state_dict`` holds
DTensors, ``clip_grad_norm_`` reduces the norm over the mesh, the optimizers step the
pieces through the DTensor rules (or on the local tensors, under
``SkipDTensorDispatch``). ``parameter_placements()`` of each style says the placements.

The module's own forward runs on local tensors: for its duration the style's hooks put
each parameter's differentiable ``to_local()`` in the module's instance ``__dict__``
(which torch's ``Module`` and MindSpore's ``Cell`` read before their registered
parameters; fully_shard substitutes its gathered tensors the same way, and a tensor
already there is left alone), and convert activations at the module's edges with
DTensor redistributions. The gradient of each local tensor becomes the parameter's
DTensor gradient with its placements (a replicated parameter of a sequence-parallel
module: ``Partial``, all-reduced, since each rank saw part of the sequence).

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

from hyper_parallel.core.activation_checkpoint.region import CheckpointPhase, checkpoint_phase, on_recompute_exit
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.distribute_module import distribute_parameter
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.platform import get_platform

#: set (True) on a module by a tensor-parallel style whose forward computes on local
#: tensors (see [Note: a tensor-parallel parameter in a DTensor forward])
LOCAL_FORWARD = "_hyper_parallel_local_forward"

#: Set on a SequenceParallel module: the tp group its replicated parameters' gradients
#: are all-reduced over (fully_shard, whose gathered tensor the module then computes with,
#: all-reduces the gathered parameter's gradient over it).
SEQUENCE_PARALLEL_ATTR = "_sequence_parallel_group"


def _check_1d(mesh: DeviceMesh, style: str) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"{style}: tensor parallelism takes a 1-D mesh, got a {mesh.ndim}-D mesh {mesh.shape}; "
                         "pass the tensor-parallel submesh, e.g. mesh['tp']")


def _as_dtensor(x: Any, mesh: DeviceMesh, layout: Placement) -> DTensor:
    """An activation as a DTensor: a DTensor passes through, a local tensor is taken to be
    laid out as ``layout`` (evenly, when sharded)."""
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [layout])


def _check_local_input(style: str, module: Any, x: Any, layout: Placement, in_features: int,
                       mesh: DeviceMesh) -> None:
    """Refuse a framework-tensor input whose last dim does not hold what ``layout`` says
    (a plan that swapped ColwiseParallel and RowwiseParallel, or put two of one kind in a
    row), naming the style, what it expects and the fix; a local check on every rank,
    before any collective.

    Raises:
        ValueError: the input's last dim is not ``in_features`` (``Replicate``) or this
            rank's share of it (``Shard(-1)``).
    """
    n = mesh.size(0)
    got = int(x.shape[-1]) if len(x.shape) else 0
    sharded = layout.is_shard() and layout.dim in (-1, len(x.shape) - 1)
    want = -(-in_features // n) if sharded else in_features
    coordinate = mesh.get_coordinate()
    if sharded and coordinate is not None:
        index, size = coordinate[0], -(-in_features // n)
        want = max(0, min(size, in_features - index * size))
    if got == want:
        return
    name = type(module).__name__
    if sharded:
        raise ValueError(
            f"{style} on {name} (in_features={in_features}): expects its input sharded on the last dim "
            f"(input_layouts=Shard(-1): {want} of {in_features} features on this rank of {n}), as a ColwiseParallel "
            f"layer before it produces; got {got} features. If the input is whole on every rank, this layer should "
            "be ColwiseParallel and the one after it RowwiseParallel (e.g. {'w1': ColwiseParallel(), "
            "'w2': RowwiseParallel()}), or pass RowwiseParallel(input_layouts=Replicate())")
    raise ValueError(
        f"{style} on {name} (in_features={in_features}): expects its input whole on every rank "
        f"(input_layouts={layout}: {in_features} features), got {got}; the layer before it probably shards its "
        "output on the last dim (ColwiseParallel): make this layer RowwiseParallel (it takes Shard(-1) input), or "
        "give the previous layer output_layouts=Replicate()")


def _own_parameter(module: Any, name: str) -> Any:
    return dict(get_platform().named_parameters(module)).get(name)


def _linear_weight(module: Any, style: str) -> Any:
    """The ``[out, in]`` weight of a linear layer, or a ValueError naming the style."""
    weight = _own_parameter(module, "weight")
    if weight is None or weight.ndim != 2:
        raise ValueError(f"{style}: {type(module).__name__} has no 2-D 'weight' ([out, in]); apply it to a linear layer")
    return weight


def _place_parameter(module: Any, name: str, placement: Placement, mesh: DeviceMesh) -> None:
    """Replace ``module.<name>`` (if it has one) by a DTensor parameter of ``placement``,
    rank 0's values broadcast first so that ranks initialised differently still agree."""
    if _own_parameter(module, name) is not None:
        distribute_parameter(module, name, mesh, [placement])


class _LocalParameters:
    """The hooks that let a module's own forward compute on its DTensor parameters' local
    tensors (see [Note: parameters are DTensors, forwards compute on local tensors]).

    Args:
        mesh: the style's mesh: the parameters placed on it are substituted.
        grad_placements: ``{name: placements}`` of a local tensor's gradient where it is
            not the parameter's placements (``[Partial()]`` for sequence parallel).
    """

    def __init__(self, mesh: DeviceMesh, grad_placements: dict[str, list[Placement]] | None = None) -> None:
        self.mesh = mesh
        self.grad_placements = grad_placements or {}
        self.mine: dict[tuple[int, str], Any] = {}  # (id(module), name) -> the tensor put there

    def put(self, module: Any, _args: Any) -> None:
        for name, param in get_platform().named_parameters(module):
            # only the parameters this style placed: once fully_shard manages one, it is a
            # DTensor on the joint (tp, dp) mesh and the unit substitutes the gathered tensor
            if "." in name or not isinstance(param, DTensor) or param.device_mesh != self.mesh:
                continue
            key, there = (id(module), name), vars(module).get(name)
            # a tensor another hook put there (fully_shard's gathered one) is left alone;
            # one of ours left behind by a forward that raised is replaced
            if there is not None and there is not self.mine.get(key):
                continue
            local = param.to_local(grad_placements=self.grad_placements.get(name))
            vars(module)[name] = self.mine[key] = local
            if checkpoint_phase() is CheckpointPhase.RECOMPUTE:
                # a recomputation stopped early skips ``remove``: take it away at its end
                on_recompute_exit(lambda module=module: self.remove(module, None, None))

    def remove(self, module: Any, _args: Any, _out: Any) -> None:
        for (owner, name), local in list(self.mine.items()):
            if owner == id(module):
                if vars(module).get(name) is local:
                    del vars(module)[name]
                del self.mine[(owner, name)]

    def register_pre(self, module: Any) -> None:
        """Before the style's input hook: the substitution is in place for all of it.
        Marks the module: fully_shard substitutes its gathered tensor-parallel pieces as
        local tensors (see [Note: a tensor-parallel parameter in a DTensor forward])."""
        setattr(module, LOCAL_FORWARD, True)
        get_platform().register_forward_pre_hook(module, self.put)

    def register_post(self, module: Any) -> None:
        """After the style's output hook, which may still read a parameter."""
        get_platform().register_forward_hook(module, self.remove)


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
        out_features, in_features = int(weight.shape[0]), int(weight.shape[1])
        for name in ("weight", "bias"):
            _place_parameter(module, name, Shard(0), device_mesh)
        mesh, in_layout, out_layout = device_mesh, self.input_layout, self.output_layout
        local = _LocalParameters(mesh)
        local.register_pre(module)

        def prepare_input(_module: Any, args: tuple) -> tuple:
            if not isinstance(args[0], DTensor):
                _check_local_input("ColwiseParallel", _module, args[0], in_layout, in_features, mesh)
            x = _as_dtensor(args[0], mesh, in_layout).redistribute(mesh, [Replicate()])
            # After the local GEMM with a row shard of W, x's gradient is a partial sum.
            return (x.to_local(grad_placements=[Partial()]), *args[1:])

        def prepare_output(_module: Any, _args: tuple, y: Any) -> Any:
            shape = (*tuple(y.shape[:-1]), out_features)
            out = DTensor.from_local(y, mesh, [Shard(y.ndim - 1)], shape=shape).redistribute(mesh, [out_layout])
            return out.to_local() if self.use_local_output else out

        p.register_forward_pre_hook(module, prepare_input)
        p.register_forward_hook(module, prepare_output)
        local.register_post(module)
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
        _place_parameter(module, "weight", Shard(1), device_mesh)
        _place_parameter(module, "bias", Replicate(), device_mesh)
        mesh, in_layout, out_layout = device_mesh, self.input_layout, self.output_layout
        local = _LocalParameters(mesh)
        local.register_pre(module)

        def prepare_input(_module: Any, args: tuple) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):
                _check_local_input("RowwiseParallel", _module, x, in_layout, in_features, mesh)
                shape = (*tuple(x.shape[:-1]), in_features) if in_layout == Shard(-1) else None
                x = DTensor.from_local(x, mesh, [in_layout], shape=shape)
            return (x.redistribute(mesh, [Shard(x.ndim - 1)]).to_local(), *args[1:])

        def prepare_output(_module: Any, _args: tuple, y: Any) -> Any:
            # The tensor the module computed with (its local tensor, or the gathered one
            # of a fully_shard unit around this module), not the registered parameter.
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
        local.register_post(module)
        return module


class SequenceParallel(ParallelStyle):
    """Run a module (a norm, a dropout) on this rank's slice of the sequence dim.

    Parameters become ``Replicate()`` DTensors; because each rank sees only part of the
    sequence, the gradient of each local tensor the forward reads is a partial sum, which
    is **all-reduced** over the mesh into the parameter's gradient. Inputs arrive as local
    sequence shards (or DTensors, redistributed to ``Shard(sequence_dim)``).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = True) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        _check_1d(device_mesh, "SequenceParallel")
        p = get_platform()
        mesh, seq = device_mesh, self.sequence_dim
        names = [name for name, _ in p.named_parameters(module) if "." not in name]
        for name in names:
            _place_parameter(module, name, Replicate(), mesh)
        # fully_shard, whose gathered tensor the forward then reads, all-reduces over it
        vars(module)[SEQUENCE_PARALLEL_ATTR] = mesh.get_group()
        local = _LocalParameters(mesh, {name: [Partial()] for name in names})
        local.register_pre(module)

        def prepare_input(_module: Any, args: tuple) -> tuple:
            x = args[0]
            if isinstance(x, DTensor):
                x = x.redistribute(mesh, [Shard(seq % x.ndim)]).to_local()
            return (x, *args[1:])

        def prepare_output(_module: Any, _args: tuple, y: Any) -> Any:
            return y if self.use_local_output else DTensor.from_local(y, mesh, [Shard(seq % y.ndim)])

        p.register_forward_pre_hook(module, prepare_input)
        p.register_forward_hook(module, prepare_output)
        local.register_post(module)
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
