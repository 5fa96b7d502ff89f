"""``shard_module``: lay a module's parameters, inputs and outputs out on a device mesh
as a ``ShardingPlan`` says (the entry point MindFormers imports).

Unlike the tensor-parallel styles (``core/tensor_parallel/style.py``), which run a
module's own forward on local tensors, a sharded module's forward computes on its
DTensor parameters: every framework op it calls (``mint.matmul``, ``F.linear``) is
intercepted by the DTensor class and runs under the sharding rules (``op_rules.py``),
which redistribute operands as needed. The plan only fixes where parameters live and
where activations are redistributed at module edges.

Order of work (every rank runs the same steps): (1) every entry of the plan is checked
against the module and the mesh, raising before any collective; (2) the named
parameters are distributed (one broadcast per mesh axis each, see
``distribute_parameter``), in the module's parameter order; (3) forward hooks are
registered: ``input_plan`` pre-hooks, then ``output_plan`` hooks, then
``return_local_tensor`` hooks (so a module named in both redistributes, then converts).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.distribute_module import distribute_parameter
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement
from hyper_parallel.core.shard.sharding_plan import (INPUT, OUTPUT, LayoutSpec, ShardingPlan, parse_tensor_specs,
                                                     split_key)
from hyper_parallel.platform import get_platform

#: How many names an error lists before it shows the nearest ones only.
_LISTED_NAMES = 24


def _names_hint(name: str, names: Sequence[str], what: str) -> str:
    """The module's ``what`` for an error message: all of them when few, else the nearest."""
    if len(names) <= _LISTED_NAMES:
        return f"its {what}: {list(names)}"
    nearest = difflib.get_close_matches(name, names, n=5, cutoff=0.3)
    return f"the nearest of its {len(names)} {what}: {nearest}"


class _RedistributeInputs:
    """Forward pre-hook: the DTensor positional inputs to their ``input_plan`` placements.

    Collectives: one redistribution per DTensor input whose placements differ (see
    ``DTensor.redistribute``: all-gather, all-reduce, reduce-scatter, all-to-all, or none
    for Replicate -> Shard). All inputs are checked before the first one moves.
    """

    def __init__(self, mesh: DeviceMesh, specs: tuple[LayoutSpec | None, ...], where: str) -> None:
        self.mesh = mesh
        self.specs = specs
        self.where = where  # "input_plan['fc1.input']", for errors

    def __call__(self, _module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return redistribute_all(args, self.specs, self.mesh, self.where, "positional input")


class _RedistributeOutputs:
    """Forward hook: the DTensor outputs to their ``output_plan`` placements (a single
    output takes a one-spec plan; a tuple/list output one spec per element)."""

    def __init__(self, mesh: DeviceMesh, specs: tuple[LayoutSpec | None, ...], where: str) -> None:
        self.mesh = mesh
        self.specs = specs
        self.where = where

    def __call__(self, _module: Any, _args: Any, output: Any) -> Any:
        if isinstance(output, (tuple, list)):
            if len(output) != len(self.specs):
                raise ValueError(f"shard_module: {self.where} gives {len(self.specs)} placement specs but the forward "
                                 f"returned {len(output)} outputs; give one per output (None leaves one as it is)")
            moved = redistribute_all(tuple(output), self.specs, self.mesh, self.where, "output")
            return moved if isinstance(output, tuple) else list(moved)
        if len(self.specs) != 1:
            raise ValueError(f"shard_module: {self.where} gives {len(self.specs)} placement specs but the forward "
                             "returned one output; give one spec")
        return redistribute_all((output,), self.specs, self.mesh, self.where, "output")[0]


def redistribute_all(values: tuple[Any, ...], specs: tuple[LayoutSpec | None, ...], mesh: DeviceMesh, where: str,
                     kind: str) -> tuple[Any, ...]:
    """``values`` with each DTensor redistributed to its spec's placements; every value is
    checked first, so a bad one raises on every rank before any collective.

    Raises:
        ValueError: a DTensor without a spec, on another mesh, or whose spec does not fit it.
    """
    targets: list[tuple[int, tuple[Placement, ...]]] = []
    for index, value in enumerate(values):
        if not isinstance(value, DTensor):
            continue
        if index >= len(specs):
            raise ValueError(f"shard_module: {kind} {index} is a DTensor but {where} gives only {len(specs)} "
                             f"placement specs; give one per {kind} (None leaves one as it is)")
        spec = specs[index]
        if spec is None:
            continue
        if value.device_mesh != mesh:
            raise ValueError(f"shard_module: {kind} {index} of {where} is a DTensor on {value.device_mesh}, not on "
                             f"the mesh {mesh} the module was sharded over; redistribution stays on one mesh")
        targets.append((index, spec.resolve(mesh, value.ndim, f"shard_module: {where}[{index}]")))
    out = list(values)
    for index, placements in targets:
        if tuple(out[index].placements) != tuple(placements):
            out[index] = out[index].redistribute(mesh, placements)
    return tuple(out)


def _to_local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, (tuple, list)):
        items = [_to_local(item) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _return_local(_module: Any, _args: Any, output: Any) -> Any:
    """Forward hook: DTensor outputs (nested in tuples/lists too) as their local tensors
    (``to_local()``: no communication; the gradient of a local tensor is that DTensor's
    gradient with its placements)."""
    return _to_local(output)


def _is_plain_callable(model: Any) -> bool:
    """A function, method or ``functools.partial``: sharded by wrapping, not by hooks."""
    return inspect.isroutine(model) or isinstance(model, functools.partial)


def _check_arguments(device_mesh: Any, sharding_plan: Any) -> None:
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"shard_module: device_mesh is a {type(device_mesh).__name__}, not a DeviceMesh; build one "
                        "with init_device_mesh(device_type, mesh_shape, mesh_dim_names=...)")
    if not isinstance(sharding_plan, ShardingPlan):
        raise TypeError(f"shard_module: sharding_plan is a {type(sharding_plan).__name__}, not a ShardingPlan; "
                        "wrap a parameter dict as ShardingPlan(plan={...})")


