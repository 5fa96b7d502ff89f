"""Clipping gradients by their global norm over DTensor parameters, on both frameworks.

torch's ``clip_grad_norm_`` already gives the global norm of DTensor parameters (their
gradients are DTensors, and the norm is a ``NormPartial``). MindSpore's
``value_and_grad`` returns each DTensor parameter's gradient as a plain tensor holding its
local piece, so ``mindspore.ops.clip_by_global_norm`` sees pieces; these functions take
the parameters alongside, whose specs say what each piece is.

[Note: a global norm from pieces]
Each rank adds ``|piece|^p`` of every gradient, divided by the number of ranks of the
parameter's mesh that hold the same piece (the product of its ``Replicate`` axes' sizes),
and one **all-reduce** (sum) over the world adds the ranks' sums: the sum over the whole
gradients, each element once. ``p = inf``: the maxima, all-reduced by max. A ``Partial``
gradient is reduced first. A rank outside a parameter's mesh holds nothing of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.core.dtensor.redistribute import redistribute_raw
from hyper_parallel.platform import get_platform
from hyper_parallel.core.tensor_ops import dtype_name, stack


def _local_piece(param: DTensor, grad: Any) -> Any:
    """The gradient's local piece laid out as the parameter (a ``Partial`` reduced)."""
    if not isinstance(grad, DTensor):
        return grad
    target = tuple(Replicate() if pl.is_partial() else pl for pl in param.placements)
    return grad._local if grad.placements == target else redistribute_raw(grad._local, grad.spec, target)


def global_grad_norm(parameters: Sequence[Any], grads: Sequence[Any], norm_type: float = 2.0) -> Any:
    """The ``norm_type``-norm of all of ``grads`` taken whole (every mesh axis, each
    element once), as a 0-dim float32 (float64 for float64 gradients) framework tensor,
    the same on every rank.

    Args:
        parameters: the DTensor parameters, one per gradient.
        grads: each parameter's gradient: a DTensor (torch's ``.grad``) or this rank's
            local piece (MindSpore's ``value_and_grad``); ``None`` for none.
        norm_type: ``p > 0`` or ``float("inf")``.

    Collectives: one **all-reduce** (sum; max for ``inf``) over the world.

    Raises:
        TypeError: a parameter that is not a DTensor (its layout is unknown).
        ValueError: ``norm_type <= 0``, or as many gradients as parameters not given.
    """
    p = get_platform()
    params, grads = list(parameters), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"global_grad_norm: {len(params)} parameters but {len(grads)} gradients; give one "
                         "gradient (or None) per parameter")
    if not norm_type > 0:
        raise ValueError(f"global_grad_norm: norm_type={norm_type!r}; use a p-norm with p > 0, or float('inf')")
    infinite = norm_type == float("inf")
    # float32 or better, as torch's clip_grad_norm_ accumulates; decided from the
    # parameters' dtypes, which every rank sees alike (a dtype from the local gradients
    # could differ between ranks, and so the all-reduce's)
    wide = "float64" if any(isinstance(q, DTensor) and dtype_name(q.dtype) == "float64" for q in params) \
        else "float32"
    dtype = p.dtype(wide)
    terms = []
    for index, (param, grad) in enumerate(zip(params, grads)):
        if not isinstance(param, DTensor):
            raise TypeError(f"global_grad_norm: parameter {index} is a {type(param).__name__}, not a DTensor; its "
                            "layout over the ranks is unknown. Make parameters DTensors (distribute_tensor) or "
                            "compute the norm of plain replicated gradients with the framework's own function")
        if grad is None or param.device_mesh.get_coordinate() is None:
            continue
        magnitude = p.to_dtype(_local_piece(param, grad), dtype).abs()
        if infinite:
            terms.append(magnitude.amax(tuple(range(magnitude.ndim))) if magnitude.ndim else magnitude)
            continue
        copies = 1
        for axis, placement in enumerate(param.placements):
            if placement.is_replicate():
                copies *= param.device_mesh.shape[axis]
        terms.append(magnitude.pow(float(norm_type)).sum() * (1.0 / copies))
    if not terms:
        total = p.zeros((), dtype)
    else:
        stacked = stack(terms)
        total = stacked.amax((0,)) if infinite else stacked.sum()
    if p.world_size() > 1:
        total = p.all_reduce(total, "max" if infinite else "sum").wait()
    return total if infinite else total.pow(1.0 / norm_type)


def clip_grads_by_global_norm(parameters: Sequence[Any], grads: Sequence[Any], max_norm: float,
                              norm_type: float = 2.0) -> tuple[list[Any], Any]:
    """``grads`` scaled by ``min(1, max_norm / (norm + 1e-6))`` (torch's
    ``clip_grad_norm_`` rule), where ``norm`` is ``global_grad_norm``; returns the scaled
    gradients (new tensors, the same kinds as given) and the norm. For MindSpore, where
    ``ops.clip_by_global_norm`` of ``value_and_grad``'s local pieces would clip by the norm
    of this rank's pieces only.

    Collectives and errors: those of ``global_grad_norm``.
    """
    p = get_platform()
    total = global_grad_norm(parameters, grads, norm_type)
    norm = float(p.to_numpy(total))
    scale = min(1.0, max_norm / (norm + 1e-6))
    if scale == 1.0:
        return list(grads), total
    return [None if g is None else g * scale for g in grads], total
