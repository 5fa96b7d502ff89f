"""Local ops on framework tensors, written once from the platform contract.

Each function here takes plain framework tensors (a rank's local shards) and composes the
result from ``Platform`` members and the tensor methods of ``TENSOR_METHODS``, which
behave the same on every backend (``tests/platform_contract/test_ops.py`` checks them).
The DTensor op rules run them on local tensors; nothing here communicates.
"""

from __future__ import annotations

from typing import Any

from collections.abc import Sequence

from hyper_parallel.platform import Activation, get_platform
from hyper_parallel.platform.contract.types import DTYPE_NAMES
from hyper_parallel.platform.contract.validation import normalize_dim


def dtype_name(dtype: Any) -> str:
    """The name in ``DTYPE_NAMES`` of a framework dtype: the inverse of
    ``Platform.dtype(name)``, so the backend's table is the one place the pairs are
    written.

    Raises:
        ValueError: the dtype has no name in ``DTYPE_NAMES`` (the message lists them).
    """
    p = get_platform()
    for name in DTYPE_NAMES:
        try:
            if p.dtype(name) == dtype:
                return name
        except ValueError:  # a name this backend has no dtype for
            continue
    raise ValueError(f"dtype_name: {dtype!r} has no hyper_parallel name; supported: {', '.join(DTYPE_NAMES)}")


def stack(tensors: Sequence[Any], dim: int = 0) -> Any:
    """Stack equal-shaped tensors along a new ``dim`` (``[*shape]`` each ->
    ``[..., len(tensors) at dim, ...]``): a ``cat`` of the tensors unsqueezed at ``dim``
    (MindSpore 2.10 has no CPU kernel for ``mint.stack``); differentiable.

    Raises:
        ValueError: ``tensors`` is empty, or their shapes differ.
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: tensors is empty; give at least one tensor")
    dim = normalize_dim(dim, tensors[0].ndim + 1)
    if any(tuple(t.shape) != tuple(tensors[0].shape) for t in tensors):
        raise ValueError(f"stack: shapes differ ({[tuple(t.shape) for t in tensors]}); stack needs equal shapes")
    return get_platform().cat([t.unsqueeze(dim) for t in tensors], dim)


def clone(x: Any) -> Any:
    """A copy of ``x`` in its own memory, same shape and dtype; differentiable (the
    gradient passes through unchanged). A one-piece ``cat``: one copy kernel on every
    backend (MindSpore 2.10 has no CPU kernel for ``clone``); a 0-dim tensor goes through
    one dim, since ``cat`` refuses 0-dim tensors."""
    p = get_platform()
    if x.ndim == 0:
        return p.cat([x.reshape((1,))]).reshape(())
    return p.cat([x])


def relu(x: Any) -> Any:
    """``max(x, 0)`` elementwise, the framework's kernel; the gradient is 0 where ``x <= 0``."""
    return get_platform().activation(x, Activation.RELU)


def silu(x: Any) -> Any:
    """``x * sigmoid(x)`` elementwise, the framework's fused kernel."""
    return get_platform().activation(x, Activation.SILU)


def gelu(x: Any) -> Any:
    """The exact (erf) GELU, ``x * (1 + erf(x / sqrt(2))) / 2``, elementwise, the
    framework's kernel."""
    return get_platform().activation(x, Activation.GELU)


def _rows(weight: Any, ids: Any) -> Any:
    """``weight[ids]`` for integer ``ids`` of any shape: ``[*ids.shape, dim]``."""
    p = get_platform()
    flat = ids.reshape(-1)
    if dtype_name(flat.dtype) != "int64":
        flat = p.to_dtype(flat, p.dtype("int64"))
    return weight[flat].reshape(*tuple(ids.shape), int(weight.shape[1]))


def embedding(ids: Any, weight: Any) -> Any:
    """Rows of ``weight`` ``[vocab, dim]`` at integer ``ids`` ``[*]`` -> ``[*, dim]``;
    the gradient goes to ``weight`` only."""
    return _rows(weight, ids)


def masked_embedding(ids: Any, weight: Any, start: int) -> Any:
    """The vocabulary-parallel lookup: ``weight`` ``[rows, dim]`` holds rows ``start ..
    start + rows`` of a larger table; ids in that range give their row, other ids zeros
    -> ``[*, dim]`` (gradient to ``weight`` only; ``rows`` may be 0)."""
    p = get_platform()
    rows = int(weight.shape[0])
    if rows == 0:
        return p.zeros((*tuple(ids.shape), int(weight.shape[1])), weight.dtype)
    local = ids - start
    valid = p.to_dtype(local >= 0, weight.dtype) * p.to_dtype(local < rows, weight.dtype)
    return _rows(weight, local.clamp(0, rows - 1)) * valid.unsqueeze(-1)
