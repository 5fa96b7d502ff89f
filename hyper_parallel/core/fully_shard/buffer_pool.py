"""A pool of reusable buffers for the all-gathers of gathered weights (and for the
units' flat all-gather and reduce-scatter buffers: [Note: flat all-gather copy-in] in
``param_group``, where an output buffer goes back after its parameters' copy-outs).

Used by ``weight_parallel(..., buffer_pool=True)`` (the ISP idea of InternEvo, arXiv
2401.09149: the gathered weights of a few blocks live at any time, so a handful of
buffers per weight shape serve every block and every step instead of a fresh
allocation per gather).

[Note: when a pooled buffer may be overwritten]
A buffer is handed out by ``acquire`` to one parameter's all-gather
(``all_gather_into_tensor(out=buffer)``) and given back by ``release`` when nothing
will read it again:

- forward: as soon as ``GatherParam`` has copied it into the tensor the module reads
  (that copy is what autograd saves, as a token under ``release_saved_tensors``), i.e.
  right after the unit's forward pre-hook;
- backward: the backward gathers again into a pooled buffer, and autograd's saved-tensor
  reload hands *that buffer* to the backward operations that use the weight. All of
  them take the weight (or a view of it) as an input, so they produce gradient for it
  and run before ``GatherParam.backward``, which calls ``on_grad``: only there, when the
  parameter's gradient is final, is the buffer released. Nothing reads it afterwards;
- ``reshard()`` releases what is still held.

On accelerators those readers were only *issued* on the compute stream when the host
releases the buffer, so ``release`` records an event on the current stream and the
next all-gather into the buffer makes the all-gather stream wait for it
(``HSDPParam.start_gather``). On CPU events are no-ops and every reader has run.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.core.tensor_ops import dtype_name


class GatherBufferPool:
    """Buffers keyed by ``(shape, dtype)``; each is either held by one parameter's
    gather or free (with the event its last readers were issued before)."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], str], list[tuple[Any, Any]]] = {}
        #: Every buffer this pool allocated, in allocation order (no buffer is dropped).
        self.buffers: list[Any] = []
        #: How many times a buffer was handed out (``acquisitions - len(buffers)`` reuses).
        self.acquisitions: int = 0

    def acquire(self, shape: tuple[int, ...], dtype: Any) -> tuple[Any, Any]:
        """A free buffer of ``shape`` and ``dtype`` (allocated when none is free) and the
        event to wait for before writing it (``None`` for a new buffer)."""
        p = get_platform()
        self.acquisitions += 1
        free = self._free.get((tuple(shape), dtype_name(dtype)))
        if free:
            return free.pop()
        buffer = p.zeros(tuple(shape), dtype)
        self.buffers.append(buffer)
        return buffer, None

    def release(self, buffer: Any) -> None:
        """Give ``buffer`` back: its last readers were issued on the current stream."""
        p = get_platform()
        event = p.record_event()
        self._free.setdefault((tuple(int(d) for d in buffer.shape), dtype_name(buffer.dtype)), []).append(
            (buffer, event))

    def free_count(self) -> int:
        """Buffers not held by any gather now."""
        return sum(len(v) for v in self._free.values())
