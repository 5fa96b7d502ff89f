"""Contract section: the tensor operations core calls through the platform.

Beyond these, core may call the tensor methods listed in ``TENSOR_METHODS`` directly;
they behave the same on every backend (the conformance suite checks each one).
Factories create tensors on this platform's current device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from hyper_parallel.platform.contract.common import Activation

#: Tensor attributes and methods core may use directly on a framework tensor.
#: ``__getitem__`` takes basic slices, and an int64 index tensor on dim 0 (rows, repeats
#: allowed, differentiable). ``__setitem__`` writes a tensor into basic slices in place
#: (``x[:, a:b] += y`` adds into a part of ``x`` on every backend); ``__iadd__`` gives
#: ``x + y``, in place where the framework does it (torch; MindSpore returns a new
#: tensor), so use its result. Neither is for tensors autograd records.
#: ``abs``, ``pow(exponent)`` (a Python float), ``sqrt``, ``rsqrt``, ``sigmoid``, ``tanh``,
#: ``erf``: elementwise and differentiable. ``clamp(min, max)`` bounds values (integer
#: ids here). ``>``, ``>=``, ``<`` against a Python number give a bool tensor (cast it
#: with ``to_dtype`` before arithmetic).
TENSOR_METHODS: tuple[str, ...] = (
    "shape", "dtype", "ndim", "dim", "numel", "reshape", "view", "permute", "transpose",
    "contiguous", "is_contiguous", "unsqueeze", "squeeze", "flatten", "sum", "mean",
    "amax", "exp", "log", "float", "__getitem__", "__setitem__",
    "__add__", "__iadd__", "__sub__", "__mul__", "__truediv__", "__neg__", "__matmul__",
    "abs", "pow", "sqrt", "rsqrt", "sigmoid", "tanh", "erf", "clamp", "__gt__", "__ge__", "__lt__",
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
    def softmax(self, x: Any, dim: int, *, log: bool = False) -> Any:
        """Softmax of floating ``x`` along ``dim`` (any shape, kept), by the framework's
        kernel; ``log=True``: log-softmax (the framework's fused one, not ``log`` of the
        softmax). Differentiable."""

    @abstractmethod
    def grouped_matmul(self, x: Any, weight: Any, group_sizes: Sequence[int]) -> Any:
        """The experts' grouped GEMM: ``x`` ``[rows, in]`` holds consecutive groups of
        ``group_sizes[g]`` rows (zeros allowed; one size per group, summing to ``rows``),
        and group ``g``'s rows are multiplied by ``weight[g]`` transposed (``weight``
        ``[groups, out, in]``, Linear's ``[out, in]`` per group) -> ``[rows, out]`` in
        ``x``'s dtype. Differentiable in ``x`` and ``weight``.

        One fused kernel where the framework has one for the device and dtype
        (``Capability.GROUPED_MATMUL``: torch ``torch.nn.functional.grouped_mm``,
        MindSpore's ``GroupedMatmul`` on Ascend); else one matmul per non-empty group,
        which warns once (``platform/grouped_matmul.py``).

        Raises:
            ValueError: shapes that do not match, or ``group_sizes`` not one size >= 0 per
                group summing to ``rows``.
        """

    @abstractmethod
    def activation(self, x: Any, kind: Activation) -> Any:
        """``kind`` (``Activation``) of floating ``x`` elementwise by the framework's fused
        kernel (torch ``F.silu`` / ``F.gelu`` / ``F.relu``; MindSpore ``mint.nn.functional``'s):
        same shape and dtype, differentiable."""

    @abstractmethod
    def cross_entropy(self, logits: Any, target: Any, reduction: str) -> Any:
        """The framework's cross-entropy of ``logits`` ``[N, C]`` (floating) against int64
        class indices ``target`` ``[N]``: natural log, no ignore index, no label
        smoothing; ``reduction`` ``"none"`` (-> ``[N]``), ``"sum"`` or ``"mean"`` (->
        ``[]``). Differentiable in ``logits``. (Not composed from ``softmax``: MindSpore's
        CPU log-softmax loses precision in float64 that its fused loss keeps.)"""
