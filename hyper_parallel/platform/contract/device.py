"""Contract section: device queries and memory statistics."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from hyper_parallel.platform.contract.common import MemoryStats


class DeviceSection(ABC):
    """The device this process computes on, and its memory use."""

    @abstractmethod
    def set_device(self, local_rank: int) -> None:
        """Bind this process to device ``local_rank`` (no-op on CPU).

        Raises:
            ValueError: ``local_rank`` is not below the number of visible devices of
                ``device_type`` (1 on CPU).
        """

    @abstractmethod
    def memory_stats(self) -> MemoryStats:
        """This process's memory use in bytes: ``allocated`` now (device memory held by
        tensors; the process's resident set size on CPU) and its ``peak`` since the
        process started (CPU: peak RSS). torch: ``torch.cuda``/``torch.npu``
        ``memory_allocated()`` and ``max_memory_allocated()``; MindSpore Ascend:
        ``mindspore.runtime`` ones of the same names."""

    @abstractmethod
    def to_device(self, tensor: Any, device: str, pin_memory: bool = False, stream: Any = None) -> Any:
        """``tensor`` in the memory of ``device``: ``"cpu"`` (host memory) or
        ``device_type`` (this process's accelerator). A host copy is page-locked when
        ``pin_memory`` (so copies between host and accelerator can run asynchronously).
        Not differentiable: call it under ``no_grad`` on values (fully_shard's CPU
        offload). On a CPU backend both names mean host memory and ``tensor`` itself is
        returned (no copy).

        With ``stream`` (activation swap) the copy is issued on ``stream`` without
        blocking the host, a host copy into page-locked memory, a device copy into a
        tensor allocated on the current stream. The caller orders ``stream`` after the
        work that produced ``tensor`` (an event), keeps ``tensor`` alive and unchanged
        until the copy is done, and reads the copy only after waiting for an event
        recorded on ``stream`` after this call. The copy is dense (a view's elements).

        Raises:
            ValueError: ``device`` is neither ``"cpu"`` nor ``device_type``.
        """
