"""The context that routes ``scaled_dot_product_attention`` to a module's distributed
algorithm while that module's forward runs.

[Note: where the active context lives]
``ContextParallel`` hooks a core-attention module; the attention itself is computed by
a free function (``scaled_dot_product_attention``) that the module's forward calls. The
function must find the plan of the module it runs in, without being handed it, without
patching the framework and without a module-level registry of modules. The plan is
therefore pushed on entry to the hooked forward and popped on exit, onto a stack held in
a ``threading.local``:

- its value is per thread, so the two threads of pipeline comm/compute overlap, each
  running a different microbatch through hooked modules, never see each other's frames.
  Not a ``contextvars.ContextVar`` (per asyncio task too, which nothing here needs):
  torch.compile's dynamo cannot trace a ContextVar lookup and broke every compiled
  block's graph at its attention, while it traces the read of a thread-local attribute;
- the value is an immutable tuple that is replaced, never mutated: nothing accumulates
  across calls and no module is ever referenced after its forward returns;
- nested hooked modules (an attention inside an attention) see the innermost frame.
The thread-local object itself is a constant; it is not a registry.

A forward that raises skips its post-hook, so its frame would stay and capture the next
unrelated call of the functional. Each frame therefore remembers the framework's call
frame of its module (the Python frame of ``Module.__call__``/``Cell.__call__``: the
outermost frame on the stack whose ``self`` is the module); a frame whose
call frame is no longer on this thread's stack is dead and is dropped whenever frames
are read or pushed.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.load_balance import shard_positions

class _Frames(threading.local):
    """The frames of the hooked forwards running in this thread, innermost last; see
    [Note: where the active context lives]."""

    stack: tuple[Frame, ...] = ()


_FRAMES = _Frames()


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
        mesh: the mesh of the K/V exchange: the context-parallel mesh (1-D), or the 2-D
            ``(exchange, ulysses)`` mesh in hybrid mode; ``None`` when there is no exchange
            (``kv_size == 1``: pure Ulysses, one rank). The module sees q/k/v as DTensors
            on it ([Note: q/k/v as DTensors] in ``sharded_qkv``).
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
    mesh: Any = None

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
        module: the hooked module (a framework op called inside it may read its settings).
        outer: the mesh and placements q/k/v came on when they were DTensors sharded by
            heads (``sharded_qkv.take_outer_sharding``); ``None`` for plain tensors.
    """

    module_name: str
    plan: Plan
    seq_len: int
    site: Any = None  # the Python frame running the module's call; None: not found, always live
    called: bool = field(default=False)
    module: Any = None
    outer: Any = None


def module_call_site(module: Any) -> Any:
    """The outermost Python frame on this thread's stack whose ``self`` is ``module``: the
    framework's module call (``Module._call_impl``, ``Cell.__call__``), which outlives the
    forward and its hooks, rather than a helper of it that returns after the pre-hooks
    (MindSpore runs them in one, under a decorator frame of its own)."""
    site, f = None, sys._getframe(1)
    while f is not None:
        if f.f_locals.get("self") is module:
            site = f
        f = f.f_back
    return site


def _is_live(frame: Frame) -> bool:
    if frame.site is None:
        return True
    f = sys._getframe(1)
    while f is not None:
        if f is frame.site:
            return True
        f = f.f_back
    return False


def _live_frames() -> tuple[Frame, ...]:
    """This thread's frames with the dead ones dropped (see the note)."""
    frames = _FRAMES.stack
    if not frames:  # the common case, and the one a compiled block traces: no sys._getframe
        return frames
    live = tuple(f for f in frames if _is_live(f))
    if len(live) != len(frames):
        _FRAMES.stack = live
    return live


def current_frame() -> Frame | None:
    """The innermost running hooked forward of this thread, if any."""
    frames = _live_frames()
    return frames[-1] if frames else None


def push_frame(frame: Frame) -> None:
    _FRAMES.stack = _live_frames() + (frame,)


def pop_frame(frame: Frame) -> None:
    """Remove ``frame`` (the post-hook of its forward)."""
    _FRAMES.stack = tuple(f for f in _FRAMES.stack if f is not frame)


def find_frame(plan: Plan) -> Frame | None:
    """The innermost live frame of ``plan``."""
    return next((f for f in reversed(_live_frames()) if f.plan is plan), None)
