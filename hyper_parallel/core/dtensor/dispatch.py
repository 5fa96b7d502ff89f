"""Run an op on DTensors: pick a strategy of its rule per mesh axis, redistribute the
inputs, run the framework's op on the local tensors, wrap the result.

[Note: gradients of ops on DTensors]
Autograd runs on the local tensors (``to_local``/``from_local`` are identities there),
so the backward of an op on DTensors is the backward of the local op plus that of the
input redistributions. That is already the gradient of the global op, with one
exception: an input that is ``Replicate`` on a mesh axis along which the output is
sharded (or ``Partial``) receives, on each rank, only the contribution of that rank's
part of the output; the true gradient is the sum over the axis. ``dispatch`` therefore
takes such an input's local tensor with ``to_local(grad_placements=...)`` naming
``Partial("sum")`` on those axes, whose backward all-reduces the gradient (the
Megatron "f" operator; torch's DTensor reaches the same through its backward rules).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec, local_shape
from hyper_parallel.core.dtensor.op_rules import OP_RULES, Strategy, output_shape, strategies, view_keeps_dim
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.core.dtensor.redistribute import gradient_placements
from hyper_parallel.platform import get_platform


def transition_cost(src: Placement, dst: Placement, numel: int) -> float:
    """A rough communication volume (elements) for moving one input from ``src`` to
    ``dst`` on one mesh axis; only the order matters (it ranks strategies)."""
    if src == dst:
        return 0.0
    if src.is_replicate():  # local chunk, or value / n: no communication
        return 1e-3 * numel
    if dst.is_replicate():  # all-gather or all-reduce
        return float(numel)
    if dst.is_shard():  # all-to-all or reduce-scatter
        return 0.5 * numel
    return 2.0 * numel  # through Replicate


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def choose(candidates: Sequence[Strategy], current: Sequence[Placement], shapes: Sequence[Sequence[int]]) -> Strategy:
    """The cheapest strategy to reach from the ``current`` input placements (the first
    listed among equals, so every rank chooses the same)."""
    def cost(strategy: Strategy) -> float:
        return sum(transition_cost(src, dst, _numel(shape))
                   for src, dst, shape in zip(current, strategy.inputs, shapes))
    return min(candidates, key=cost)


def _has_empty_piece(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """Whether some mesh coordinate holds a zero-size piece of a non-empty tensor."""
    if 0 in shape or not any(pl.is_shard() for pl in placements):
        return False
    return any(0 in local_shape(shape, placements, mesh_shape, coordinate)
               for coordinate in itertools.product(*(range(size) for size in mesh_shape)))


def _check_inputs(op: str, tensors: Sequence[Any]) -> list[DTensor]:
    dtensors = [t for t in tensors if isinstance(t, DTensor)]
    if len(dtensors) != len(tensors):
        p = get_platform()
        kinds = [type(t).__name__ for t in tensors]
        raise TypeError(f"{op}: inputs {kinds} mix DTensors and {p.framework} tensors; wrap each tensor as a "
                        "DTensor, e.g. DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim) for a tensor every "
                        "rank holds whole")
    mesh = dtensors[0].device_mesh
    for t in dtensors[1:]:
        if t.device_mesh != mesh:
            raise ValueError(f"{op}: inputs live on different meshes ({mesh} and {t.device_mesh}); "
                             "redistribute them onto one mesh first")
    return dtensors


def _is_floating(local: Any) -> bool:
    return get_platform().dtype_name(local.dtype).startswith(("float", "bfloat"))


def dispatch(op: str, tensors: Sequence[Any], local_fn: Callable[..., Any],
             params: dict[str, Any] | None = None) -> Any:
    """Run ``local_fn`` (the op on local tensors) on ``tensors`` under the rule
    ``OP_RULES[op]``.

    Args:
        op: the op's name (a key of ``OP_RULES``; any other name takes the fallback).
        tensors: the op's tensor inputs in order: all DTensors on one mesh, or all
            framework tensors (then ``local_fn(*tensors)`` is returned as is, so the same
            model code runs unsharded).
        local_fn: the op on local tensors, called with one local tensor per input.
        params: the op's other arguments as the rule family reads them (``dim``,
            ``keepdim``, ``shape``, ...).

    Returns:
        A DTensor with the global output shape and the placements the strategies give;
        its local tensor is ``local_fn``'s result.

    Collectives: the redistributions the chosen strategies need (see
    ``DTensor.redistribute``), none when the inputs already fit.

    Raises:
        TypeError: DTensors mixed with framework tensors.
        ValueError: inputs on different meshes, or shapes the op rejects.
    """
    if not any(isinstance(t, DTensor) for t in tensors):
        return local_fn(*tensors)
    dtensors = _check_inputs(op, tensors)
    mesh = dtensors[0].device_mesh
    rule = OP_RULES.get(op)
    if rule is None:
        return _fallback(op, dtensors, local_fn)
    params = dict(params or {})
    shapes = [t.shape for t in dtensors]
    if rule.family == "view":
        first = dtensors[0].placements
        params["nested"] = frozenset(d for d in range(len(shapes[0])) if first.count(Shard(d)) > 1)
    out_shape = output_shape(rule, shapes, params)
    chosen = []
    for axis in range(mesh.ndim):
        current = [t.placements[axis] for t in dtensors]
        chosen.append(choose(strategies(rule, shapes, params, mesh.shape[axis]), current, shapes))
    replicated = Strategy(tuple(Replicate() for _ in dtensors), Replicate())
    if rule.family == "view":
        # a split or merge keeps a shard only when one mesh axis shards that dim
        for axis in range(1, mesh.ndim):
            pl = chosen[axis].inputs[0]
            if (pl.is_shard() and any(chosen[a].inputs[0] == pl for a in range(axis))
                    and not view_keeps_dim(shapes[0], out_shape, pl.dim)):
                chosen[axis] = replicated
    # [Note: no empty pieces] An op never runs on a zero-size piece of a non-empty input
    # (an uneven shard such as 5 rows over 4 ranks leaves the last one none): MindSpore
    # 2.10's CPU kernels return uninitialised memory for a matmul with an empty
    # contracted dim and for the backward of a broadcast into an empty output. Axes
    # whose strategy would leave a rank such a piece run replicated (inner axes first).
    for axis in reversed(range(mesh.ndim)):
        if not any(_has_empty_piece(shape, [c.inputs[i] for c in chosen], mesh.shape)
                   for i, shape in enumerate(shapes)):
            break
        chosen[axis] = replicated
    targets = [[c.inputs[i] for c in chosen] for i in range(len(dtensors))]
    out_placements = [c.output for c in chosen]
    locals_ = []
    for t, target in zip(dtensors, targets):
        moved = t if tuple(target) == t.placements else t.redistribute(mesh, target)
        grad = tuple(Partial("sum") if pl.is_replicate() and not out.is_replicate() else grad_pl
                     for pl, grad_pl, out in zip(target, gradient_placements(tuple(target)), out_placements))
        # see [Note: gradients of ops on DTensors]
        if grad != gradient_placements(tuple(target)) and _is_floating(moved.to_local()):
            locals_.append(moved.to_local(grad_placements=grad))
        else:
            locals_.append(moved.to_local())
    spec = DTensorSpec(mesh, tuple(out_placements), tuple(out_shape))
    out = local_fn(*locals_)
    if tuple(int(s) for s in out.shape) != spec.local_shape():
        raise RuntimeError(f"{op}: the local result has shape {tuple(out.shape)}, but the rule's output "
                           f"{list(out_placements)} of global shape {out_shape} gives this rank {spec.local_shape()}; "
                           "the rule in op_rules.py does not describe this op")
    return DTensor(out, spec)


def _fallback(op: str, dtensors: Sequence[DTensor], local_fn: Callable[..., Any]) -> Any:
    """No rule: every input to Replicate (all-gather / all-reduce), the op on the whole
    tensors on every rank, a Replicate result. Warns once per op name (Python's
    default filter shows one message once per location, and this is one location)."""
    warnings.warn(f"DTensor op {op!r} has no sharding rule (hyper_parallel.core.dtensor.op_rules.OP_RULES): its "
                  "inputs are redistributed to Replicate and it runs on the whole tensors on every rank",
                  UserWarning, stacklevel=1)
    mesh = dtensors[0].device_mesh
    replicate = (Replicate(),) * mesh.ndim
    out = local_fn(*[t.redistribute(mesh, replicate).to_local() for t in dtensors])
    p = get_platform()

    def wrap(value: Any) -> Any:
        if not p.is_tensor(value):
            return value
        return DTensor(value, DTensorSpec(mesh, replicate, tuple(int(s) for s in value.shape)))

    if isinstance(out, (tuple, list)):
        return type(out)(wrap(v) for v in out)
    return wrap(out)
