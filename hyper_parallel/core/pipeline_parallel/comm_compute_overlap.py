"""Two-thread overlap of one microbatch's forward with another's backward, paired at the
MoE dispatch/combine hooks (see [Note: A/B/C/D rendezvous] in ``hook_coordinator``).

Usage::

    overlap = CommComputeOverlap()
    layer.dispatch = overlap.wrap_dispatch(layer.dispatch)     # A -> dispatch -> B
    layer.combine = overlap.wrap_combine(layer.combine, is_last_layer=last)  # C -> combine -> D
    forward_result, backward_result = overlap.run(fwd_fn, bwd_fn)

``fwd_fn`` runs (and records) one microbatch's forward through the wrapped layers,
``bwd_fn`` runs another microbatch's backward through them; ``run`` runs the two on two
threads and returns their results. Outside ``run`` the wrapped functions only add
identity hooks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hyper_parallel.core.pipeline_parallel.hook_coordinator import BACKWARD, FORWARD, HookCoordinator
from hyper_parallel.platform import get_platform


def _hook_first(x: Any, name: str, coordinator: HookCoordinator) -> Any:
    """The sync hook on ``x``, or on the first element of a tuple ``x``."""
    p = get_platform()
    if isinstance(x, tuple):
        return (p.differentiable_sync_hook(x[0], name, coordinator),) + x[1:]
    return p.differentiable_sync_hook(x, name, coordinator)


class CommComputeOverlap:
    """Runs a forward and a backward on two threads, rendezvousing at the hooks added by
    ``wrap_dispatch`` and ``wrap_combine``.

    Args:
        coordinator: the rendezvous (a new ``HookCoordinator()`` by default).
        timeout_s: the longest ``run`` waits for the two threads before raising.
    """

    def __init__(self, coordinator: HookCoordinator | None = None, *, timeout_s: float = 600.0) -> None:
        self.coordinator = coordinator or HookCoordinator()
        self.timeout_s = timeout_s

    def wrap_dispatch(self, dispatch: Callable[..., Any]) -> Callable[..., Any]:
        """``A -> dispatch -> B``: hooks on the first argument of ``dispatch`` (tokens,
        ``[tokens, dim]`` or a tuple whose first element is) and on its result's first
        tensor. ``dispatch`` is the communication (an all-to-all sending tokens to their
        experts' ranks)."""

        def wrapped(x: Any, *args: Any, **kwargs: Any) -> Any:
            return _hook_first(dispatch(_hook_first(x, "A", self.coordinator), *args, **kwargs), "B",
                               self.coordinator)

        return wrapped

    def wrap_combine(self, combine: Callable[..., Any], *, is_last_layer: bool = False) -> Callable[..., Any]:
        """``C -> combine -> D`` (``D_LAST`` when ``is_last_layer``: the last MoE layer a
        forward passes and the first a backward meets). ``combine`` is the
        communication bringing expert outputs back to their tokens' ranks."""
        last = "D_LAST" if is_last_layer else "D"

        def wrapped(x: Any, *args: Any, **kwargs: Any) -> Any:
            return _hook_first(combine(_hook_first(x, "C", self.coordinator), *args, **kwargs), last,
                               self.coordinator)

        return wrapped

    def run(self, fwd_fn: Callable[[], Any], bwd_fn: Callable[[], Any]) -> tuple[Any, Any]:
        """Run ``fwd_fn()`` and ``bwd_fn()`` on two threads, paired at the hooks; returns
        ``(fwd_fn's result, bwd_fn's result)``.

        Raises:
            BaseException: whatever either function raised (the forward's first when
                both did), on the caller's thread; the other thread stops waiting for its
                partner at once and runs to its end before this returns.
            RuntimeError: the threads did not finish within ``timeout_s``.
        """
        results: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        started = threading.Barrier(3)

        def body(side: str, fn: Callable[[], Any]) -> None:
            try:
                started.wait()
            except threading.BrokenBarrierError:
                return  # begin() refused this run
            try:
                if side == FORWARD:
                    self.coordinator.wait_backward_started()
                results[side] = fn()
            except BaseException as error:  # noqa: BLE001  re-raised on the caller's thread
                errors[side] = error
            finally:
                self.coordinator.finish(side)

        threads = {side: threading.Thread(target=body, args=(side, fn), name=f"overlap-{side}", daemon=True)
                   for side, fn in ((FORWARD, fwd_fn), (BACKWARD, bwd_fn))}
        for thread in threads.values():
            thread.start()
        try:
            self.coordinator.begin(threads[FORWARD].ident, threads[BACKWARD].ident)  # type: ignore[arg-type]
        except BaseException:
            started.abort()
            raise
        started.wait()
        for side, thread in threads.items():
            thread.join(self.timeout_s)
            if thread.is_alive():
                raise RuntimeError(f"CommComputeOverlap.run: the {side} thread did not finish within "
                                   f"{self.timeout_s} s")
        for side in (FORWARD, BACKWARD):
            if side in errors:
                raise errors[side]
        return results[FORWARD], results[BACKWARD]
