"""Tensor factories, shape operations, conversions and storage on MindSpore.

[Note: MindSpore CPU kernels]
Several ``mindspore.mint`` operations have no CPU kernel in MindSpore 2.10: ``full``
(FillScalar), ``arange``, ``stack`` (StackExt), ``clone``, ``zeros_like``, ``tril``,
``logsumexp``, ``repeat_interleave`` and ``nn.functional.pad`` (ConstantPadND). Calling
one fails *and* leaves the process's operation queue broken (later operations re-raise
the error), so this backend never calls them: it uses ``ops.full``, numpy, ``cat`` of
unsqueezed tensors and ``cat`` with a filled tensor instead, which work on every device
and are differentiable. Arguments are checked here for the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hyper_parallel.platform.contract.attention import FULL, AttentionMask
from hyper_parallel.platform.contract.common import Activation
from hyper_parallel.platform.contract.ops import OpsSection
from hyper_parallel.platform.grouped_matmul import check_grouped_matmul, looped_grouped_matmul
from hyper_parallel.platform.mindspore import attention as kernels
from hyper_parallel.platform.contract.validation import normalize_dim, refuse_dtensor


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape={list(shape)} has a negative size; sizes are >= 0")
    return dims


class MindSporeOps(OpsSection):
    """Tensor-op members of ``MindSporePlatform``; uses its ``_ms``/``_mint``/``_ops``
    modules and ``_device_type``."""

    _ms: Any
    _mint: Any
    _ops: Any
    _device_type: str

    def zeros(self, shape: Sequence[int], dtype: Any, *, fill: bool = True) -> Any:
        """``mint.zeros``; ``fill=False``: ``mint.empty``."""
        return (self._mint.zeros if fill else self._mint.empty)(_shape(shape), dtype=dtype)

    def full(self, shape: Sequence[int], value: float, dtype: Any) -> Any:
        """``ops.full`` (see [Note: MindSpore CPU kernels]); bfloat16 is filled in float32
        and cast, since ``ops.full`` rejects it."""
        dims = _shape(shape)
        if dtype == self._ms.bfloat16:
            return self._ops.full(dims, value, dtype=self._ms.float32).astype(dtype)
        return self._ops.full(dims, value, dtype=dtype)

    def arange(self, start: int, end: int, dtype: Any) -> Any:
        """Built with numpy and copied to the device (``mint.arange`` has no CPU kernel)."""
        return self._ms.Tensor(np.arange(int(start), int(end), dtype=np.int64)).astype(dtype)

    def from_numpy(self, array: np.ndarray) -> Any:
        """``mindspore.Tensor(array)``, which copies (``mindspore.from_numpy`` would share
        the numpy buffer)."""
        # np.ascontiguousarray would turn a 0-d array into shape (1,).
        return self._ms.Tensor(array if array.flags.c_contiguous else np.ascontiguousarray(array))

    def to_numpy(self, tensor: Any) -> np.ndarray:
        """``Tensor.asnumpy()`` copied (on CPU it shares the tensor's memory)."""
        refuse_dtensor(tensor, "to_numpy")
        if tensor.dtype == self._ms.bfloat16:
            tensor = tensor.astype(self._ms.float32)
        return np.array(tensor.asnumpy(), copy=True)

    def cat(self, tensors: Sequence[Any], dim: int = 0) -> Any:
        """``mint.cat``."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError("cat: tensors is empty; give at least one tensor")
        return self._mint.cat(tensors, normalize_dim(dim, tensors[0].ndim))

    def split(self, tensor: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
        """``mint.split`` with a list of sizes."""
        dim = normalize_dim(dim, tensor.ndim)
        sizes = list(sizes)
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in sizes):
            raise ValueError(f"split: sizes={sizes} must be non-negative ints")
        if sum(sizes) != tensor.shape[dim]:
            raise ValueError(f"split: sizes={sizes} sum to {sum(sizes)}, but tensor.shape[{dim}] is "
                             f"{tensor.shape[dim]}; the sizes must add up to it")
        return list(self._mint.split(tensor, sizes, dim))

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        """``mint.narrow``."""
        dim = normalize_dim(dim, tensor.ndim)
        size = tensor.shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"narrow: rows {start} .. {start + length} are outside dim {dim} of size {size}; "
                             "use 0 <= start and start + length <= size")
        return self._mint.narrow(tensor, dim, start, length)

    def pad(self, tensor: Any, dim: int, before: int, after: int, value: float = 0.0) -> Any:
        """``cat`` with filled tensors (``ConstantPadND`` has no CPU kernel)."""
        dim = normalize_dim(dim, tensor.ndim)
        if before < 0 or after < 0:
            raise ValueError(f"pad: before={before}, after={after} must be >= 0; use narrow to cut")
        parts = []
        for count in (before, after):
            shape = list(tensor.shape)
            shape[dim] = count
            parts.append(self.full(shape, value, tensor.dtype) if count else None)
        pieces = [piece for piece in (parts[0], tensor, parts[1]) if piece is not None]
        return pieces[0] if len(pieces) == 1 else self._mint.cat(pieces, dim)

    def to_dtype(self, tensor: Any, dtype: Any) -> Any:
        """``Tensor.astype``."""
        return tensor.astype(dtype)

    def detach(self, tensor: Any) -> Any:
        """``ops.stop_gradient`` (MindSpore tensors have no ``detach``)."""
        return self._ops.stop_gradient(tensor)

    def softmax(self, x: Any, dim: int, *, log: bool = False) -> Any:
        """``mint.nn.functional.softmax``; ``ops.log_softmax`` for ``log=True``
        (``LogSoftmaxExt`` is unregistered on CPU in MindSpore 2.10)."""
        if log:
            return self._ops.log_softmax(x, axis=dim)
        return self._mint.nn.functional.softmax(x, dim=dim)

    def activation(self, x: Any, kind: Activation) -> Any:
        """``mint.nn.functional.silu`` / ``relu``; ``ops.gelu(approximate="none")`` (GeluExt,
        mint's, is unregistered on CPU in MindSpore 2.10)."""
        if kind is Activation.GELU:
            return self._ops.gelu(x, approximate="none")
        return getattr(self._mint.nn.functional, kind.value)(x)

    def grouped_matmul(self, x: Any, weight: Any, group_sizes: Sequence[int]) -> Any:
        """Ascend: ``GroupedMatmul`` (``ops.auto_generate.grouped_matmul``, one tensor in and
        out, ``split_item=3``, ``group_type=0``, cumulative ``group_list``: the form its
        backward supports; float16 / bfloat16 / float32). CPU: no such kernel, one
        ``matmul`` per group (``platform/grouped_matmul.py``)."""
        sizes = check_grouped_matmul(x, weight, group_sizes)
        if self._device_type != "ascend":
            return looped_grouped_matmul(self, x, weight, sizes, "MindSpore has no GroupedMatmul kernel on CPU")
        group_list = self._ms.Tensor(np.cumsum(sizes, dtype=np.int64))
        return self._ops.auto_generate.grouped_matmul([x], [weight], group_list=group_list, split_item=3, group_type=0, transpose_b=True)[0]

    def cross_entropy(self, logits: Any, target: Any, reduction: str) -> Any:
        """``ops.cross_entropy``."""
        return self._ops.cross_entropy(logits, target, reduction=reduction)

    def check_attention(self, q: Any, k: Any, v: Any, mask: AttentionMask = FULL) -> None:
        kernels.check(self, q, k, v, mask)

    def attention(self, q: Any, k: Any, v: Any, *, scale: float | None = None,
                  mask: AttentionMask = FULL) -> tuple[Any, Any]:
        """``(out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] float32, float64 for float64
        inputs)``. CPU: a tiled FlashAttention-2 forward in float32 (float64 for float64
        inputs), ``O(seq x tile)`` memory ([Note: MindSpore CPU attention tiles] in
        ``mindspore/attention.py``). Ascend: the ``FlashAttentionScore`` primitive
        (float16/bfloat16, head_dim a multiple of 16 up to 512). Packed documents run on
        ``attention_pieces``. Not recorded by autograd."""
        return kernels.attention(self, q, k, v, scale=scale, mask=mask)

    def attention_backward(self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *,
                           scale: float | None = None, mask: AttentionMask = FULL) -> tuple[Any, Any, Any]:
        """``(dq, dk, dv)`` like ``q``, ``k``, ``v`` from the output gradient and the
        (possibly global, see [Note: attention kernels]) ``out``/``lse``. CPU: the
        recomputing tiled FlashAttention-2 backward; Ascend: ``FlashAttentionScoreGrad``
        given ``softmax_max = lse``, ``softmax_sum = 1``. Not recorded by autograd."""
        return kernels.attention_backward(self, dout, q, k, v, out, lse, scale=scale, mask=mask)
