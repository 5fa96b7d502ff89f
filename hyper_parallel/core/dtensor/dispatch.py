"""Run an op on DTensors: pick a strategy of its rule per mesh axis, redistribute the
inputs, run the framework's op on the local tensors, wrap the result.

Two entry points share one plan (``plan_op``, cached by op, input specs and params):
``dispatch`` for the explicit calls of ``functional.py`` (autograd on the local
tensors, see the Note below) and ``dispatch_local`` for the framework ops a backend
intercepts on its DTensor class (below the framework's autograd, whose backward ops are
intercepted in turn). ``SkipDTensorDispatch`` turns both off: ops run on the local
tensors.

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

import contextvars
import functools
import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core import tensor_ops
from hyper_parallel.core.dtensor import philox
from hyper_parallel.core.dtensor.dtensor import DTensor, make_dtensor, wrap_local
from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec, local_offset, local_shape
from hyper_parallel.core.dtensor.op_rules import OP_RULES, Strategy, output_shape, strategies, view_keeps_dim
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.core.dtensor.redistribute import gradient_placements, redistribute_raw
from hyper_parallel.platform import get_platform
from hyper_parallel.core.tensor_ops import dtype_name

# A context variable, not a global flag: each thread (the pipeline's two-thread overlap)
# and each asyncio task sees its own depth.
_SKIP_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("hyper_parallel_skip_dtensor_dispatch",
                                                                  default=0)


class SkipDTensorDispatch:
    """Context manager: inside it, ops on DTensors run on their local tensors and return
    framework tensors (an in-place op updates the DTensor's local tensor and returns the
    DTensor), with no sharding rule and no communication. For local math on sharded
    values: gradient hooks, optimizer updates, statistics of this rank's piece.
    Re-entrant; per thread.

    Example::

        with SkipDTensorDispatch():
            param.mul_(1 - lr * weight_decay)   # on this rank's shard only
    """

    def __enter__(self) -> SkipDTensorDispatch:
        self._token = _SKIP_DEPTH.set(_SKIP_DEPTH.get() + 1)
        return self

    def __exit__(self, *exc: Any) -> None:
        _SKIP_DEPTH.reset(self._token)


def dispatch_skipped() -> bool:
    """Whether a ``SkipDTensorDispatch`` is active in this thread."""
    return _SKIP_DEPTH.get() > 0


def skip_depth() -> Callable[[], int]:
    """The number of ``SkipDTensorDispatch`` contexts active in this thread, as a bound
    ``ContextVar.get`` (non-zero: skipped): for a backend that asks on every op."""
    return _SKIP_DEPTH.get


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


def replicated_operands(dtensors: Sequence[Any]) -> bool:
    """Whether framework tensors may join ``dtensors`` as operands of one op.

    [Note: framework tensors among replicated DTensors]
    A framework tensor (with dims) among DTensor inputs that are all ``Replicate`` on
    every axis of one mesh is taken as a DTensor replicated on that mesh: every rank holds
    that same whole tensor. That is what upstream hyper_parallel's "a framework tensor is
    the local operand" gives for such inputs, which MindFormers relies on (its loss
    multiplies the replicated per-token loss by the plain input mask), and what torch's
    ``implicit_replication()`` gives. With any ``Shard`` or ``Partial`` input the
    framework tensor could be a piece or the whole, so the op is refused; wrap it with
    ``DTensor.from_local`` saying which. The framework tensor is trusted to be equal on
    the mesh's ranks (checking would cost a collective per op), as a ``Replicate``
    ``from_local(..., run_check=False)`` is."""
    if not dtensors:
        return False
    mesh = dtensors[0].device_mesh
    return all(t.device_mesh == mesh and all(pl.is_replicate() for pl in t.placements) for t in dtensors)


def mixed_operand_message(op: str, kinds: Sequence[str]) -> str:
    """The refusal of framework tensors among DTensors that are not all replicated."""
    return (f"{op}: inputs {list(kinds)} mix DTensors and {get_platform().framework} tensors, and not every "
            "DTensor is Replicate on every mesh axis, so it is unknown whether a framework tensor is this rank's "
            "piece or the whole tensor; wrap it as a DTensor first, e.g. DTensor.from_local(t, mesh, "
            "[Replicate()] * mesh.ndim) for a tensor every rank holds whole "
            "(see [Note: framework tensors among replicated DTensors])")


def _check_inputs(op: str, tensors: Sequence[Any], inplace: int | None = None) -> list[DTensor]:
    """The inputs as DTensors on one mesh: framework tensors among replicated DTensors
    are replicated DTensors too (see [Note: framework tensors among replicated DTensors]),
    except one an in-place op writes."""
    dtensors = [t for t in tensors if isinstance(t, DTensor)]
    mesh = dtensors[0].device_mesh
    for t in dtensors[1:]:
        if t.device_mesh != mesh:
            raise ValueError(f"{op}: inputs live on different meshes ({mesh} and {t.device_mesh}); "
                             "redistribute them onto one mesh first")
    if len(dtensors) != len(tensors):
        if not replicated_operands(dtensors) or (inplace is not None and not isinstance(tensors[inplace], DTensor)):
            raise TypeError(mixed_operand_message(op, [type(t).__name__ for t in tensors]))
        replicate = [Replicate()] * mesh.ndim
        return [t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, replicate) for t in tensors]
    return dtensors


def _is_floating(local: Any) -> bool:
    return dtype_name(local.dtype).startswith(("float", "bfloat"))


@dataclass(frozen=True)
class OpPlan:
    """The placements each input is redistributed to, and the output's spec (and this
    rank's shape of it)."""

    targets: tuple[tuple[Placement, ...], ...]
    out_spec: DTensorSpec
    out_local_shape: tuple[int, ...]


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def freeze_params(params: dict[str, Any] | None) -> tuple[Any, ...]:
    """``params`` as the hashable tuple ``plan_op`` keys its cache by (a caller that
    dispatches the same op often freezes once)."""
    return _freeze(params) if params else ()


