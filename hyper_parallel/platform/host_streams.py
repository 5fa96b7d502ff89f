"""Streams and events on a host (CPU) backend: objects with the device API that do
nothing, because a CPU backend issues all work in program order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class HostStream:
    """Stands for a device stream on CPU."""

    def synchronize(self) -> None:
        """Nothing is pending on a host stream."""

    def wait_event(self, event: Any) -> None:
        """Host work is already ordered."""


class HostEvent:
    """Stands for a device event on CPU; always complete."""

    def record(self, stream: Any = None) -> None:
        """Nothing to record."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


@contextlib.contextmanager
def host_stream_context(stream: Any) -> Iterator[Any]:
    """``with platform.stream(s):`` on CPU: runs the body as is."""
    yield stream