def _forward_specs(plan: dict[str, Any] | None, suffix: str, argument: str, mesh: DeviceMesh,
                   modules: dict[str, Any]) -> list[tuple[Any, tuple[LayoutSpec | None, ...], str]]:
    """``(submodule, specs, where)`` for each entry of an input/output plan, checked.

    Raises:
        KeyError: a path that names no submodule.
        ValueError: a spec that does not fit the mesh.
    """
    out = []
    for key, value in (plan or {}).items():
        path = split_key(key, suffix)
        if path not in modules:
            raise KeyError(f"shard_module: {argument} key {key!r} names no submodule {path!r}; "
                           f"{_names_hint(path, [name for name in modules if name], 'submodule paths')} "
                           f"('{suffix}' alone is the module itself)")
        where = f"{argument}[{key!r}]"
        specs = parse_tensor_specs(value, f"shard_module: {where}")
        for index, spec in enumerate(specs):
            if spec is not None:
                spec.check_mesh(mesh, f"shard_module: {where}" + ("" if len(specs) == 1 else f"[{index}]"))
        out.append((modules[path], specs, where))
    return out


def _parameter_placements(plan: dict[str, Any] | None, params: dict[str, Any],
                          mesh: DeviceMesh) -> dict[str, tuple[Placement, ...]]:
    """``{name: placements}`` of the planned parameters, in the module's parameter order.

    Raises:
        KeyError: a name that is not a parameter of the module.
        ValueError: a spec that does not fit the mesh or the parameter, a Partial
            placement, or a parameter that is a DTensor already.
    """
    plan = plan or {}
    for name in plan:
        if name not in params:
            raise KeyError(f"shard_module: plan names parameter {name!r}, which the module does not have; "
                           f"{_names_hint(name, list(params), 'parameter names')} (names are relative to the module "
                           "passed to shard_module)")
    out: dict[str, tuple[Placement, ...]] = {}
    for name, param in params.items():
        if name not in plan:
            continue
        where = f"shard_module: plan[{name!r}]"
        if isinstance(param, DTensor):
            raise ValueError(f"{where}: parameter {name!r} is already a DTensor ({list(param.placements)} on "
                             f"{param.device_mesh}); shard_module places each parameter once; leave it out of the "
                             "plan, or shard a fresh module")
        spec = LayoutSpec.parse(plan[name], where)
        spec.check_mesh(mesh, where, allow_partial=False)
        out[name] = spec.resolve(mesh, int(param.ndim), where)
    return out