def plan_op(op: str, specs: Sequence[DTensorSpec], params: dict[str, Any] | tuple[Any, ...] | None = None,
            inplace: int | None = None) -> OpPlan:
    """The plan of ``op`` (a key of ``OP_RULES``) on inputs of ``specs`` (one mesh).

    Args:
        params: the rule's params, a dict or frozen by ``freeze_params``.
        inplace: the index of the input an in-place op writes: it keeps its placements
            and the output has them.

    Raises:
        KeyError: ``op`` has no rule.
        ValueError: a draw (the ``random`` family) on a ``Partial`` input or on several tensors.
        RuntimeError: an in-place op whose rule cannot keep the written input's
            placements on some mesh axis (``x.add_(y)`` always can: ``y`` is moved to
            ``x``'s layout; an in-place softmax over ``x``'s sharded dim cannot).
    """
    frozen = params if isinstance(params, tuple) else _freeze(params) if params else ()
    return _plan_cached(op, tuple(specs), frozen, inplace)


@functools.lru_cache(maxsize=8192)
def _plan_cached(op: str, specs: tuple[DTensorSpec, ...], frozen: tuple[Any, ...], inplace: int | None) -> OpPlan:
    rule = OP_RULES[op]
    params = dict(frozen)
    mesh = specs[0].mesh
    if rule.family == "random" and len(specs) != 1:
        raise ValueError(f"{op} on DTensors with {len(specs)} tensor arguments (a mean or a probability per "
                         "element): only a draw shaped like one tensor with number arguments is drawn from "
                         "hyper_parallel's stream; draw a standard one with hyper_parallel.core.dtensor.random "
                         "(normal_, uniform_, bernoulli_) and combine it with the tensors")
    if rule.family == "random" and any(pl.is_partial() for pl in specs[0].placements):
        raise ValueError(f"{op} on a DTensor with placements {list(specs[0].placements)}: a Partial tensor holds "
                         "terms of a sum, which a draw is not; redistribute it to Replicate or Shard first")
    shapes = [spec.shape for spec in specs]
    if rule.family == "view":
        first = specs[0].placements
        params["nested"] = frozenset(d for d in range(len(shapes[0])) if first.count(Shard(d)) > 1)
    try:
        out_shape = output_shape(rule, shapes, params)
    except ValueError as err:
        raise ValueError(f"{op}: {err} (the rule {rule.family!r} of op_rules.py does not fit these inputs)") from err
    if inplace is not None and tuple(out_shape) != tuple(shapes[inplace]):
        # an in-place view (unsqueeze_, transpose_) would change the written DTensor's
        # global shape, which a DTensor's metadata cannot follow in place
        raise RuntimeError(f"in-place {op} on a DTensor of shape {tuple(shapes[inplace])} would change its shape to "
                           f"{tuple(out_shape)}; a DTensor's shape cannot change in place: use the out-of-place op")
    chosen = []
    for axis in range(mesh.ndim):
        current = [spec.placements[axis] for spec in specs]
        axis_params = dict(params, current=frozenset(pl for pl in current if isinstance(pl, Partial)))
        candidates = strategies(rule, shapes, axis_params, mesh.shape[axis])
        if inplace is not None:
            keep = current[inplace]
            candidates = [c for c in candidates if c.inputs[inplace] == keep and c.output == keep]
            if not candidates:
                raise RuntimeError(f"in-place {op} on a DTensor with placements {list(specs[inplace].placements)} "
                                   f"(shape {specs[inplace].shape}): no sharding of the op keeps {keep} on mesh "
                                   f"axis {axis}; use the out-of-place op, or redistribute the DTensor first")
        chosen.append(choose(candidates, current, shapes))
    replicated = Strategy(tuple(Replicate() for _ in specs), Replicate())
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
    # An in-place op keeps its placements, and so does an element-wise op without
    # broadcasting (detach, clone, zeros_like, grad * grad): elementwise kernels handle
    # empty pieces, and replicating there would all-gather every unevenly sharded
    # parameter an optimizer or ``nn.Parameter`` touches.
    elementwise = rule.family in ("pointwise", "like") and all(tuple(shape) == tuple(out_shape) for shape in shapes)
    for axis in reversed(range(mesh.ndim)):
        if inplace is not None or elementwise or not any(
                _has_empty_piece(shape, [c.inputs[i] for c in chosen], mesh.shape) for i, shape in enumerate(shapes)):
            break
        chosen[axis] = replicated
    targets = tuple(tuple(c.inputs[i] for c in chosen) for i in range(len(specs)))
    out_spec = DTensorSpec(mesh, tuple(c.output for c in chosen), tuple(out_shape))
    return OpPlan(targets, out_spec, out_spec.local_shape())


