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
    def dtype_name(self, dtype: Any) -> str:
        """The name in ``DTYPE_NAMES`` of a framework dtype.

        Raises:
            ValueError: the dtype has no name in ``DTYPE_NAMES``.
        """

    @abstractmethod
    def capabilities(self) -> frozenset[Capability]:
        """What this backend does natively; see ``Capability`` for what a missing member means."""
