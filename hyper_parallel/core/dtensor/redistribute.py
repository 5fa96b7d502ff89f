"""Redistribution: a plan of per-axis (source, target) steps, each realized by one
collective, and its differentiable execution.

| step (one mesh axis)    | forward                    | backward (on the gradient)          |
|-------------------------|----------------------------|-------------------------------------|
| Shard(d) -> Replicate   | all-gather                 | keep the local chunk                |
| Replicate -> Shard(d)   | keep the local chunk       | all-gather                          |
| Shard(i) -> Shard(j)    | all-to-all                 | all-to-all back                     |
| Partial -> Replicate    | all-reduce                 | none (``avg``: / n)                 |
| Partial -> Shard(d)     | reduce-scatter             | all-gather (``avg``: / n)           |
| Replicate -> Partial    | ``sum``: value / n         | none (``avg``: * n)                 |

Gradients follow torch's DTensor: the gradient of a DTensor has the DTensor's
placements with ``Partial`` read as ``Replicate`` (every term of a sum receives the
whole gradient of the sum). ``Partial("max"/"min")`` has no gradient: its backward
raises. Shard -> Partial and Partial -> Partial go through Replicate.

Planning (``redistribute_plan``) is pure and cached by the placement tuples. With
several axes sharding the same dim (nested chunks, the outer axis first), a change on
an outer axis needs the inner axes unsharded first, so the plan runs in two phases:
inner-to-outer unsharding (all-gathers), then outer-to-inner transitions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec, dim_size_at
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import CustomFunction


@dataclass(frozen=True)
class Step:
    """One transition on one mesh axis; ``before`` holds every axis's placement just
    before it (it fixes the dim sizes the step works on)."""

    axis: int
    src: Placement
    dst: Placement
    before: tuple[Placement, ...]

    def __str__(self) -> str:
        return f"axis {self.axis}: {self.src} -> {self.dst}"


def _dims(placement: Placement) -> set[int]:
    return {placement.dim} if isinstance(placement, Shard) else set()


@functools.lru_cache(maxsize=4096)
def redistribute_plan(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> tuple[Step, ...]:
    """The steps taking placements ``src`` to ``dst`` (same mesh), each one collective."""
    if len(src) != len(dst):
        raise ValueError(f"redistribute_plan: {len(src)} source and {len(dst)} target placements")
    n = len(src)
    current = list(src)
    steps: list[Step] = []

    def move(axis: int, target: Placement) -> None:
        steps.append(Step(axis, current[axis], target, tuple(current)))
        current[axis] = target

    def direct_all_to_all(axis: int) -> bool:
        s, t = current[axis], dst[axis]
        if not (isinstance(s, Shard) and isinstance(t, Shard)):
            return False
        busy = set().union(*(_dims(current[a]) | _dims(dst[a]) for a in range(n) if a != axis))
        return not ({s.dim, t.dim} & busy)

    for axis in reversed(range(n)):
        placement = current[axis]
        if not isinstance(placement, Shard) or direct_all_to_all(axis):
            continue
        outer_change = any(current[a] != dst[a] and placement.dim in (_dims(current[a]) | _dims(dst[a]))
                           for a in range(axis))
        if placement != dst[axis] or outer_change:
            move(axis, Replicate())
    for axis in range(n):
        source, target = current[axis], dst[axis]
        if source == target:
            continue
        if isinstance(source, Partial) and isinstance(target, Partial):
            move(axis, Replicate())
        elif isinstance(source, Shard) and isinstance(target, Partial):
            move(axis, Replicate())
        move(axis, target)
    return tuple(steps)


def _step_context(step: Step, spec: DTensorSpec, coordinate: tuple[int, ...]) -> tuple[int, int, Any, Any]:
    """``(axis size, this rank's index on it, its group, size of a dim at this step)``."""
    mesh = spec.mesh

    def size(dim: int) -> int:
        return dim_size_at(spec.shape, step.before, mesh.shape, coordinate, step.axis, dim)

    return mesh.shape[step.axis], coordinate[step.axis], mesh.get_group(step.axis), size


def _forward_step(local: Any, step: Step, spec: DTensorSpec, coordinate: tuple[int, ...]) -> Any:
    num, index, group, size = _step_context(step, spec, coordinate)
    src, dst = step.src, step.dst
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return src.gather(local, size(src.dim), group, num, index)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return dst.shard(local, size(dst.dim), num, index)
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return src.to_shard(local, dst, size(src.dim), size(dst.dim), group, num, index)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return src.reduce(local, group)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return src.reduce_shard(local, dst, size(dst.dim), group, num, index)
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return dst.partition(local, num, index)
    raise AssertionError(f"redistribute_plan produced an unexpected step {step}")


def _no_gradient(partial: Partial) -> RuntimeError:
    return RuntimeError(f"redistribute: {partial} has no gradient (the {partial.reduce_op} of the terms is not "
                        "differentiable here); reduce with Partial('sum') or Partial('avg'), or redistribute "
                        "under no_grad")


def _backward_step(grad: Any, step: Step, spec: DTensorSpec, coordinate: tuple[int, ...]) -> Any:
    num, index, group, size = _step_context(step, spec, coordinate)
    src, dst = step.src, step.dst
    if isinstance(src, Partial) and src.reduce_op in ("max", "min"):
        raise _no_gradient(src)
    if isinstance(dst, Partial) and dst.reduce_op in ("max", "min"):
        raise _no_gradient(dst)
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return src.shard(grad, size(src.dim), num, index)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return dst.gather(grad, size(dst.dim), group, num, index)
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return dst.to_shard(grad, src, size(dst.dim), size(src.dim), group, num, index)
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            grad = dst.gather(grad, size(dst.dim), group, num, index)
        return grad / num if src.reduce_op == "avg" and num > 1 else grad
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return grad * num if dst.reduce_op == "avg" and num > 1 else grad
    raise AssertionError(f"redistribute_plan produced an unexpected step {step}")


class _Redistribute(CustomFunction):
    """Forward: the plan's steps on the local tensor. Backward: the steps' gradient
    transitions in reverse order (see the module table)."""

    @staticmethod
    def forward(ctx: Any, local: Any, spec: DTensorSpec, steps: tuple[Step, ...]) -> Any:
        ctx.spec, ctx.steps = spec, steps
        coordinate = spec.mesh.get_coordinate()
        for step in steps:
            local = _forward_step(local, step, spec, coordinate)
        return local

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        coordinate = ctx.spec.mesh.get_coordinate()
        for step in reversed(ctx.steps):
            grad = _backward_step(grad.contiguous(), step, ctx.spec, coordinate)
        # contiguous: MindSpore 2.10 reads a strided gradient (the local chunk of a later
        # dim, a narrow view) as if it were dense when the input was itself a view (a
        # split's piece), so full_tensor() of a split of a Shard(-1) DTensor had a wrong gradient
        return grad.contiguous(), None, None


def gradient_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The placements of a DTensor's gradient: ``Partial`` read as ``Replicate``."""
    return tuple(Replicate() if isinstance(pl, Partial) else pl for pl in placements)


def grad_to_layout(grad: Any, spec: DTensorSpec, grad_placements: tuple[Placement, ...]) -> Any:
    """A local gradient laid out as ``grad_placements`` taken to the gradient layout of
    ``spec``'s DTensor (each step forward-transformed, then 1/n per ``Partial('avg')``
    axis); unchanged when ``grad_placements`` already is that layout."""
    if spec.mesh.get_coordinate() is None or tuple(grad_placements) == gradient_placements(spec.placements):
        return grad
    coordinate = spec.mesh.get_coordinate()
    grad_spec = DTensorSpec(spec.mesh, tuple(grad_placements), spec.shape)
    for step in redistribute_plan(tuple(grad_placements), gradient_placements(spec.placements)):
        grad = _forward_step(grad.contiguous(), step, grad_spec, coordinate)
    for axis, placement in enumerate(spec.placements):
        if placement == Partial("avg") and spec.mesh.shape[axis] > 1:
            grad = grad / spec.mesh.shape[axis]
    return grad


class _ToLocalWithGradPlacements(CustomFunction):
    """Identity forward; backward: ``grad_to_layout``."""

    @staticmethod
    def forward(ctx: Any, local: Any, spec: DTensorSpec, grad_placements: tuple[Placement, ...]) -> Any:
        ctx.spec, ctx.grad_placements = spec, grad_placements
        return local

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        return grad_to_layout(grad, ctx.spec, ctx.grad_placements), None, None


def to_local_with_grad_placements(local: Any, spec: DTensorSpec, grad_placements: tuple[Placement, ...]) -> Any:
    """``local``, whose gradient will arrive laid out as ``grad_placements`` (for example
    ``Partial()`` after a local matmul with a sharded weight: the Megatron "f" operator,
    identity forward and all-reduce backward)."""
    if spec.mesh.get_coordinate() is None or tuple(grad_placements) == gradient_placements(spec.placements):
        return local
    return get_platform().apply_function(_ToLocalWithGradPlacements, local, spec, tuple(grad_placements))


def redistribute_local(local: Any, spec: DTensorSpec, placements: tuple[Placement, ...]) -> Any:
    """The local tensor of ``spec``'s DTensor redistributed to ``placements``,
    differentiable (see the module doc). A rank outside the mesh keeps its tensor."""
    steps = redistribute_plan(spec.placements, placements)
    if not steps or spec.mesh.get_coordinate() is None:
        return local
    return get_platform().apply_function(_Redistribute, local, spec, steps)


def redistribute_raw(local: Any, spec: DTensorSpec, placements: tuple[Placement, ...]) -> Any:
    """``redistribute_local`` outside autograd: what ops on DTensors run below the
    framework's autograd (their own backward ops are dispatched in turn)."""
    steps = redistribute_plan(spec.placements, tuple(placements))
    coordinate = spec.mesh.get_coordinate()
    if not steps or coordinate is None:
        return local
    with get_platform().no_grad():
        for step in steps:
            local = _forward_step(local.contiguous(), step, spec, coordinate)
    return local
