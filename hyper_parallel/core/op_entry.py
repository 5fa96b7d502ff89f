"""The one entry from a backend's DTensor class into core: what the class may call.

[Note: the backend entry]
A backend's DTensor class (``Platform.dtensor_type``) intercepts the framework's ops on
DTensors and runs local calls; it plans nothing. Every op it intercepts goes to one of
the functions below, which plan with core's rules (``OP_RULES`` and the fused-kernel
plans), redistribute, call back the local function the backend gave and wrap the
result. The backend reaches this module through ``base.entry()`` (``base``: core's
``DTensor``, handed to ``dtensor_type``), never by importing core: the platform sits
below core (import-linter contract in ``pyproject.toml``).

This module sits above ``core/dtensor`` and ``core/context_parallel`` (it names both
frameworks' fused attention kernels, whose plans live there). ``DTensor.entry`` imports it
at call time: the one import from ``core/dtensor`` back up, listed as the one exception
of the no-cycle contract, because the class DTensors have is built (by the platform, on
first use) from core's ``DTensor`` and this entry, and the entry's plans make DTensors.

Functions (each documented where it is defined):

- ``dispatch_op``: an intercepted op below the framework's autograd (torch's
  ``__torch_dispatch__``): ``dispatch.dispatch_local``.
- ``dispatch_explicit``: an intercepted op above autograd (MindSpore's ``__fallback__``;
  torch's few composite functions): ``dispatch.dispatch``.
- ``local_plan`` / ``check_result`` / ``freeze_params``: a backend's per-op plan cache;
  ``explicit_local_plan`` / ``to_local_with_grad_placements``: the same above autograd
  (MindSpore's ``__fallback__``).
- ``dispatch_split``: a split or chunk into pieces along one dim.
- ``dispatch_aligned`` / ``sharded_dim_axis`` / ``softmax_sharded`` / ``nll_loss_forward``
  / ``nll_loss_backward``: fused ops with several outputs, softmax and nll over a sharded
  class dim (``dtensor/fused_dispatch.py``).
- ``flash_attention_score``: MindSpore's ``FlashAttentionScore`` primitive on DTensors
  (``context_parallel/flash_attention_score.py``).
- ``replicated_operands`` / ``mixed_operand_message``: framework tensors among DTensors.
- ``recorded_rules`` / ``record_rule`` / ``recording``: which rule each op reached
  ([Note: recorded rules]).
- ``dispatch_skipped`` / ``skip_depth``: ``SkipDTensorDispatch``.
- ``full_local``: the whole tensor on this rank, outside autograd; ``replicated``: a
  tensor every rank makes whole as a ``Replicate`` DTensor.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hyper_parallel.core.context_parallel import flash_attention_score as _flash_attention_score
from hyper_parallel.core.dtensor import dispatch as _dispatch
from hyper_parallel.core.dtensor import fused_dispatch as _fused
from hyper_parallel.core.dtensor import random as _random
from hyper_parallel.core.dtensor.dispatch import (
    check_result,
    dispatch_skipped,
    explicit_local_plan,
    freeze_params,
    full_local,
    mixed_operand_message,
    replicated_operands,
    skip_depth,
)
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.op_rules import OP_RULES
from hyper_parallel.core.dtensor.redistribute import to_local_with_grad_placements

__all__ = [
    "check_result", "dispatch_aligned", "dispatch_explicit", "dispatch_op", "dispatch_skipped", "dispatch_split",
    "dropout", "dropout_with_mask", "explicit_local_plan", "flash_attention_score", "freeze_params", "full_local", "has_rule", "local_plan",
    "mixed_operand_message", "nll_loss_backward", "nll_loss_forward", "record_rule", "recorded_rules", "recording",
    "replicated", "replicated_operands", "sharded_dim_axis", "skip_depth", "softmax_sharded",
    "to_local_with_grad_placements",
]

# [Note: recorded rules] ``recorded_rules()`` lists the rule core plans each op with, in
# this thread: the conformance test runs the same ops on each backend and compares the
# lists (one route per op). A context variable, so that recording costs one lookup per
# op when off; a backend whose cached fast path skips the entry (torch's plan cache)
# records through ``record_rule`` when ``recording()`` is not None.
_RECORDED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("hyper_parallel_recorded_rules",
                                                                             default=None)
#: the list ops are being recorded into in this thread, or ``None``
recording = _RECORDED.get


@contextlib.contextmanager
def recorded_rules() -> Iterator[list[str]]:
    """Inside, every op a backend hands to core appends the name of the rule core plans it
    with (an ``OP_RULES`` key, ``"split"``, a fused kernel's name; a name without a rule
    takes the replicate fallback) to the yielded list, in call order."""
    token = _RECORDED.set([])
    try:
        yield _RECORDED.get()
    finally:
        _RECORDED.reset(token)


def record_rule(op: str) -> None:
    """Append ``op`` to the list ``recorded_rules`` yields, if one is active."""
    seen = _RECORDED.get()
    if seen is not None:
        seen.append(op)


#: ``local`` (a tensor every rank of ``mesh`` makes whole) as a ``Replicate`` DTensor
replicated = DTensor.replicated


#: inverted dropout from core's stream (``dtensor/random.dropout``, and with its mask):
#: a backend routes the framework's dropout primitives here
dropout = _random.dropout
dropout_with_mask = _random.dropout_with_mask


def has_rule(op: str) -> bool:
    """Whether ``op`` has a sharding rule (else ``dispatch_op`` takes the fallback)."""
    return op in OP_RULES


def dispatch_op(op: str, dtensors: Sequence[DTensor], local_fn: Callable[..., Any], params: Any = None, *,
                inplace: int | None = None, with_local_shape: bool = False) -> Any:
    """An op below the framework's autograd: ``dispatch.dispatch_local``."""
    record_rule(op)
    return _dispatch.dispatch_local(op, dtensors, local_fn, params, inplace=inplace,
                                    with_local_shape=with_local_shape)


