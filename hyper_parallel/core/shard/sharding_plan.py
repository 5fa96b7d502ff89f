"""``ShardingPlan``: which placements a module's parameters, inputs and outputs take
under ``shard_module``, as data (readable and testable without a model or a mesh).

A *placement spec* says how one tensor lies on the mesh, in one of two forms:

- **placements**: one ``Placement`` per mesh axis, ``(Replicate(), Shard(0))`` on a
  ``("dp", "tp")`` mesh (the form of ``distribute_tensor``);
- **alias**: one entry per tensor dim, naming the mesh axes that shard that dim:
  ``("dp", "None")`` is dim 0 sharded over axis ``"dp"``, dim 1 not sharded;
  ``(("dp", "tp"), "None")`` shards dim 0 over both axes, ``dp`` outermost. Each mesh
  axis a spec does not name is ``Replicate()`` (the form MindSpore's layouts use).

Alias specs convert to placements once the mesh and the tensor's ndim are known
(``LayoutSpec.resolve``): mesh axis ``a`` -> ``Shard(d)`` if ``a`` is named at dim
``d``, else ``Replicate()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard

#: The alias entry of a dim that no mesh axis shards (a string, as MindSpore's layouts write it).
NOT_SHARDED = "None"

#: One placement spec: placements per mesh axis, or alias entries per tensor dim.
PlacementSpec = Sequence[Union[Placement, str, Sequence[str]]]

INPUT, OUTPUT = "input", "output"


def _is_axis_group(item: Any) -> bool:
    """A nested alias entry: several axis names sharding one dim."""
    return isinstance(item, (tuple, list)) and len(item) > 0 and all(isinstance(name, str) for name in item)


def is_single_spec(value: Any) -> bool:
    """Whether ``value`` of an ``input_plan`` / ``output_plan`` entry is one placement spec
    (a tuple of Placements, or of alias entries) rather than one spec per positional
    tensor. A list is always one spec per tensor, so several alias specs are written as a
    list: ``[("dp", "None"), ("None", "tp")]``."""
    return isinstance(value, tuple) and len(value) > 0 and all(
        isinstance(item, (Placement, str)) or _is_axis_group(item) for item in value)


@dataclass(frozen=True)
class LayoutSpec:
    """One placement spec, parsed (see the module docstring for the two forms).

    Exactly one field is set: ``placements`` (one per mesh axis) or ``dim_axes`` (per
    tensor dim, the mesh axis names that shard it, outermost first; ``()`` = not sharded).
    """

    placements: tuple[Placement, ...] | None = None
    dim_axes: tuple[tuple[str, ...], ...] | None = None

    @staticmethod
    def parse(value: Any, what: str) -> LayoutSpec:
        """Parse a placement spec given by the user.

        Raises:
            TypeError: ``value`` is not a tuple/list of Placements or of alias entries
                (a bare Placement, a mix of the two forms, another type).
        """
        if isinstance(value, Placement):
            raise TypeError(f"{what}={value!r} is a single Placement; a placement spec is a tuple with one "
                            f"Placement per mesh axis: write ({value!r},)")
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{what}={value!r} is a {type(value).__name__}; give a tuple of Placements (one per mesh "
                            "axis, e.g. (Shard(0), Replicate())) or of mesh axis names (one per tensor dim, "
                            "e.g. ('dp', 'None'))")
        items = tuple(value)
        if items and all(isinstance(item, Placement) for item in items):
            return LayoutSpec(placements=items)
        if any(isinstance(item, Placement) for item in items):
            raise TypeError(f"{what}={value!r} mixes Placements with other entries; use one form for the whole "
                            "spec: Placements, one per mesh axis, or mesh axis names, one per tensor dim")
        dims: list[tuple[str, ...]] = []
        for item in items:
            if isinstance(item, str):
                dims.append(() if item == NOT_SHARDED else (item,))
            elif _is_axis_group(item):
                if NOT_SHARDED in item:
                    raise TypeError(f"{what}={value!r}: the entry {item!r} mixes {NOT_SHARDED!r} with axis names; "
                                    f"a dim is either sharded over the axes listed or {NOT_SHARDED!r}")
                dims.append(tuple(item))
            else:
                raise TypeError(f"{what}={value!r}: entry {item!r} is neither a Placement nor a mesh axis name; "
                                "give Placements, one per mesh axis, or axis names (a str, a tuple of str, or "
                                f"{NOT_SHARDED!r}), one per tensor dim")
        return LayoutSpec(dim_axes=tuple(dims))

    @property
    def is_alias(self) -> bool:
        return self.dim_axes is not None

    def check_mesh(self, mesh: DeviceMesh, what: str, *, allow_partial: bool = True) -> None:
        """What can be checked without the tensor: the spec fits ``mesh``.

        Raises:
            ValueError: placements of the wrong count (or a ``Partial`` where
                ``allow_partial`` is False); an alias that is not an axis name of the mesh,
                an axis named twice, several axes on one dim out of mesh order, or alias
                entries on a mesh without axis names.
        """
        if self.placements is not None:
            if len(self.placements) != mesh.ndim:
                raise ValueError(f"{what}={self.placements!r} has {len(self.placements)} placements but the mesh "
                                 f"{mesh.shape} has {mesh.ndim} axes; give one placement per mesh axis")
            if not allow_partial and any(placement.is_partial() for placement in self.placements):
                raise ValueError(f"{what}={self.placements!r}: a parameter is Shard or Replicate on each axis, "
                                 "never Partial (a pending sum is not a value to train)")
            return
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(f"{what}: alias entries name mesh axes, but the mesh {mesh.shape} has no axis names; "
                             "build it with init_device_mesh(..., mesh_dim_names=(...)) or give Placements")
        seen: set[str] = set()
        for axes in self.dim_axes or ():
            for name in axes:
                if name not in names:
                    raise ValueError(f"{what}: {name!r} is not a mesh axis; the axes are {names} (or "
                                     f"{NOT_SHARDED!r} for a dim that is not sharded)")
                if name in seen:
                    raise ValueError(f"{what}: axis {name!r} is used twice; a mesh axis shards at most one dim, "
                                     "once")
                seen.add(name)
            order = [names.index(name) for name in axes]
            if order != sorted(order):
                raise ValueError(f"{what}: {axes!r} shards one dim over several axes out of mesh order; the outer "
                                 f"axis splits first, so list them as the mesh does: "
                                 f"{tuple(sorted(axes, key=names.index))!r}")

    def resolve(self, mesh: DeviceMesh, ndim: int, what: str) -> tuple[Placement, ...]:
        """The placements (one per mesh axis) of a tensor of ``ndim`` dims; checks
        ``check_mesh`` first.

        Raises:
            ValueError: as ``check_mesh``; an alias spec whose length is not ``ndim``; a
                ``Shard`` dim out of range.
        """
        self.check_mesh(mesh, what)
        if self.placements is not None:
            for placement in self.placements:
                if isinstance(placement, Shard) and not -ndim <= placement.dim < ndim:
                    raise ValueError(f"{what}: {placement} is out of range for a {ndim}-D tensor; shard a dim in "
                                     f"[{-ndim}, {ndim})")
            return self.placements
        dims = self.dim_axes or ()
        if len(dims) != ndim:
            raise ValueError(f"{what} has {len(dims)} alias entries but the tensor has {ndim} dims; give one per dim "
                             f"(axis name, tuple of names, or {NOT_SHARDED!r})")
        names = mesh.mesh_dim_names or ()
        where = {name: dim for dim, axes in enumerate(dims) for name in axes}
        return tuple(Shard(where[name]) if name in where else Replicate() for name in names)


def parse_tensor_specs(value: Any, what: str) -> tuple[LayoutSpec | None, ...]:
    """An ``input_plan`` / ``output_plan`` value as one spec per positional tensor
    (``None``: that tensor is left as it is).

    Raises:
        TypeError: not a spec, nor a list/tuple of specs and ``None``.
    """
    if is_single_spec(value):
        return (LayoutSpec.parse(value, what),)
    if not isinstance(value, (tuple, list)):
        return (LayoutSpec.parse(value, what),)  # raises, naming the accepted forms
    return tuple(None if item is None else LayoutSpec.parse(item, f"{what}[{index}]")
                 for index, item in enumerate(value))


def split_key(key: str, suffix: str) -> str:
    """The submodule path of an ``input_plan`` / ``output_plan`` key (``""``: the root)."""
    return "" if key == suffix else key[:-len(suffix) - 1]


def _check_forward_plan(plan: Any, suffix: str, argument: str) -> dict[str, Any] | None:
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        raise TypeError(f"ShardingPlan: {argument} is a {type(plan).__name__}; give a dict "
                        f"{{'<submodule path>.{suffix}': placements}} ('{suffix}' for the module itself)")
    for key, value in plan.items():
        if not isinstance(key, str) or not (key == suffix or key.endswith(f".{suffix}")):
            raise ValueError(f"ShardingPlan: {argument} key {key!r} must be '<submodule path>.{suffix}' "
                             f"(e.g. 'layers.0.attention.{suffix}'), or '{suffix}' for the module itself")
        path = split_key(key, suffix)
        if key != suffix and any(not part for part in path.split(".")):
            raise ValueError(f"ShardingPlan: {argument} key {key!r} has an empty path component; write "
                             f"'<submodule path>.{suffix}' with the path as named_modules lists it")
        parse_tensor_specs(value, f"ShardingPlan: {argument}[{key!r}]")
    return dict(plan)


@dataclass(frozen=True)
class ShardingPlan:
    """How ``shard_module`` lays out a module (or a function) on a device mesh.

    Attributes:
        plan: parameter name (dotted, relative to the module, as its ``named_parameters``
            / ``parameters_and_names`` lists it) -> placement spec. Each named parameter
            becomes a DTensor parameter of those placements; parameters not named stay
            as they are.
        input_plan: ``"<submodule path>.input"`` (``"input"``: the module itself) ->
            the placements of that module's positional inputs: one spec (one input), or a
            list/tuple with one spec per positional input (``None``: left as it is).
            DTensor inputs are redistributed to them before the forward; other inputs
            pass unchanged (wrap them with ``DTensor.from_local`` to have them placed).
        output_plan: ``"<submodule path>.output"`` (``"output"``) -> the placements of
            the outputs: one spec for a single output, one per element of a tuple/list
            output. DTensor outputs are redistributed after the forward.
        return_local_tensor: submodule paths (``""``: the module itself) whose DTensor
            outputs are returned as their local tensors (``to_local()``), after any
            ``output_plan`` redistribution of the same module.

    Everything that can be checked without the module and mesh is checked here;
    ``shard_module`` checks the rest before any collective.

    Raises:
        TypeError: a field of the wrong type, or a value that is not a placement spec.
        ValueError: an ``input_plan`` key not ending in ``.input`` (``output_plan``:
            ``.output``), or an empty path component.

    Example::

        ShardingPlan(plan={"fc1.weight": (Shard(0),), "fc2.weight": ("None", "tp")},
                     input_plan={"input": (Replicate(),)},
                     output_plan={"output": (Replicate(),)},
                     return_local_tensor=[""])
    """

    plan: dict[str, PlacementSpec] | None = None
    input_plan: dict[str, Any] | None = None  # a spec, or a list/tuple of specs and None
    output_plan: dict[str, Any] | None = None
    return_local_tensor: list[str] | None = None

    def __post_init__(self) -> None:
        # copies: a caller editing its dict afterwards does not bypass these checks
        if self.plan is not None:
            if not isinstance(self.plan, Mapping):
                raise TypeError(f"ShardingPlan: plan is a {type(self.plan).__name__}; give a dict "
                                "{parameter name: placements}")
            for name, value in self.plan.items():
                if not isinstance(name, str) or not name:
                    raise TypeError(f"ShardingPlan: plan key {name!r} is not a parameter name (a non-empty str)")
                LayoutSpec.parse(value, f"ShardingPlan: plan[{name!r}]")
            object.__setattr__(self, "plan", dict(self.plan))
        object.__setattr__(self, "input_plan", _check_forward_plan(self.input_plan, INPUT, "input_plan"))
        object.__setattr__(self, "output_plan", _check_forward_plan(self.output_plan, OUTPUT, "output_plan"))
        if self.return_local_tensor is not None:
            paths = self.return_local_tensor
            if isinstance(paths, str) or not isinstance(paths, (list, tuple)) or \
                    not all(isinstance(path, str) for path in paths):
                raise TypeError(f"ShardingPlan: return_local_tensor={paths!r} must be a list of submodule paths "
                                "(str; '' for the module itself)")
            object.__setattr__(self, "return_local_tensor", list(paths))
