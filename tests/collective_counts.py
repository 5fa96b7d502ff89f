"""Counting the collectives core issues through the platform contract (test support)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.platform import get_platform

#: The contract's collectives a test usually counts.
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                                "broadcast", "batch_isend_irecv")


def count_collectives(fn: Callable[[], Any], names: Sequence[str] = COLLECTIVES) -> tuple[Any, dict[str, int]]:
    """``fn()``'s result and how often each of the platform's collectives ``names`` was
    called while it ran: counted on this process's platform object (its methods wrapped
    as instance attributes, removed after), so a call a backend makes inside another
    collective counts too. torch's ``CommDebugMode`` cannot see collectives issued inside
    a ``__torch_dispatch__``; this sees every call through the contract on either backend."""
    p = get_platform()
    calls = dict.fromkeys(names, 0)

    def counting(name: str) -> Callable[..., Any]:
        method = getattr(p, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return method(*args, **kwargs)
        return call

    for name in names:
        setattr(p, name, counting(name))
    try:
        out = fn()
    finally:
        for name in names:
            delattr(p, name)
    return out, calls