def _vocabulary_parallel(op: str, plan: OpPlan, weight: DTensorSpec,
                         local_fn: Callable[..., Any]) -> Callable[..., Any]:
    """[Note: vocabulary-parallel embedding] An embedding whose table is ``Shard(0)``
    (rows of the vocabulary) on some mesh axis looks up, on each rank, the ids that fall
    in its rows and gives zeros for the others: the result is a ``Partial("sum")`` (the
    Megatron vocabulary-parallel embedding). That is not the framework's embedding of the
    local table, so ``tensor_ops.masked_embedding`` runs instead, given where
    this rank's rows start."""
    if op != "embedding" or Shard(0) not in plan.targets[1]:
        return local_fn
    target = plan.targets[1]
    coordinate = weight.mesh.get_coordinate()
    start = 0 if coordinate is None else local_offset(weight.shape, target, weight.mesh.shape, coordinate, 0)
    return lambda ids, table: tensor_ops.masked_embedding(ids, table, start)


#: a random rule's name -> (the stream's kind of draw, the params it needs)
_RANDOM_PARAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "normal": ("normal", ("mean", "std")),
    "uniform": ("uniform", ("low", "high")),
    "bernoulli": ("bernoulli", ("p",)),
    "trunc_normal": ("trunc_normal", ("mean", "std", "a", "b")),
}
#: numpy dtypes the draws are made in (bfloat16: float32, then cast by the platform)
_DRAW_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.float32}


