"""Fused framework ops on DTensors below autograd, for a backend that intercepts its
framework's kernels one by one (torch's aten ops): ops with several outputs planned by
the rule of some of their inputs (a fused attention's forward and backward), and the
ops whose sharded dim needs a reduction across ranks rather than a gather (a softmax
over class-sharded logits, the negative log-likelihood that follows it).

[Note: fused ops with several outputs]
A fused attention's forward returns the output and the log-sum-exp (and, on some
kernels, random-number state and sequence bookkeeping); its backward takes those back
with the incoming gradient and returns ``dq, dk, dv``. The ``attention`` rule plans
``q, k, v`` (batch or heads sharded); every other tensor of the call whose leading dims
have the same sizes as the query's follows the query's placements dim by dim (a
``Shard(1)`` of the heads is a ``Shard(1)`` of the log-sum-exp ``[b, h, s]``); the rest
(seeds, offsets: a few elements) are ``Replicate``. No communication when the inputs
already fit the rule.

[Note: softmax over a sharded dim]
``softmax`` / ``log_softmax`` over a dim that one mesh axis shards (the classes of
``[N, C]`` logits, ``Shard(1)``) run where the pieces are, with two **all-reduces** of
``[rows]`` over that axis (the max, then the sum of exponentials), instead of gathering
the logits: Megatron-LM's vocabulary-parallel softmax (Shoeybi et al., 2019), which
torch's ``loss_parallel`` does at the same level. Their backward ops all-reduce one sum
per row (``log_softmax``: ``g - exp(y) * sum(g)``; ``softmax``: ``y * (g - sum(g * y))``).
The negative log-likelihood on such log-probabilities (``nll_loss``) picks each row's
target on the rank that holds that class (zero elsewhere) and all-reduces the picks;
its backward writes ``-grad`` at the same places, without communication. Statistics
are computed in float32 or better.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.core.dtensor.dispatch import dispatch_skipped, plan_op
from hyper_parallel.core.dtensor.dtensor import DTensor, make_dtensor
from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec, local_offset
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.core.dtensor.redistribute import redistribute_raw
from hyper_parallel.platform import get_platform
from hyper_parallel.core.tensor_ops import dtype_name

def _aligned(target: Sequence[Placement], src: Sequence[int], dst: Sequence[int]) -> tuple[Placement, ...]:
    """``target`` (the placements of a tensor of shape ``src``) for a tensor of shape
    ``dst``: a ``Shard(d)`` stays where ``dst`` has dim ``d`` of the same size, else
    ``Replicate``."""
    return tuple(pl if not isinstance(pl, Shard) or (pl.dim < len(dst) and int(dst[pl.dim]) == int(src[pl.dim]))
                 else Replicate() for pl in target)


def _check_mesh(op: str, specs: Sequence[DTensorSpec]) -> None:
    for spec in specs[1:]:
        if spec.mesh != specs[0].mesh:
            raise ValueError(f"{op}: inputs live on different meshes ({specs[0].mesh} and {spec.mesh}); "
                             "redistribute them onto one mesh first")


def dispatch_aligned(op: str, dtensors: Sequence[DTensor], ruled: Sequence[int], follow: Sequence[int | None],
                     local_fn: Callable[..., Sequence[Any]], outputs: Callable[[Sequence[Any]], Sequence[Any]],
                     params: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """Run a framework op with several outputs below autograd, planned by the rule
    ``OP_RULES[op]`` of some of its inputs (see [Note: fused ops with several outputs]).

    Args:
        op: the rule's name (``"scaled_dot_product_attention"``).
        dtensors: every DTensor input of the call, in order, on one mesh.
        ruled: the indices into ``dtensors`` of the inputs the rule plans, in the rule's
            order (``q, k, v``).
        follow: per DTensor, the index into ``ruled`` whose planned placements it takes
            (dim by dim where its global size agrees, else ``Replicate``), or ``None``
            (``Replicate``).
        local_fn: the op on one local tensor per DTensor; returns a sequence.
        outputs: given ``local_fn``'s results, per result ``(global shape, index into
            ruled or None)`` for a tensor (wrapped as a DTensor, its local shape
            checked), or ``None`` for a value passed on as it is.
        params: the rule's params.

    Returns:
        The results, tensors wrapped as DTensors; under ``SkipDTensorDispatch`` the
        op's results on the local tensors.

    Collectives: the redistributions the plan needs (none when the inputs fit it).

    Raises:
        ValueError: inputs on different meshes.
        RuntimeError: a local result whose shape the plan does not give.
    """
    if dispatch_skipped():
        return tuple(local_fn(*[t._local for t in dtensors]))
    specs = [t._spec for t in dtensors]
    _check_mesh(op, specs)
    mesh = specs[0].mesh
    ruled_specs = [specs[i] for i in ruled]
    plan = plan_op(op, ruled_specs, params)

    def placements_of(lead: int | None, shape: Sequence[int]) -> tuple[Placement, ...]:
        if lead is None:
            return (Replicate(),) * mesh.ndim
        return _aligned(plan.targets[lead], ruled_specs[lead].shape, shape)

    locals_ = []
    for t, spec, lead in zip(dtensors, specs, follow):
        target = placements_of(lead, spec.shape)
        locals_.append(t._local if target == spec.placements else redistribute_raw(t._local, spec, target))
    results = []
    values = tuple(local_fn(*locals_))
    for value, entry in zip(values, outputs(values)):
        if entry is None:
            results.append(value)
            continue
        shape, lead = entry
        spec = DTensorSpec(mesh, placements_of(lead, shape), tuple(int(s) for s in shape))
        if tuple(value.shape) != spec.local_shape():
            raise RuntimeError(f"{op}: a local result has shape {tuple(value.shape)}, but {list(spec.placements)} "
                               f"of global shape {spec.shape} gives this rank {spec.local_shape()}")
        results.append(make_dtensor(value, spec))
    return tuple(results)


def sharded_dim_axis(spec: DTensorSpec, dim: int) -> int | None:
    """The mesh axis that alone shards ``dim`` of a DTensor of ``spec`` with no empty
    piece, when no axis holds a ``Partial``; else None (the op then takes its rule)."""
    found = None
    for axis, pl in enumerate(spec.placements):
        if isinstance(pl, Partial):
            return None
        if isinstance(pl, Shard) and pl.dim == dim:
            n, size = spec.mesh.shape[axis], spec.shape[dim]
            if found is not None or -(-size // n) * (n - 1) >= size:
                return None
            found = axis
    return found


def _upcast(local: Any) -> tuple[Any, Any]:
    """``local`` in float32 or better, and its own dtype (statistics of low-precision
    logits are computed in float32, as the fused kernels accumulate)."""
    p = get_platform()
    dtype = local.dtype
    if dtype_name(dtype) in ("float16", "bfloat16"):
        return p.to_dtype(local, p.dtype("float32")), dtype
    return local, dtype


def softmax_sharded(op: str, dtensors: Sequence[DTensor], dim: int, axis: int) -> DTensor:
    """``softmax`` / ``log_softmax`` (``dtensors = [x]``) or their backward
    (``[grad, y]``) over ``dim``, which mesh ``axis`` shards (see [Note: softmax over a
    sharded dim]); below autograd, the result laid out as the first input.

    Args:
        op: ``"softmax"``, ``"log_softmax"``, ``"softmax_backward"`` or
            ``"log_softmax_backward"``.
        dtensors: ``[x]`` (logits, any shape, e.g. ``[rows, classes]``) or ``[grad, y]``
            (the output's gradient and the forward's output, both ``x``'s shape); floating
            dtypes, the statistics in float32 or better (half precision is upcast, the
            result cast back).
        dim: the dim normalised over (non-negative).
        axis: the mesh axis that alone shards ``dim`` (``sharded_dim_axis``).

    Returns:
        A DTensor of the first input's global shape, dtype and placements.

    Collectives: the inputs' other axes are left as they are; the backward's ``y`` is
    brought to ``grad``'s placements; **all-reduce** of ``x``'s shape with ``dim`` of size
    1 over ``axis``: (max, sum) forward, (sum) backward. Raises nothing of its own (the
    backend checked ``dim`` and ``axis`` when it chose this path).
    """
    p = get_platform()
    spec = dtensors[0]._spec
    group = spec.mesh.get_group(axis)
    locals_ = [t._local if t._spec.placements == spec.placements
               else redistribute_raw(t._local, t._spec, spec.placements) for t in dtensors]
    x, dtype = _upcast(locals_[0])
    keep = (dim,)
    with p.no_grad():
        if op in ("softmax", "log_softmax"):
            m = p.all_reduce(x.amax(keep, True), "max", group=group).wait()
            shifted = x - m
            total = p.all_reduce(shifted.exp().sum(keep, keepdim=True), "sum", group=group).wait()
            out = shifted - total.log() if op == "log_softmax" else shifted.exp() / total
        else:
            y, _ = _upcast(locals_[1])
            if op == "log_softmax_backward":
                total = p.all_reduce(x.sum(keep, keepdim=True), "sum", group=group).wait()
                out = x - y.exp() * total
            else:
                total = p.all_reduce((x * y).sum(keep, keepdim=True), "sum", group=group).wait()
                out = y * (x - total)
        out = p.to_dtype(out, dtype)
    return make_dtensor(out, spec)


def _nll_layout(logprobs: DTensorSpec) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """The placements an ``nll_loss`` works on: the log-probabilities ``[N, C]`` keep a
    ``Shard`` of either dim, anything else becomes ``Replicate``; the target ``[N]`` is
    sharded where the rows are."""
    placements = tuple(pl if pl in (Shard(0), Shard(1)) else Replicate() for pl in logprobs.placements)
    return placements, tuple(Shard(0) if pl == Shard(0) else Replicate() for pl in placements)


def _nll_locals(logprobs: DTensor, target: DTensor) -> tuple[Any, Any, tuple[Placement, ...], tuple[Placement, ...], int]:
    placements, row_placements = _nll_layout(logprobs._spec)
    local = logprobs._local if logprobs._spec.placements == placements else redistribute_raw(
        logprobs._local, logprobs._spec, placements)
    ids = target._local if target._spec.placements == row_placements else redistribute_raw(
        target._local, target._spec, row_placements)
    mesh = logprobs._spec.mesh
    start = local_offset(logprobs.shape, placements, mesh.shape, mesh.get_coordinate(), 1)
    return local, ids, placements, row_placements, start


def _all_reduce_over(value: Any, spec_placements: tuple[Placement, ...], mesh: Any, shard: Placement) -> Any:
    p = get_platform()
    for axis, pl in enumerate(spec_placements):
        if pl == shard and mesh.shape[axis] > 1:
            value = p.all_reduce(value, "sum", group=mesh.get_group(axis)).wait()
    return value


def nll_loss_forward(logprobs: DTensor, target: DTensor, reduction: str, ignore_index: int,
                     pick: Callable[[Any, Any, int, int], Any], valid: Callable[[Any, int, Any], Any]) -> tuple[DTensor, DTensor]:
    """``nll_loss`` of ``[N, C]`` log-probabilities (rows or classes sharded, see [Note:
    softmax over a sharded dim]) against ``[N]`` int ``target``, below autograd.

    Args:
        reduction: ``"none"``, ``"sum"`` or ``"mean"`` (over the rows whose target is
            not ``ignore_index``, as torch divides).
        pick: ``(local [n, c], ids [n], start, ignore_index) -> [n]``:
            ``local[r, ids[r] - start]`` where that class is local and ``ids[r]`` is not
            ``ignore_index``, else 0 (the framework's gather).
        valid: ``(ids [n], ignore_index, like) -> [n]``: 1 where ``ids !=
            ignore_index``, else 0, in ``like``'s dtype.

    Returns:
        ``(loss, total_weight)``: ``loss`` ``[N]`` (``"none"``, ``Shard(0)`` where the
        rows are sharded, else ``Replicate``) or a ``Replicate`` scalar; ``total_weight``
        the ``Replicate`` count of valid rows.

    Collectives: the redistributions to the layout above; **all-reduce** (sum) of the
    picks over the class axes, of the sums and counts over the row axes.
    """
    p = get_platform()
    mesh = logprobs._spec.mesh
    local, ids, placements, row_placements, start = _nll_locals(logprobs, target)
    with p.no_grad():
        weight = valid(ids, ignore_index, local)
        rows = -pick(local, ids, start, ignore_index)
        rows = _all_reduce_over(rows, placements, mesh, Shard(1))
        count = _all_reduce_over(weight.sum(), placements, mesh, Shard(0))
        if reduction == "none":
            out, out_spec = rows, DTensorSpec(mesh, row_placements, (int(logprobs.shape[0]),))
        else:
            out = _all_reduce_over(rows.sum(), placements, mesh, Shard(0))
            if reduction == "mean":
                out = out / count
            out_spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, ())
    replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, ())
    return make_dtensor(out, out_spec), make_dtensor(count, replicated)


def nll_loss_backward(grad: DTensor, logprobs: DTensor, target: DTensor, reduction: str, ignore_index: int,
                      total_weight: DTensor, unpick: Callable[[Any, Any, int, Any], Any],
                      valid: Callable[[Any, int, Any], Any]) -> DTensor:
    """The gradient of ``nll_loss_forward`` with respect to the log-probabilities, laid
    out as they are used there (no communication beyond bringing ``grad`` to the rows'
    layout).

    Args:
        grad: the loss's gradient (``[N]`` for ``"none"``, else a scalar).
        logprobs: the forward's ``[N, C]`` log-probabilities (floating).
        target: the forward's ``[N]`` integer class ids.
        reduction: ``"none"``, ``"sum"`` or ``"mean"``, as in the forward.
        ignore_index: the class id whose rows get no gradient.
        total_weight: the forward's count of rows not ignored (a scalar), the divisor
            of ``"mean"``.
        unpick: ``(values [n], ids [n], start, like [n, c]) -> [n, c]``: zeros like
            ``like`` with ``values[r]`` at ``[r, ids[r] - start]`` where that class is
            local (the framework's scatter).
        valid: ``(ids [n], ignore_index, like) -> [n]``: 1 where the row counts, 0
            where its id is ``ignore_index``, in ``like``'s dtype.

    Returns:
        A DTensor ``[N, C]`` of ``logprobs``' dtype, laid out as the forward used the
        log-probabilities (rows or classes sharded).
    """
    p = get_platform()
    mesh = logprobs._spec.mesh
    local, ids, placements, row_placements, start = _nll_locals(logprobs, target)
    g_spec = grad._spec
    g_target = row_placements if reduction == "none" else (Replicate(),) * mesh.ndim
    g = grad._local if g_spec.placements == g_target else redistribute_raw(grad._local, g_spec, g_target)
    with p.no_grad():
        weight = valid(ids, ignore_index, local)
        if reduction == "mean":
            g = g / total_weight._local
        out = unpick(-(g * weight), ids, start, local)
    return make_dtensor(out, DTensorSpec(mesh, placements, tuple(int(s) for s in logprobs.shape)))