def _shard_callable(func: Callable[..., Any], mesh: DeviceMesh, sharding_plan: ShardingPlan) -> Callable[..., Any]:
    """``func`` wrapped: positional DTensor arguments redistributed to
    ``input_plan["input"]``, DTensor results to ``output_plan["output"]``, then turned
    into local tensors if ``return_local_tensor`` holds ``""``. Keyword arguments pass
    unchanged.

    Raises:
        ValueError: a ``plan`` (a function has no parameters), another key than
            ``"input"`` / ``"output"``, another path than ``""`` in ``return_local_tensor``.
    """
    name = getattr(func, "__qualname__", type(func).__name__)
    if sharding_plan.plan:
        raise ValueError(f"shard_module: {name} is a function, which has no parameters, but plan names "
                         f"{sorted(sharding_plan.plan)}; shard the module that owns them")
    for argument, plan, key in (("input_plan", sharding_plan.input_plan, INPUT),
                                ("output_plan", sharding_plan.output_plan, OUTPUT)):
        for given in plan or {}:
            if given != key:
                raise ValueError(f"shard_module: {name} is a function: its {argument} takes the key {key!r} only, "
                                 f"got {given!r}")
    for path in sharding_plan.return_local_tensor or []:
        if path != "":
            raise ValueError(f"shard_module: {name} is a function: return_local_tensor takes '' (its result) only, "
                             f"got {path!r}")
    modules = {"": func}
    inputs = _forward_specs(sharding_plan.input_plan, INPUT, "input_plan", mesh, modules)
    outputs = _forward_specs(sharding_plan.output_plan, OUTPUT, "output_plan", mesh, modules)
    pre = _RedistributeInputs(mesh, inputs[0][1], inputs[0][2]) if inputs else None
    post = _RedistributeOutputs(mesh, outputs[0][1], outputs[0][2]) if outputs else None
    local = bool(sharding_plan.return_local_tensor)

    @functools.wraps(func)
    def sharded(*args: Any, **kwargs: Any) -> Any:
        if pre is not None:
            args = pre(func, args)
        out = func(*args, **kwargs)
        if post is not None:
            out = post(func, args, out)
        return _to_local(out) if local else out

    return sharded


