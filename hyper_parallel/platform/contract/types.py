"""Contract section: framework types, dtypes, capabilities."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from hyper_parallel.platform.contract.common import Capability

#: The dtype names core uses; backends map them to framework dtypes and back.
DTYPE_NAMES: tuple[str, ...] = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool",
)


class TypesSection(ABC):
    """Types core needs to recognise, and the dtype vocabulary shared by all backends."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The backend name, one of the folders of ``platform/`` (``"torch-cpu"``,
        ``"torch-cuda"``, ``"torch-npu"``, ``"mindspore-cpu"``, ``"mindspore-ascend"``)."""

    @abstractmethod
    def is_tensor(self, obj: Any) -> bool:
        """True when ``obj`` is a framework tensor (parameters included)."""

    @abstractmethod
    def dtype(self, name: str) -> Any:
        """The framework dtype for ``name`` (one of ``DTYPE_NAMES``).

        Raises:
            ValueError: ``name`` is not in ``DTYPE_NAMES``; the message lists them.
        """

    @abstractmethod
    def dtensor_type(self, base: type) -> type:
        """The class DTensors have on this backend, built once per ``base`` and cached.

        ``base`` is core's framework-free ``DTensor`` (attributes ``_local``, the local
        tensor, and ``_spec``). ``base.entry()`` is the one entry into core the class
        calls ([Note: the backend entry] in ``core/op_entry.py``): ``dispatch_op(op,
        dtensors, local_fn, params, *, inplace, with_local_shape)``, ``dispatch_explicit``
        (the same arguments), ``dispatch_split``, the fused-op plans, ``dispatch_skipped()``,
        ``full_local(dt)``, ``replicated(local, mesh)``, ``freeze_params(params)``. The
        backend plans nothing: it names the op, hands it over, and runs the local call it
        is given; the platform never imports core.

        A backend whose framework lets a tensor subclass intercept its ops returns a
        subclass of the framework's tensor and of ``base``, constructed as
        ``cls(local, spec)`` without autograd, reporting the global shape. It names each
        framework op with a DTensor input as ``OP_RULES`` does (its non-tensor arguments
        as the rule's params) and runs ops on the local tensors while
        ``entry.dispatch_skipped()``. Where autograd records on the class's instances (a
        wrapper with no storage of its own: torch's ``__torch_dispatch__`` subclass) the
        class sets ``wrapper_autograd = True`` and routes to ``dispatch_op``, below
        autograd; where the instances share their local tensor's autograd identity
        (MindSpore's ``Tensor._make_subclass`` with ``__fallback__``) it routes to
        ``dispatch_explicit``, above autograd. A backend without such a hook returns
        ``base`` itself.
        """

    @abstractmethod
    def capabilities(self) -> frozenset[Capability]:
        """What this backend does natively; see ``Capability`` for what a missing member means."""
