"""The aten ops a torch DTensor runs through core's fused dispatch
(``core/dtensor/fused_dispatch.py``, reached through ``entry``: [Note: the backend entry]
in ``core/op_entry.py``) rather than through a single-output rule: the fused
attention kernels ``F.scaled_dot_product_attention`` picks (forward and backward; see
[Note: fused ops with several outputs]), and ``softmax`` / ``log_softmax`` / ``nll_loss``
over class-sharded logits (see [Note: softmax over a sharded dim]), into which
``F.cross_entropy`` decomposes. ``route`` returns ``NOT_ROUTED`` for any other call,
which then takes its rule.

These run below autograd, as torch's DTensor runs its attention and ``loss_parallel``
handlers: the DTensor class's ``__torch_function__`` is torch's disabled one, so torch's
own functions decompose to these aten ops unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

NOT_ROUTED = object()

#: the fused attention kernels of torch 2.13 (CPU flash; CUDA flash, memory-efficient,
#: cuDNN; the out-of-tree backends' overrideable one); each has a ``_backward`` op
_ATTENTION = frozenset({
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
})
_SOFTMAX = {"_softmax": "softmax", "_log_softmax": "log_softmax", "_softmax_backward_data": "softmax_backward",
            "_log_softmax_backward_data": "log_softmax_backward"}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch's Reduction enum


def route(entry: Any, cls: type, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          check_mixed: Callable[[Any, Sequence[Any]], None]) -> Any:
    """The result of an aten op ``func`` (``name``: its packet's name) on DTensors of
    ``cls`` when this module handles it, else ``NOT_ROUTED``.

    Raises:
        RuntimeError: a plain tensor with dims among the DTensors (``check_mixed``).
    """
    if name in _ATTENTION or (name.endswith("_backward") and name[: -len("_backward")] in _ATTENTION):
        return _attention(entry, cls, name, func, args, kwargs, check_mixed)
    if name in _SOFTMAX and not kwargs:
        return _softmax(entry, cls, name, args)
    if name in ("nll_loss_forward", "nll_loss_backward") and not kwargs:
        return _nll_loss(entry, cls, name, args)
    return NOT_ROUTED


def _attention(entry: Any, cls: type, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               check_mixed: Callable[[Any, Sequence[Any]], None]) -> Any:
    """A fused attention kernel: ``q, k, v`` ``[batch, heads, seq, head_dim]`` planned
    by the ``attention`` rule (batch or heads sharded), the other tensors of the call
    laid out along (see [Note: fused ops with several outputs])."""
    backward = name.endswith("_backward")
    first = 1 if backward else 0  # the backward ops take the output's gradient first
    q, k, v = args[first:first + 3]
    if not all(isinstance(t, cls) for t in (q, k, v)) or q.dim() != 4:
        return NOT_ROUTED
    flat, tree = tree_flatten((args, kwargs))
    check_mixed(func, flat)
    positions = [i for i, leaf in enumerate(flat) if isinstance(leaf, cls)]
    dtensors = [flat[i] for i in positions]
    # q, k, v come first among the leaves after the gradient (nothing before them nests)
    ruled = [positions.index(first + j) for j in range(3)]
    follow = [ruled.index(k_) if k_ in ruled else (0 if t.dim() >= 3 else None) for k_, t in enumerate(dtensors)]
    lead_shape = (int(q.shape[0]), int(q.shape[1]))
    # the backward ops that return the bias's gradient take the bias fifth
    bias = args[4] if name in ("_scaled_dot_product_efficient_attention_backward",
                               "_scaled_dot_product_fused_attention_overrideable_backward") else None

    def local_fn(*locals_: Any) -> Sequence[Any]:
        filled = list(flat)
        for i, local in zip(positions, locals_):
            filled[i] = local
        local_args, local_kwargs = tree_unflatten(filled, tree)
        return func(*local_args, **local_kwargs)

    def outputs(values: Sequence[Any]) -> list[Any]:
        entries: list[Any] = []
        for index, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                entries.append(None)
            elif backward and index < 3:
                entries.append((tuple((q, k, v)[index].shape), index))
            elif backward and index == 3 and isinstance(bias, cls) and value.dim() == bias.dim():
                entries.append((tuple(bias.shape), 0))
            elif not backward and index == 0:
                entries.append((tuple(q.shape[:-1]) + (int(v.shape[-1]),), 0))
            elif value.dim() >= 3:
                # the log-sum-exp [b, h, s] (and a debug mask): batch and heads as q's
                entries.append((lead_shape + tuple(value.shape[2:]), 0))
            else:
                entries.append((tuple(value.shape), None))  # seeds, offsets: replicated
        return entries

    return entry.dispatch_aligned("scaled_dot_product_attention", dtensors, ruled, follow, local_fn,
                                           outputs)


def _softmax(entry: Any, cls: type, name: str, args: tuple[Any, ...]) -> Any:
    """``_softmax(x, dim, half_to_float)`` / ``_log_softmax`` and their backward
    ``(grad, y, dim, input_dtype)`` over a dim one mesh axis shards."""
    backward = name.endswith("_data")
    x = args[0]
    tensors = args[:2] if backward else args[:1]
    if not all(isinstance(t, cls) for t in tensors):
        return NOT_ROUTED
    dim = int(args[2] if backward else args[1]) % x.dim()
    if (backward and (args[3] != x.dtype or args[1].shape != x.shape)) or (not backward and args[2]):
        return NOT_ROUTED  # a dtype change (half_to_float): the rule's path
    axis = entry.sharded_dim_axis(x._spec, dim)
    if axis is None:
        return NOT_ROUTED
    return entry.softmax_sharded(_SOFTMAX[name], list(tensors), dim, axis)


def _pick(local: torch.Tensor, ids: torch.Tensor, start: int, ignore_index: int) -> torch.Tensor:
    index = ids - start
    held = (index >= 0) & (index < local.shape[1]) & (ids != ignore_index)
    if local.shape[1] == 0:
        return local.new_zeros(local.shape[:1])
    got = local.gather(1, torch.where(held, index, 0).unsqueeze(1)).squeeze(1)
    return torch.where(held, got, got.new_zeros(()))


def _unpick(values: torch.Tensor, ids: torch.Tensor, start: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    if like.shape[1] == 0:
        return out
    index = ids - start
    held = (index >= 0) & (index < like.shape[1])
    values = torch.where(held, values.to(like.dtype), values.new_zeros((), dtype=like.dtype))
    return out.scatter_(1, torch.where(held, index, 0).unsqueeze(1), values.unsqueeze(1))


def _valid(ids: torch.Tensor, ignore_index: int, like: torch.Tensor) -> torch.Tensor:
    return (ids != ignore_index).to(like.dtype)


def _nll_loss(entry: Any, cls: type, name: str, args: tuple[Any, ...]) -> Any:
    """``nll_loss_forward(logprobs [N, C], target [N], weight, reduction, ignore_index)``
    and ``nll_loss_backward(grad, logprobs, target, weight, reduction, ignore_index,
    total_weight)`` without class weights: rows or classes sharded, never gathered."""
    backward = name == "nll_loss_backward"
    logprobs, target, weight, reduction, ignore_index = args[1:6] if backward else args[:5]
    if (not isinstance(logprobs, cls) or not isinstance(target, cls) or weight is not None
            or logprobs.dim() != 2 or target.dim() != 1 or reduction not in _REDUCTIONS):
        return NOT_ROUTED
    if backward:
        grad, total_weight = args[0], args[6]
        if not isinstance(grad, cls) or not isinstance(total_weight, cls):
            return NOT_ROUTED
        return entry.nll_loss_backward(grad, logprobs, target, _REDUCTIONS[reduction], int(ignore_index),
                                                total_weight, _unpick, _valid)
    return entry.nll_loss_forward(logprobs, target, _REDUCTIONS[reduction], int(ignore_index), _pick,
                                           _valid)
