"""The context that routes ``scaled_dot_product_attention`` to a module's distributed
algorithm while that module's forward runs.

[Note: where the active context lives]
``ContextParallel`` hooks a core-attention module; the attention itself is computed by
a free function (``scaled_dot_product_attention``) that the module's forward calls. The
function must find the plan of the module it runs in, without being handed it, without
patching the framework and without a module-level registry of modules. The plan is
therefore pushed on entry to the hooked forward and popped on exit, onto a stack held in
a ``contextvars.ContextVar``:

- a ContextVar is the standard library's facility for ambient state scoped to a caller
  (``decimal``'s context works the same way). Its value is per thread and per asyncio
  task, so the two threads of pipeline comm/compute overlap, each running a different
  microbatch through hooked modules, never see each other's frames;
- the value is an immutable tuple that is replaced, never mutated: nothing accumulates
  across calls and no module is ever referenced after its forward returns;
- nested hooked modules (an attention inside an attention) see the innermost frame.
The ContextVar object itself is a constant; it is not a registry.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.load_balance import shard_positions

#: The frames of the hooked forwards running in this thread/task, innermost last; see
#: [Note: where the active context lives].
_FRAMES: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar("hyper_parallel_cp_frames", default=())


@dataclass(frozen=True)
class Plan:
    """A ContextParallel configuration resolved against its mesh (built by ``apply``).

    Attributes:
        cp: ranks in the context-parallel mesh.
        cp_index: this rank's row-major index in it.
        ulysses_size: ranks of the all-to-all (Ulysses) axis; 1 without one.
        ulysses_group: the process group of that axis (``None`` when size 1).
        kv_size: ranks of the key/value exchange axis (``cp / ulysses_size``).
        kv_index: this rank's index along that axis.
        kv_group: its process group (``None`` when size 1).
        kv_exchange: ``"allgather"`` or ``"ring"``.
        load_balance: the head-tail sequence layout.
    """

    cp: int
    cp_index: int
    ulysses_size: int
    ulysses_group: Any
    kv_size: int
    kv_index: int
    kv_group: Any
    kv_exchange: str
    load_balance: bool

    def block_positions(self, seq_len: int, kv_index: int) -> np.ndarray:
        """Global positions of the sequence held, after the Ulysses all-to-all, by the
        ranks at ``kv_index`` of the exchange axis (the ranks of one Ulysses group, in
        group order: CP index ``kv_index * ulysses_size + u``)."""
        return np.concatenate([shard_positions(seq_len, self.cp, kv_index * self.ulysses_size + u, self.load_balance)
                               for u in range(self.ulysses_size)])


@dataclass(eq=False)
class Frame:
    """One running forward of a hooked module.

    Attributes:
        module_name: for error messages.
        plan: its resolved configuration.
        seq_len: the global sequence length of this forward's q/k/v.
        called: set by ``scaled_dot_product_attention`` when it ran inside the frame.
    """

    module_name: str
    plan: Plan
    seq_len: int
    called: bool = field(default=False)


def current_frame() -> Frame | None:
    """The innermost running hooked forward of this thread/task, if any."""
    frames = _FRAMES.get()
    return frames[-1] if frames else None


def push_frame(frame: Frame) -> None:
    _FRAMES.set(_FRAMES.get() + (frame,))


def pop_frame(frame: Frame) -> None:
    """Remove ``frame`` and whatever a failed inner forward left above it.

    A forward that raises skips its post-hook; its frame stays until the enclosing hooked
    forward pops past it, or until ``ContextParallel``'s pre-hook of the next forward
    clears frames of its own module."""
    frames = _FRAMES.get()
    if frame in frames:
        _FRAMES.set(frames[:frames.index(frame)])


def find_frame(plan: Plan) -> Frame | None:
    """The innermost running frame of ``plan``."""
    return next((f for f in reversed(_FRAMES.get()) if f.plan is plan), None)


def drop_stale(plan: Plan) -> None:
    """Drop frames a raising forward of the same plan left behind (see ``pop_frame``)."""
    frames = _FRAMES.get()
    for i, f in enumerate(frames):
        if f.plan is plan:
            _FRAMES.set(frames[:i])
            return
