"""Contract section: the tensor operations core calls through the platform.

Beyond these, core may call the tensor methods listed in ``TENSOR_METHODS`` directly;
they behave the same on every backend (the conformance suite checks each one).
Factories create tensors on this platform's current device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: Tensor attributes and methods core may use directly on a framework tensor.
#: ``__getitem__`` takes basic slices, and an int64 index tensor on dim 0 (rows, repeats
#: allowed, differentiable). ``__setitem__`` writes a tensor into basic slices in place
#: (``x[:, a:b] += y`` adds into a part of ``x`` on every backend); ``__iadd__`` gives
#: ``x + y``, in place where the framework does it (torch; MindSpore returns a new
#: tensor), so use its result. Neither is for tensors autograd records.
TENSOR_METHODS: tuple[str, ...] = (
    "shape", "dtype", "ndim", "dim", "numel", "reshape", "view", "permute", "transpose",
    "contiguous", "is_contiguous", "unsqueeze", "squeeze", "flatten", "sum", "mean",
    "amax", "exp", "log", "float", "__getitem__", "__setitem__",
    "__add__", "__iadd__", "__sub__", "__mul__", "__truediv__", "__neg__", "__matmul__",
)

#: The framework functions ``local_op(name)`` returns, with the signature each one has
#: (the DTensor op rules run them on local tensors; see ``local_op``).
LOCAL_OPS: tuple[str, ...] = (
    "softmax", "log_softmax", "embedding", "cross_entropy", "silu", "gelu", "relu", "sigmoid", "tanh",
    "sqrt", "rsqrt", "pow", "abs", "masked_embedding",
)


class OpsSection(ABC):
    """Tensor factories, shape ops and conversions (attention: ``contract.attention``)."""

    @abstractmethod
    def zeros(self, shape: Sequence[int], dtype: Any, *, fill: bool = True) -> Any:
        """A tensor of ``shape`` and framework ``dtype`` filled with zeros; ``fill=False``:
        its values are unspecified (``torch.empty``), for a buffer a collective or a kernel
        overwrites whole (a receive buffer), which saves the fill kernel. A backend may
        zero it anyway; nothing may read it before it is written."""

    @abstractmethod
    def full(self, shape: Sequence[int], value: float, dtype: Any) -> Any:
        """A tensor of ``shape`` and framework ``dtype`` filled with ``value``."""

    @abstractmethod
    def arange(self, start: int, end: int, dtype: Any) -> Any:
        """``[start, start + 1, ..., end - 1]`` as a 1-D tensor."""

    @abstractmethod
    def from_numpy(self, array: np.ndarray) -> Any:
        """A tensor with ``array``'s values, shape and dtype (copied to the device)."""

    @abstractmethod
    def to_numpy(self, tensor: Any) -> np.ndarray:
        """A host numpy copy of ``tensor`` (bfloat16 is widened to float32)."""

    @abstractmethod
    def cat(self, tensors: Sequence[Any], dim: int = 0) -> Any:
        """Concatenate along ``dim``; differentiable."""

    @abstractmethod
    def split(self, tensor: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
        """Pieces of the given sizes (zero allowed) along ``dim``; differentiable.

        Raises:
            ValueError: ``sizes`` do not sum to ``tensor.shape[dim]``.
        """

    @abstractmethod
    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        """Rows ``start .. start + length`` of ``dim``; differentiable."""

    @abstractmethod
    def pad(self, tensor: Any, dim: int, before: int, after: int, value: float = 0.0) -> Any:
        """Pad ``dim`` with ``before`` and ``after`` entries of ``value``; differentiable."""

    @abstractmethod
    def to_dtype(self, tensor: Any, dtype: Any) -> Any:
        """Cast to framework ``dtype``; differentiable for floating dtypes."""

    @abstractmethod
    def detach(self, tensor: Any) -> Any:
        """``tensor``'s values cut from autograd: no gradient flows back through the
        result (torch ``Tensor.detach``, MindSpore ``ops.stop_gradient``)."""

    @abstractmethod
    def clone(self, tensor: Any) -> Any:
        """A copy of ``tensor`` in its own memory; differentiable (the gradient passes
        through unchanged)."""

    @abstractmethod
    def local_op(self, name: str) -> Callable[..., Any]:
        """The framework's differentiable implementation of the named op (one of
        ``LOCAL_OPS``), on local tensors of any floating dtype:

        - ``softmax(x, dim)``, ``log_softmax(x, dim)``: along ``dim``, shape kept.
        - ``embedding(ids, weight)``: ``ids`` integer ``[*]``, ``weight`` ``[vocab, dim]``
          -> ``[*, dim]`` (rows of ``weight``; gradient to ``weight`` only).
        - ``cross_entropy(logits, target, reduction)``: ``logits`` ``[N, C]``, ``target``
          int64 ``[N]`` class indices, ``reduction`` ``"none"`` (-> ``[N]``), ``"sum"`` or
          ``"mean"`` (-> ``[]``); natural log, no ignore index, no label smoothing.
        - ``silu(x)``, ``gelu(x)`` (exact erf form), ``relu(x)``, ``sigmoid(x)``,
          ``tanh(x)``, ``sqrt(x)``, ``rsqrt(x)``: elementwise.
        - ``pow(x, exponent)``: elementwise ``x ** exponent`` for a Python float exponent.
        - ``abs(x)``: elementwise.
        - ``masked_embedding(ids, weight, start)``: ``weight`` ``[rows, dim]`` holds rows
          ``start .. start + rows`` of a larger table; ids in that range give their row,
          other ids zeros -> ``[*, dim]`` (vocabulary-parallel embedding; gradient to
          ``weight`` only; ``rows`` may be 0).

        Raises:
            ValueError: ``name`` is not in ``LOCAL_OPS``.
        """
