"""Local ops on framework tensors, written once from the platform contract.

Each function here takes plain framework tensors (a rank's local shards) and composes the
result from ``Platform`` members and the tensor methods of ``TENSOR_METHODS``, which
behave the same on every backend (``tests/platform_contract/test_ops.py`` checks them).
The DTensor op rules run them on local tensors; nothing here communicates.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform import Activation, get_platform


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
    if p.dtype_name(flat.dtype) != "int64":
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