def _random_local(op: str, plan: OpPlan, spec: DTensorSpec, params: Any, inplace: int | None,
                  local_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A draw (the ``random`` family of ``OP_RULES``) runs core's stream instead of the
    framework's generator (``draw_local`` on this rank's piece of the output); other ops
    keep ``local_fn``."""
    if OP_RULES[op].family != "random":
        return local_fn
    out_spec = plan.out_spec
    offsets, lengths = out_spec.local_offsets(), plan.out_local_shape
    return lambda local: draw_local(op, params, local, out_spec.shape, offsets, lengths, inplace=inplace is not None)


def draw_local(op: str, params: Any, local: Any, shape: Sequence[int], offsets: Sequence[int],
               lengths: Sequence[int], *, inplace: bool) -> Any:
    """The piece ``offsets .. offsets + lengths`` of the values one device would draw for a
    whole tensor of ``shape`` ([Note: random ops on DTensors] in ``philox.py``), in
    ``local``'s dtype: written into ``local`` (``inplace``; returns it) or returned as a new
    tensor. The stream advances past the whole tensor on every rank, whatever its piece
    (an empty one included).

    Args:
        op: a rule of the ``random`` family (``normal``, ``uniform``, ``bernoulli``,
            ``trunc_normal``); ``params``: its arguments (a dict, or frozen pairs).
        local: this rank's local tensor of shape ``lengths``, floating point.

    Raises:
        RuntimeError: the backend handed the op without its arguments (naming the explicit
            function that takes them), or no seed is set.
        TypeError: a dtype that is not floating point.
        ValueError: an in-place draw into a 0-dim tensor.
    """
    kind, needed = _RANDOM_PARAMS[op]
    given = dict(params) if params else {}
    missing = [name for name in needed if name not in given]
    if missing:
        raise RuntimeError(f"{op} on a DTensor: the backend handed the op without its arguments {missing}, so "
                           "its values cannot be drawn from hyper_parallel's stream; call "
                           f"hyper_parallel.core.dtensor.random.{op}_(tensor, ...) instead")
    p = get_platform()
    name = dtype_name(local.dtype)
    if name not in _DRAW_DTYPES:
        raise TypeError(f"{op} on a tensor of dtype {name}: draws are floating point; cast it first")
    if inplace and len(lengths) == 0:
        raise ValueError(f"in-place {op} on a 0-dim tensor: draw into a 1-element tensor instead")
    state = philox.take(op, kind, _numel(shape))
    values = p.from_numpy(philox.draw(kind, {k: float(given[k]) for k in needed}, state, shape, offsets, lengths,
                                      np.dtype(_DRAW_DTYPES[name])))
    if name == "bfloat16":
        values = p.to_dtype(values, local.dtype)
    if not inplace:
        return values
    if 0 not in lengths:
        local[tuple(slice(None) for _ in lengths)] = values
    return local


def _check_dtype(op: str, out: Any) -> None:
    """Refuse a local result whose dtype the platform has no name for (complex ones: a
    torch conjugate view keeps its bit on the local tensor, not on the DTensor, and the
    rules are written for real values).

    Raises:
        TypeError: naming the op and the dtype.
    """
    try:
        dtype_name(out.dtype)
    except ValueError as err:
        raise TypeError(f"{op}: its result on DTensors would have dtype {out.dtype}, which DTensors do not "
                        f"support ({err}); compute it on the local or whole tensors") from None


def _check_result(op: str, out: Any, plan: OpPlan) -> None:
    if tuple(out.shape) != plan.out_local_shape:
        spec = plan.out_spec
        raise RuntimeError(f"{op}: the local result has shape {tuple(out.shape)}, but the rule's output "
                           f"{list(spec.placements)} of global shape {spec.shape} gives this rank "
                           f"{plan.out_local_shape}; the rule in op_rules.py does not describe this op")


def dispatch(op: str, tensors: Sequence[Any], local_fn: Callable[..., Any],
             params: dict[str, Any] | None = None, *, inplace: int | None = None,
             with_local_shape: bool = False) -> Any:
    """Run ``local_fn`` (the op on local tensors) on ``tensors`` under the rule
    ``OP_RULES[op]``, differentiably on both frameworks (the explicit calls of
    ``functional.py``).

    Args:
        op: the op's name (a key of ``OP_RULES``; any other name takes the fallback).
        tensors: the op's tensor inputs in order: DTensors on one mesh, or all
            framework tensors (then ``local_fn(*tensors)`` is returned as is, so the same
            model code runs unsharded); framework tensors among DTensors only as
            [Note: framework tensors among replicated DTensors] allows.
        local_fn: the op on local tensors, called with one local tensor per input.
        params: the op's other arguments as the rule family reads them (``dim``,
            ``keepdim``, ``shape``, ...).
        inplace: the index of the input an in-place op writes: it keeps its placements,
            ``local_fn`` writes its local tensor, and that DTensor is returned.
        with_local_shape: call ``local_fn(*locals, local_shape=...)`` with this rank's
            output shape (ops that take a size).

    Returns:
        A DTensor with the global output shape and the placements the strategies give;
        its local tensor is ``local_fn``'s result. Under ``SkipDTensorDispatch``:
        ``local_fn`` of the local tensors, a framework tensor (the written DTensor for
        an in-place op).

    Collectives: the redistributions the chosen strategies need (see
    ``DTensor.redistribute``), none when the inputs already fit.

    Raises:
        TypeError: framework tensors among DTensors that are not all replicated.
        ValueError: inputs on different meshes, or shapes the op rejects.
    """
    if not any(isinstance(t, DTensor) for t in tensors):
        return local_fn(*tensors)
    dtensors = _check_inputs(op, tensors, inplace)
    if dispatch_skipped():
        out = local_fn(*[t.to_local() for t in dtensors])
        return dtensors[inplace] if inplace is not None else out
    if op not in OP_RULES:
        _refuse_sharded_inplace(op, dtensors, inplace)
        return _fallback(op, dtensors, local_fn, differentiable=True)
    plan = plan_op(op, [t.spec for t in dtensors], params, inplace)
    local_fn = _vocabulary_parallel(op, plan, dtensors[-1].spec, local_fn)
    local_fn = _random_local(op, plan, dtensors[0].spec, params, inplace, local_fn)
    mesh = dtensors[0].device_mesh
    locals_ = []
    for index, (t, target) in enumerate(zip(dtensors, plan.targets)):
        if index == inplace:
            locals_.append(t._local)  # written in place: the DTensor's own local tensor
            continue
        moved = t if tuple(target) == t.placements else t.redistribute(mesh, target)
        grad = input_grad_placements(tuple(target), plan.out_spec.placements, mesh.shape)
        if grad is not None and _is_floating(moved.to_local()):
            locals_.append(moved.to_local(grad_placements=grad))
        else:
            locals_.append(moved.to_local())
    return _run(op, local_fn, locals_, plan, dtensors, inplace, with_local_shape, wrap_local)


def input_grad_placements(target: tuple[Placement, ...], out_placements: tuple[Placement, ...],
                          mesh_shape: Sequence[int]) -> tuple[Placement, ...] | None:
    """The ``grad_placements`` an input redistributed to ``target`` takes its local tensor
    with, in an op above autograd whose output has ``out_placements``: ``Partial("sum")``
    on the axes where the input is ``Replicate`` and the output is not (its gradient is
    summed over them, [Note: gradients of ops on DTensors]); ``None`` where there is no
    such axis (the input's own gradient layout). An axis of one rank is left out: a sum
    over one rank is the gradient itself, and the identity costs a framework autograd
    function per op. Floating-point inputs only: an integer input has no gradient."""
    own = gradient_placements(target)
    grad = tuple(Partial("sum") if pl.is_replicate() and not out.is_replicate() and size > 1 else grad_pl
                 for pl, grad_pl, out, size in zip(target, own, out_placements, mesh_shape))
    return None if grad == own else grad


@dataclass(frozen=True)
class LocalCall:
    """An op above autograd that runs as it is on its inputs' local tensors (see
    ``explicit_local_plan``): the plan, and per input the ``grad_placements`` its local
    tensor is taken with (``None``: the local tensor itself; ``to_local_with_grad_placements``
    otherwise)."""

    plan: OpPlan
    grads: tuple[tuple[Placement, ...] | None, ...]


def explicit_local_plan(op: str, specs: Sequence[DTensorSpec], params: dict[str, Any] | tuple[Any, ...] | None,
                        inplace: int | None, dtypes: Sequence[Any]) -> LocalCall | None:
    """``local_plan`` for an op above autograd (``dispatch``: MindSpore's ``__fallback__``),
    with the gradient layout each input's local tensor is taken with (``dtypes``: the
    inputs' framework dtypes; an integer input has no gradient). ``None`` where
    ``dispatch`` would do more than run the op on the local tensors and wrap the result
    (communication, another local op, a draw), or a dtype the platform has no name for.
    A backend may cache it by everything it depends on (the op, each input's spec and
    dtype, the params) and run such a call itself: the local tensors (each through
    ``to_local_with_grad_placements`` where ``grads`` names a layout), the framework op,
    the result wrapped in ``plan.out_spec``; the first call of a key runs ``dispatch``,
    which checks the result's shape and dtype, and a call of the same key gives the same
    ones. No communication."""
    try:
        floating = [dtype_name(dtype).startswith(("float", "bfloat")) for dtype in dtypes]
    except ValueError:
        return None  # complex: dispatch refuses the result, naming the op
    plan = local_plan(op, specs, params, inplace)
    if plan is None:
        return None
    out_placements, mesh_shape = plan.out_spec.placements, plan.out_spec.mesh.shape
    grads = tuple(None if index == inplace or not is_float
                  else input_grad_placements(target, out_placements, mesh_shape)
                  for index, (target, is_float) in enumerate(zip(plan.targets, floating)))
    return LocalCall(plan, grads)


def _run(op: str, local_fn: Callable[..., Any], locals_: Sequence[Any], plan: OpPlan, dtensors: Sequence[DTensor],
         inplace: int | None, with_local_shape: bool, wrap: Callable[[Any, DTensorSpec], Any]) -> Any:
    """The local op on the redistributed locals, checked against the plan, wrapped (or
    the written DTensor of an in-place op)."""
    if with_local_shape:
        out = local_fn(*locals_, local_shape=plan.out_local_shape)
    else:
        out = local_fn(*locals_)
    _check_result(op, out, plan)
    _check_dtype(op, out)
    if inplace is not None:
        return dtensors[inplace]
    return wrap(out, plan.out_spec)


def _refuse_sharded_inplace(op: str, dtensors: Sequence[DTensor], inplace: int | None) -> None:
    if inplace is not None and any(not pl.is_replicate() for pl in dtensors[inplace].placements):
        raise RuntimeError(f"in-place {op} on a DTensor with placements {list(dtensors[inplace].placements)}: "
                           "the op has no sharding rule (hyper_parallel.core.dtensor.op_rules.OP_RULES), so it "
                           "could only run on a replicated copy; use the out-of-place op")


def dispatch_local(op: str, dtensors: Sequence[DTensor], local_fn: Callable[..., Any],
                   params: dict[str, Any] | None = None, *, inplace: int | None = None,
                   with_local_shape: bool = False) -> Any:
    """Run a framework op a backend intercepted on its DTensor class: below the
    framework's autograd (no gradient is recorded here; the op's backward ops are
    intercepted in turn), on the local tensors, under ``OP_RULES[op]``.

    Args:
        op: the rule's name; an op without one takes the fallback (inputs to
            ``Replicate``, a warning naming the op).
        dtensors: the op's DTensor inputs in order, on one mesh (the backend keeps
            Python numbers and 0-dim framework tensors in ``local_fn``).
        local_fn: the framework op on one local tensor per DTensor input.
        params: as for ``dispatch``.
        inplace: the index of the input an in-place op writes (it keeps its placements).
        with_local_shape: call ``local_fn(*locals, local_shape=...)`` with this rank's
            output shape (ops that take a size: a view, an expand).

    Returns:
        A DTensor (outside autograd) whose local tensor is ``local_fn``'s result; under
        ``SkipDTensorDispatch`` ``local_fn``'s result on the local tensors as they are.

    Collectives: the redistributions the plan needs.

    Raises:
        ValueError: inputs on different meshes.
        RuntimeError: an in-place op that cannot keep its input's placements.
    """
    if dispatch_skipped():
        return local_fn(*[t._local for t in dtensors])
    specs = [t._spec for t in dtensors]
    mesh = specs[0].mesh
    for spec in specs[1:]:
        if spec.mesh != mesh:
            raise ValueError(f"{op}: inputs live on different meshes ({mesh} and {spec.mesh}); "
                             "redistribute them onto one mesh first")
    if op not in OP_RULES:
        _refuse_sharded_inplace(op, dtensors, inplace)
        return _fallback(op, dtensors, local_fn, differentiable=False)
    plan = plan_op(op, specs, params, inplace)
    local_fn = _vocabulary_parallel(op, plan, specs[-1], local_fn)
    local_fn = _random_local(op, plan, specs[0], params, inplace, local_fn)
    locals_ = [t._local if target == spec.placements else redistribute_raw(t._local, spec, target)
               for t, spec, target in zip(dtensors, specs, plan.targets)]
    return _run(op, local_fn, locals_, plan, dtensors, inplace, with_local_shape, make_dtensor)


def local_plan(op: str, specs: Sequence[DTensorSpec], params: dict[str, Any] | tuple[Any, ...] | None = None,
               inplace: int | None = None) -> OpPlan | None:
    """The plan of ``op`` on inputs of ``specs`` when ``dispatch_local`` would run the
    framework op as it is on the local tensors as they are: a rule exists, no input is
    redistributed, no other local op takes its place (a vocabulary-parallel embedding).
    ``None`` otherwise (a draw too). A backend that caches it by the inputs' specs and params may then
    run the op itself and wrap the result in ``plan.out_spec`` (checking its shape with
    ``check_result``): what ``dispatch_local`` does for such a call, without its per-call
    planning. No communication."""
    if op not in OP_RULES or any(spec.mesh != specs[0].mesh for spec in specs):
        return None
    plan = plan_op(op, specs, params, inplace)
    if any(tuple(target) != spec.placements for target, spec in zip(plan.targets, specs)):
        return None
    if op == "embedding" and Shard(0) in plan.targets[-1]:
        return None
    if OP_RULES[op].family == "random":
        return None  # the framework's draw never runs: [Note: random ops on DTensors]
    return plan


def check_result(op: str, out: Any, plan: OpPlan) -> None:
    """Raise where a local op's result is not the shape ``plan`` says (see ``local_plan``).

    Raises:
        RuntimeError: the local result's shape differs from ``plan.out_local_shape``.
    """
    _check_result(op, out, plan)


def full_local(dt: DTensor) -> Any:
    """The whole tensor on this rank, outside autograd (all-gather / all-reduce)."""
    return redistribute_raw(dt._local, dt.spec, (Replicate(),) * dt.device_mesh.ndim)


def _contiguous(local: Any) -> Any:
    """``local`` itself when contiguous: an op without a rule may write a replicated
    input in place (the noise of torch's ``rrelu_with_noise``), and its local tensor
    must then be the one written."""
    return local if local.is_contiguous() else local.contiguous()


def _fallback(op: str, dtensors: Sequence[DTensor], local_fn: Callable[..., Any], *, differentiable: bool) -> Any:
    """No rule: every input to Replicate (all-gather / all-reduce), the op on the whole
    tensors on every rank, a Replicate result. Warns once per op name (Python's
    default filter shows one message once per location and text)."""
    warnings.warn(f"DTensor op {op!r} has no sharding rule (hyper_parallel.core.dtensor.op_rules.OP_RULES): its "
                  "inputs are redistributed to Replicate and it runs on the whole tensors on every rank",
                  UserWarning, stacklevel=1)
    mesh = dtensors[0].device_mesh
    replicate = (Replicate(),) * mesh.ndim
    # whole tensors in the layout a plain one has (a gather along a later dim leaves a
    # strided view, which kernels such as group norm's refuse)
    if differentiable:
        out = local_fn(*[t.redistribute(mesh, replicate).to_local().contiguous() for t in dtensors])
    else:
        out = local_fn(*[_contiguous(full_local(t)) for t in dtensors])
    p = get_platform()

    def wrap(value: Any) -> Any:
        if not p.is_tensor(value) or isinstance(value, DTensor):
            return value
        _check_dtype(op, value)
        spec = DTensorSpec(mesh, replicate, tuple(int(s) for s in value.shape))
        return wrap_local(value, spec) if differentiable else make_dtensor(value, spec)

    if isinstance(out, (tuple, list)):
        return type(out)(wrap(v) for v in out)
    return wrap(out)


def dispatch_split(x: DTensor, dim: int, local_fn: Callable[[Any], Sequence[Any]], *,
                   differentiable: bool = True) -> tuple[DTensor, ...]:
    """A split or chunk of ``x`` into pieces along ``dim`` (``torch.split`` /
    ``Tensor.chunk`` / ``mint.split`` / ``mint.chunk``): ``local_fn(local)`` splits the
    local tensor as the call asked, and each piece has ``x``'s placements where no mesh
    axis shards ``dim``. An axis that shards ``dim`` is gathered first (to ``Replicate``
    there: all-gather) and its pieces are ``Replicate`` on it; so is an axis that would
    leave a rank an empty piece ([Note: no empty pieces]). A split is linear, so a
    ``Partial`` stays.

    Args:
        x: the DTensor split, any shape and dtype.
        dim: the dim split along (negative counts from the end).
        local_fn: this rank's split of a local tensor whose ``dim`` is whole.
        differentiable: above autograd (MindSpore's ``__fallback__``: the gather and the
            wraps are differentiable); ``False`` below it (torch's ``__torch_dispatch__``,
            where autograd records the split on the DTensors themselves).

    Returns:
        The pieces, DTensors of ``x``'s mesh, in order.
    """
    ndim = len(x.shape)
    dim %= ndim
    placements = [Replicate() if isinstance(pl, Shard) and pl.dim % ndim == dim else pl for pl in x.placements]
    mesh = x.device_mesh
    for axis in reversed(range(mesh.ndim)):
        if not _has_empty_piece(x.shape, placements, mesh.shape):
            break
        placements[axis] = Replicate()
    target = tuple(placements)
    if differentiable:
        local = (x.redistribute(mesh, target) if target != tuple(x.placements) else x).to_local()
    else:
        local = redistribute_raw(x._local, x.spec, target)
    wrap = wrap_local if differentiable else make_dtensor
    shape = list(x.shape)
    out = []
    for piece in local_fn(local):
        shape[dim] = int(piece.shape[dim])  # dim is whole on this rank: the piece's size is global
        out.append(wrap(piece, DTensorSpec(mesh, target, tuple(shape))))
    return tuple(out)