def shard_module(model: Any, device_mesh: DeviceMesh, sharding_plan: ShardingPlan) -> Any:
    """Lay ``model`` out on ``device_mesh`` as ``sharding_plan`` says; returns ``model``
    (a torch ``nn.Module`` / MindSpore ``Cell``, changed in place), or, for a plain
    function, a wrapper of it.

    Parameters: each one named in ``sharding_plan.plan`` is replaced by a framework
    parameter made from a DTensor of the given placements: global shape, this rank's
    piece (chunk semantics, uneven sizes allowed) as its local tensor. **Collective**:
    the values of mesh coordinate 0 are broadcast along every mesh axis first
    (``distribute_parameter``), so ranks initialised differently agree; every rank of
    the mesh must call ``shard_module`` with the same plan. Parameters not named stay as
    they are. The module's forward then computes on the DTensor parameters through the
    DTensor op rules (see the module docstring); its gradients are the parameters'
    DTensor gradients (torch: DTensor ``.grad`` of the same placements; MindSpore's
    ``value_and_grad``/``grad``: each rank's local piece).

    Activations: ``input_plan`` / ``output_plan`` register forward pre-hooks / hooks on
    the named submodules that **redistribute** DTensor inputs / outputs to the given
    placements (all-gather, all-reduce, reduce-scatter or all-to-all per mesh axis, as
    ``DTensor.redistribute`` maps them; differentiable, the backward runs the reverse).
    Inputs that are not DTensors pass unchanged. ``return_local_tensor`` registers a
    forward hook that returns the local tensors of a submodule's DTensor outputs.

    A function (not a module) is wrapped instead: its ``input_plan["input"]`` /
    ``output_plan["output"]`` apply to its positional arguments / results.

    Args:
        model: the module (or function) to shard.
        device_mesh: the mesh; alias specs need its ``mesh_dim_names``.
        sharding_plan: see ``ShardingPlan``.

    Returns:
        ``model`` (a module), or the wrapper (a function).

    Raises (all on every rank, before any collective):
        TypeError: ``device_mesh`` is not a DeviceMesh; ``sharding_plan`` is not a
            ShardingPlan (a dict is not taken); ``model`` is neither a module nor callable.
        KeyError: ``plan`` names a parameter the module does not have (the message
            lists its parameter names); ``input_plan``/``output_plan``/
            ``return_local_tensor`` name a submodule path it does not have.
        ValueError: a spec that does not fit: not one placement per mesh axis, an alias
            that is not a mesh axis name, an axis used twice, alias entries that are not
            one per tensor dim, a ``Shard`` dim out of range, a ``Partial`` parameter, a
            parameter that is already a DTensor; for a function, a ``plan`` or keys other
            than ``"input"``/``"output"``. At forward time (in the hooks, again before
            their collectives): a DTensor input or output without a spec, on another
            mesh, or of another ndim than its alias spec.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = ShardingPlan(plan={"fc1.weight": ("tp", "None"), "fc2.weight": ("None", "tp")},
                            input_plan={"input": ("dp", "None")},
                            output_plan={"output": ("dp", "None")},
                            return_local_tensor=[""])
        shard_module(model, mesh, plan)
        y_local = model(DTensor.from_local(x, mesh, (Replicate(), Replicate())))
    """
    _check_arguments(device_mesh, sharding_plan)
    if _is_plain_callable(model):
        return _shard_callable(model, device_mesh, sharding_plan)
    p = get_platform()
    try:
        modules = dict(p.named_modules(model))
    except AttributeError:
        if callable(model):  # a callable object that is not a module
            return _shard_callable(model, device_mesh, sharding_plan)
        raise TypeError(f"shard_module: model is a {type(model).__name__}, neither a {p.framework} module nor a "
                        "function; pass the model (or a callable)") from None
    params = dict(p.named_parameters(model))

    # (1) every check, before any collective
    placements = _parameter_placements(sharding_plan.plan, params, device_mesh)
    inputs = _forward_specs(sharding_plan.input_plan, INPUT, "input_plan", device_mesh, modules)
    outputs = _forward_specs(sharding_plan.output_plan, OUTPUT, "output_plan", device_mesh, modules)
    local_paths = sharding_plan.return_local_tensor or []
    for path in local_paths:
        if path not in modules:
            raise KeyError(f"shard_module: return_local_tensor names no submodule {path!r}; "
                           f"{_names_hint(path, [name for name in modules if name], 'submodule paths')} "
                           "('' is the module itself)")

    # (2) the parameters: one broadcast per mesh axis each, in the module's parameter order
    for name, parameter_placements in placements.items():
        distribute_parameter(model, name, device_mesh, parameter_placements)

    # (3) the hooks; on one module the output redistribution runs before to_local
    for module, specs, where in inputs:
        p.register_forward_pre_hook(module, _RedistributeInputs(device_mesh, specs, where))
    for module, specs, where in outputs:
        p.register_forward_hook(module, _RedistributeOutputs(device_mesh, specs, where))
    for path in dict.fromkeys(local_paths):
        p.register_forward_hook(modules[path], _return_local)
    return model
