"""Cross-entropy over class-sharded logits, without gathering them (Megatron-LM's
vocabulary-parallel cross-entropy, Shoeybi et al., 2019; torch's ``loss_parallel``).

[Note: vocabulary-parallel cross-entropy]
Logits ``[N, C]`` sharded ``Shard(1)`` over a mesh axis of ``n`` ranks: rank ``r`` holds
classes ``start_r .. start_r + c_r``. Per row, over the axis's group:

1. ``m = max_c logits`` : **all-reduce** (max) of the local maxima (no gradient: the
   shift cancels in the loss);
2. ``s = sum_c exp(logits - m)`` : **all-reduce** (sum) of the local sums;
3. ``z = logits[target] - m`` : each rank picks the target's logit if it holds that
   class (a one-hot of its classes, ``tensor_ops.masked_embedding``), zeros
   otherwise; **all-reduce** (sum);
4. ``loss = log(s) - z``, the same on every rank of the axis.

The backward needs no communication: the gradient of row ``i``'s loss with respect to
the local logits is ``softmax_local - onehot_local`` (the softmax from step 2's sum),
times the incoming gradient. Memory: one ``[N, c_r]`` buffer each for the softmax and
the one-hot, never the whole ``[N, C]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core import tensor_ops
from hyper_parallel.core.dtensor.dtensor import DTensor, wrap_local
from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec, local_offset, local_shape
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import CustomFunction


class _VocabParallelCrossEntropy(CustomFunction):
    """Forward: steps 1-4 of the note on local tensors (``local`` ``[n, c]`` float,
    ``onehot`` ``[n, c]``). Backward: ``(softmax - onehot) * grad``."""

    @staticmethod
    def forward(ctx: Any, local: Any, onehot: Any, group: Any) -> Any:
        p = get_platform()
        rows = int(local.shape[0])
        m = p.all_reduce(local.amax((1,), True), "max", group=group).wait()
        shifted = local - m
        e = shifted.exp()
        total = p.all_reduce(e.sum((1,), keepdim=False), "sum", group=group).wait()
        picked = p.all_reduce((shifted * onehot).sum((1,), keepdim=False), "sum", group=group).wait()
        ctx.softmax = e / total.reshape(rows, 1)
        ctx.onehot = onehot
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        rows = int(ctx.softmax.shape[0])
        return (ctx.softmax - ctx.onehot) * grad.reshape(rows, 1), None, None


def class_axis(logits: DTensor) -> int | None:
    """The mesh axis that shards the class dim of ``[N, C]`` ``logits`` with no empty
    piece (the first, when several do), or None."""
    mesh = logits.device_mesh
    classes = logits.shape[1]
    for axis, placement in enumerate(logits.placements):
        n = mesh.shape[axis]
        if placement == Shard(1) and -(-classes // n) * (n - 1) < classes:
            return axis
    return None


def vocab_parallel_cross_entropy(logits: DTensor, target: DTensor, axis: int,
                                 ignore_index: int | None = None) -> tuple[DTensor, DTensor | None]:
    """Per-row cross-entropy of ``[N, C]`` float ``logits`` sharded ``Shard(1)`` on mesh
    ``axis``, against int ``target`` ``[N]`` (see [Note: vocabulary-parallel
    cross-entropy]); differentiable with respect to ``logits``.

    Returns ``(loss, valid)``: ``loss`` ``[N]``, ``Shard(0)`` where the rows are sharded,
    else ``Replicate``; ``valid`` (``None`` without ``ignore_index``): ``[N]`` of 1.0 for
    rows whose target is not ``ignore_index`` (their loss is 0), laid out as ``loss``.

    Collectives: the redistributions that bring the other axes to ``Shard(0)`` /
    ``Replicate``; three **all-reduces** (max, sum, sum) of ``[rows]`` over ``axis``.
    """
    p = get_platform()
    mesh = logits.device_mesh
    placements = tuple(Shard(1) if a == axis else pl if pl == Shard(0) else Replicate()
                       for a, pl in enumerate(logits.placements))
    row_placements = tuple(Shard(0) if pl == Shard(0) else Replicate() for pl in placements)
    logits = logits if logits.placements == placements else logits.redistribute(mesh, placements)
    target = target if target.placements == row_placements else target.redistribute(mesh, row_placements)
    local, ids = logits.to_local(), target.to_local()
    coordinate = mesh.get_coordinate()
    start = local_offset(logits.shape, placements, mesh.shape, coordinate, 1)
    classes = local_shape(logits.shape, placements, mesh.shape, coordinate)[1]
    masked = tensor_ops.masked_embedding
    with p.no_grad():
        eye = p.to_dtype(p.from_numpy(np.eye(classes, dtype=np.float32)), local.dtype)
        onehot = masked(ids, eye, start)
        valid = None
        if ignore_index is not None:
            ones = p.to_dtype(p.from_numpy(np.ones((1, 1), np.float32)), local.dtype)
            valid = 1.0 - masked(ids, ones, ignore_index).reshape(-1)
    loss = p.apply_function(_VocabParallelCrossEntropy, local, onehot, mesh.get_group(axis))
    if valid is not None:
        loss = loss * valid
    spec = DTensorSpec(mesh, row_placements, (int(logits.shape[0]),))
    return wrap_local(loss, spec), None if valid is None else wrap_local(valid, spec)
