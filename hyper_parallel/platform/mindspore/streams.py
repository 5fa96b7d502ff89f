"""Streams and events: ``mindspore.runtime`` on Ascend, host no-ops on CPU.

MindSpore's stream API (``runtime.Stream``, ``Event``, ``StreamCtx``,
``current_stream``) supports Ascend and GPU only; on CPU each call logs
an error, and CPU work runs in program order on one queue anyway, so the CPU backend
hands out the shared host objects of ``hyper_parallel.platform.host_streams``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from hyper_parallel.platform import host_streams
from hyper_parallel.platform.contract.streams import StreamsSection


class MindSporeStreams(StreamsSection):
    """Stream members of ``MindSporePlatform``; uses its ``_ms`` module and ``_device_type``."""

    _ms: Any
    _device_type: str

    def new_stream(self) -> Any:
        """``mindspore.runtime.Stream()``."""
        if self._device_type == "cpu":
            return host_streams.HostStream()
        return self._ms.runtime.Stream()

    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        """``mindspore.runtime.StreamCtx(stream)``."""
        if self._device_type == "cpu":
            return host_streams.host_stream_context(stream)
        return self._ms.runtime.StreamCtx(stream)

    def record_event(self, stream: Any = None) -> Any:
        """A ``mindspore.runtime.Event()`` recorded on ``stream`` (MindSpore records on
        the current stream for ``None``)."""
        event = host_streams.HostEvent() if self._device_type == "cpu" else self._ms.runtime.Event()
        event.record(stream)
        return event

    def wait_event(self, event: Any, stream: Any = None) -> None:
        """``event.wait(stream)``; MindSpore makes the current stream wait for ``None``."""
        event.wait(stream)
