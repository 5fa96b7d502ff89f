"""Free TCP ports for rendezvous; never a fixed number, so pools and CI jobs can share a host."""

from __future__ import annotations

import socket

#: Text that a framework puts in a bind failure (torch's TCPStore does; MindSpore's
#: scheduler only logs it, so ``port_in_use`` is checked too).
ADDRESS_IN_USE_MARKERS: tuple[str, ...] = ("address already in use", "eaddrinuse", "errno 98")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free when this returned.

    The kernel picks it (bind to port 0). Another process can still take it before the
    framework binds it; ``WorkerPool`` retries its start on a new port when that happens
    (the failure names the port, or the port is found taken afterwards).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether another socket holds ``port`` on ``host`` now (bound or listening).

    ``SO_REUSEADDR`` makes the check ignore connections of processes that just died
    (TIME_WAIT), so only a live owner counts.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


def is_address_in_use(text: str) -> bool:
    """Whether an error text reports a port that was already bound."""
    lowered = text.lower()
    return any(marker in lowered for marker in ADDRESS_IN_USE_MARKERS)
