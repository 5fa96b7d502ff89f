"""Contract section: streams and events.

On accelerators these are the device's streams and events, so communication can
overlap compute; on CPU they are no-op objects with the same methods (work is issued in
program order there), and ``Capability.STREAMS`` is not reported.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any


class StreamsSection(ABC):
    """Streams, events, and synchronisation."""

    @abstractmethod
    def new_stream(self) -> Any:
        """A new stream of the current device, for work that should overlap the current stream."""

    @abstractmethod
    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        """A context manager under which device work is issued to ``stream``."""

    @abstractmethod
    def record_event(self, stream: Any = None) -> Any:
        """A new event recorded now on ``stream`` (the current stream when ``None``): it
        completes once the work issued to that stream so far is done. Another stream
        waits for it with ``wait_event``."""

    @abstractmethod
    def wait_event(self, event: Any, stream: Any = None) -> None:
        """Make ``stream`` (the current one when ``None``) wait for ``event``."""
