"""Contract section: collectives with a backward.

These have one implementation, ``hyper_parallel.platform.autograd_collectives``, built
on ``apply_function`` and the plain collectives; backends inherit it through
``DifferentiableCollectives`` and may override a member with a native version.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.contract.common import ReduceOp, Work


class DifferentiableSection(ABC):
    """Collectives that autograd differentiates through."""

    @abstractmethod
    def differentiable_all_gather(self, tensor: Any, dim: int = 0, group: Any = None) -> Any:
        """Concatenate every rank's ``tensor`` along ``dim`` (same shape on every rank).

        Forward: all-gather. Backward: reduce-scatter (sum) of the output gradient, so
        rank ``r`` receives the sum over ranks of the gradient of its block.
        """

    @abstractmethod
    def differentiable_all_reduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM,
                                  group: Any = None) -> Any:
        """All-reduce (``SUM`` or ``AVG``) with backward all-reduce of the gradient
        (divided by the group size for ``AVG``): the gradient of an input is the sum
        over ranks of the gradients of their outputs.

        Raises:
            ValueError: ``op`` other than SUM/AVG (MAX/MIN/PRODUCT have no gradient here).
        """

    @abstractmethod
    def differentiable_all_to_all(self, tensor: Any, split_dim: int, concat_dim: int, group: Any = None,
                                  input_split_sizes: Sequence[int] | None = None,
                                  output_split_sizes: Sequence[int] | None = None) -> Any:
        """Split ``tensor`` along ``split_dim`` into one piece per rank, send piece ``s``
        to rank ``s``, concatenate the received pieces along ``concat_dim``.

        Example (Ulysses): ``[B, S/n, H, D]`` with ``split_dim=2, concat_dim=1`` becomes
        ``[B, S, H/n, D]``. Uneven split sizes are allowed only when
        ``split_dim == concat_dim`` (dispatching tokens to experts). Backward: the
        reverse all-to-all (``split_dim``/``concat_dim`` and split sizes swapped).

        Raises:
            ValueError: ``split_dim`` not divisible by the group size (even splits), or
                uneven sizes with ``split_dim != concat_dim``, or sizes that do not add up.
        """

    @abstractmethod
    def differentiable_async_a2a_wait(self, x: Any, work: Work, out_perm: Any, group: Any, world_size: int,
                                      concat_dim: int, split_dim: int,
                                      handle_box: list[tuple[Work, Any]] | None = None) -> Any:
        """Finish an all-to-all launched earlier and return its result inside autograd.

        The launch side reshapes ``x`` ``[..., H, ...]`` (``H`` at ``split_dim``) to
        ``[n, ..., H/n, ...]`` (the chunk index moved to the front), contiguous, and calls
        ``all_to_all_single(..., async_op=True)``: ``work``. ``out_perm`` is that call's
        output buffer or ``None`` (``work.wait()`` returns it). Forward: wait, then merge
        the leading rank dim into ``concat_dim``: ``[..., n * S, ..., H/n, ...]``.

        Backward, with ``handle_box``: launch the reverse all-to-all of the output
        gradient asynchronously, append ``(work, buffer)`` to ``handle_box`` and return a
        zero gradient for ``x``; ``work.wait()`` returns the real gradient in ``x``'s
        layout, for a backward pre-hook to consume just before the projection GEMM.
        Without ``handle_box``: run the reverse all-to-all synchronously and return the
        gradient of ``x``.
        """

    @abstractmethod
    def differentiable_sync_hook(self, x: Any, hook_name: str, coordinator: Any) -> Any:
        """Identity on ``x`` whose forward calls ``coordinator.forward_hook(hook_name)``
        and whose backward calls ``coordinator.backward_hook(hook_name)`` before passing
        the gradient through (the rendezvous points of comm/compute overlap)."""