def dispatch_explicit(op: str, tensors: Sequence[Any], local_fn: Callable[..., Any], params: Any = None, *,
                      inplace: int | None = None, with_local_shape: bool = False) -> Any:
    """An op above the framework's autograd: ``dispatch.dispatch``."""
    record_rule(op)
    return _dispatch.dispatch(op, tensors, local_fn, params, inplace=inplace, with_local_shape=with_local_shape)


def local_plan(op: str, specs: Sequence[Any], params: Any = None, inplace: int | None = None) -> Any:
    """The plan of an op that needs no communication, for a backend's cache:
    ``dispatch.local_plan`` (records nothing: the op it plans was recorded when it ran)."""
    return _dispatch.local_plan(op, specs, params, inplace)


def dispatch_split(x: DTensor, dim: int, local_fn: Callable[[Any], Sequence[Any]], *,
                   differentiable: bool = True) -> tuple[DTensor, ...]:
    """A split or chunk into pieces along ``dim``: ``dispatch.dispatch_split``."""
    record_rule("split")
    return _dispatch.dispatch_split(x, dim, local_fn, differentiable=differentiable)


def dispatch_aligned(op: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """A fused op with several outputs: ``fused_dispatch.dispatch_aligned``."""
    record_rule(op)
    return _fused.dispatch_aligned(op, *args, **kwargs)


def softmax_sharded(op: str, *args: Any) -> Any:
    """A softmax over a sharded dim: ``fused_dispatch.softmax_sharded``."""
    record_rule(op)
    return _fused.softmax_sharded(op, *args)


def nll_loss_forward(*args: Any) -> Any:
    """``fused_dispatch.nll_loss_forward``: class- or row-sharded log-probabilities."""
    record_rule("nll_loss")
    return _fused.nll_loss_forward(*args)


def nll_loss_backward(*args: Any) -> Any:
    """``fused_dispatch.nll_loss_backward``."""
    record_rule("nll_loss_backward")
    return _fused.nll_loss_backward(*args)


sharded_dim_axis = _fused.sharded_dim_axis


def flash_attention_score(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """MindSpore's ``FlashAttentionScore`` on DTensors, or ``None`` for the rules:
    ``context_parallel.flash_attention_score``."""
    planned = _flash_attention_score.flash_attention_score(args, kwargs)
    if planned is None:
        return None
    rule, out = planned
    record_rule(rule)
    return out
