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
    def current_stream(self) -> Any:
        """The stream that device work is issued to now (a no-op stream object on CPU)."""

    @abstractmethod
    def new_stream(self) -> Any:
        """A new stream of the current device, for work that should overlap the current stream."""

    @abstractmethod
    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        """A context manager under which device work is issued to ``stream``."""

    @abstractmethod
    def new_event(self) -> Any:
        """A new event, to be recorded on one stream and waited for by another."""

    @abstractmethod
    def record_event(self, event: Any, stream: Any = None) -> None:
        """Record ``event`` on ``stream`` (the current stream when ``None``)."""

    @abstractmethod
    def wait_event(self, event: Any, stream: Any = None) -> None:
        """Make ``stream`` (the current one when ``None``) wait for ``event``."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all issued device work is done."""
