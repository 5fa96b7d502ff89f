"""Value types shared by every section of the contract: ReduceOp, Capability, MemoryStats, Work,
P2POp."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ReduceOp(enum.Enum):
    """Reduction applied by ``all_reduce`` / ``reduce_scatter_tensor``.

    ``AVG`` is the element-wise mean over the ranks of the group (the sum divided by the
    group size, computed in the tensor's dtype).
    """

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: ReduceOp | str, *, argument: str = "op") -> ReduceOp:
        """Return ``op`` as a ReduceOp; accepts the enum or its lower-case value.

        Raises:
            ValueError: ``op`` names no reduction; the message lists the accepted ones.
        """
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            for member in cls:
                if member.value == op.lower():
                    return member
        accepted = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{argument}={op!r} is not a reduce op; use one of {accepted} (or hyper_parallel.ReduceOp)")


class Activation(enum.Enum):
    """An elementwise activation ``Platform.activation`` runs with the framework's kernel."""

    SILU = "silu"  # x * sigmoid(x) (swish)
    GELU = "gelu"  # the exact (erf) form, x * (1 + erf(x / sqrt(2))) / 2
    RELU = "relu"  # max(x, 0); gradient 0 where x <= 0


class Capability(enum.Enum):
    """What a backend can do natively. A member missing from ``Platform.capabilities()``
    is either emulated (the ``NATIVE_*`` ones: same results, more traffic) or absent
    (then core must not call the feature; tests skip with the reason)."""

    NATIVE_ALL_TO_ALL = "native all_to_all_single"
    NATIVE_REDUCE_SCATTER = "native reduce_scatter_tensor"
    NATIVE_ALL_GATHER_INTO_TENSOR = "native all_gather_into_tensor"
    NATIVE_BATCH_P2P = "native batch_isend_irecv"
    ASYNC_COLLECTIVES = "collectives with async_op=True run in the background"
    STREAMS = "device streams and events (not no-ops)"
    FUSED_ATTENTION = "attention and its backward run by a fused kernel of the framework (not tiled plain ops)"
    OUTPUT_RECOMPUTE = "recompute(output_recompute=True): adjacent recomputed regions merged (MindSpore's own)"
    GROUPED_MATMUL = "grouped_matmul runs one grouped GEMM kernel (not a matmul per group)"
    COMPILE_AROUND_HOOKS = ("compile_module runs the hooks of the compiled module's submodules eagerly, between "
                            "compiled pieces (else they are traced into the compiled code)")
    CONCURRENT_RECORD_AND_BACKWARD = ("one thread may record a forward while another runs a backward (torch's "
                                      "autograd; MindSpore's PyNative corrupts gradients then)")


@dataclass(frozen=True)
class MemoryStats:
    """Memory use of this process, in bytes (``Platform.memory_stats``).

    Attributes:
        allocated: bytes in use now: device memory held by tensors, or the process's
            resident set size on CPU.
        peak: the peak of ``allocated`` since the process started (CPU: peak RSS).
    """

    allocated: int
    peak: int


class Work(Protocol):
    """Handle of a collective or point-to-point operation.

    ``wait()`` blocks until the operation is done and returns its result tensor (the
    output buffer of the collective, or the received tensor), or ``None`` for
    operations without one (send, barrier). It may be called more than once and returns
    the same object each time.
    """

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class HandleWork:
    """A Work made of native handles plus a finishing step run once after they complete.

    Args:
        handles: native handles exposing ``wait()`` (torch ``Work``, MindSpore
            ``CommHandle``); ``None`` entries are skipped.
        finish: builds the result once every handle has completed (for example a
            reshape of an all-to-all buffer, or a slice of an emulated collective).
    """

    def __init__(self, handles: Sequence[Any], finish: Callable[[], Any]) -> None:
        self._handles: list[Any] = [h for h in handles if h is not None]
        self._finish: Callable[[], Any] | None = finish
        self._result: Any = None

    def wait(self) -> Any:
        if self._finish is not None:
            for handle in self._handles:
                handle.wait()
            self._handles = []
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result

    def is_completed(self) -> bool:
        """True once waited, or when every native handle reports completion. A handle
        without ``is_completed`` (MindSpore's ``CommHandle``) counts as pending until the
        Work is waited: a conservative answer, never a wrong "done"."""
        if self._finish is None:
            return True
        return all(bool(getattr(h, "is_completed", lambda: False)()) for h in self._handles)


class CompletedWork(HandleWork):
    """The Work of an operation that already finished (``async_op=False``)."""

    def __init__(self, result: Any) -> None:
        super().__init__((), lambda: result)
        self.wait()


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a ``batch_isend_irecv`` batch.

    Attributes:
        op: ``"isend"`` or ``"irecv"``.
        tensor: the tensor to send, or the buffer to receive into (any shape; the peer
            posts a buffer of the same shape and dtype).
        peer: rank of the peer *within* ``group``.
        group: the process group (``None``: the world).
    """

    op: str
    tensor: Any
    peer: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.op not in ("isend", "irecv"):
            raise ValueError(f"P2POp.op={self.op!r} is not a point-to-point op; use 'isend' or 'irecv'")
        if not isinstance(self.peer, int) or isinstance(self.peer, bool) or self.peer < 0:
            raise ValueError(f"P2POp.peer={self.peer!r} must be a non-negative group rank (int)")


class CustomFunction:
    """Base of a backend-neutral autograd function, applied with ``Platform.apply_function``.

    Subclasses define two static methods, in the style of ``torch.autograd.Function``:

    - ``forward(ctx, *args)`` runs on plain tensors with autograd off and returns one
      tensor or a tuple of tensors. Non-tensor arguments are passed through positionally
      (keyword arguments are not supported: MindSpore's ``_Function`` takes positional
      arguments only). Whatever ``backward`` needs is stored as attributes of ``ctx``.
    - ``backward(ctx, *grad_outputs)`` returns one gradient per ``forward`` argument
      (``None`` for non-tensor arguments and for inputs without a gradient).
    """

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:  # pragma: no cover - abstract by convention
        raise TypeError("CustomFunction subclasses define forward(ctx, *args)")

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:  # pragma: no cover - abstract by convention
        raise TypeError("CustomFunction subclasses define backward(ctx, *grad_outputs)")


class RemovableHandle(Protocol):
    """What every ``register_*_hook`` returns: ``remove()`` unregisters the hook."""

    def remove(self) -> None: ...
