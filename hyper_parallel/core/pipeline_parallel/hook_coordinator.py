"""Rendezvous of a forward thread and a backward thread around MoE dispatch and combine.

[Note: A/B/C/D rendezvous]
An MoE layer's forward runs ``A -> dispatch (comm) -> B -> experts (compute) -> C ->
combine (comm) -> D``, each letter a ``platform.differentiable_sync_hook``. Its backward
meets the same hooks in reverse: after ``D`` comes the combine's backward (comm), after
``C`` the experts' backward (compute), after ``B`` the dispatch's backward (comm), after
``A`` the backward of what precedes the layer (compute). Two microbatches, one running
forward and one running backward through the same layers (DualPipe, Liu et al. 2024,
DeepSeek-V3; torchtitan's DualPipeV overlap), pair up hook by hook: forward ``A`` with
backward ``C``, ``B`` with ``B``, ``C`` with ``A``, ``D`` with ``D``, so that at every
rendezvous exactly one thread's next segment communicates and the other's computes. The
backward's first hook (the last layer's ``D``, named ``D_LAST``) has no partner and the
forward's ``D_LAST`` ends its part: each side has ``4 * layers - 1`` rendezvous.

At each rendezvous both threads arrive; the communicating thread goes on at once and the
computing thread waits until the communicating one reaches its next hook, i.e. until
its communication has been issued, so a communication kernel is always issued before the
compute it is paired with (on an accelerator the issue is asynchronous and the compute
then runs under it). A side that finishes (or fails) stops coordinating: the other's
hooks return at once, so no thread is ever left waiting.

[Note: chunk brackets] A pipeline's ``OVERLAP_B_F`` step runs a whole stage chunk per
thread, with work before the first MoE layer and after the last. MindFormers' callback
(upstream hyper-parallel's protocol) brackets the chunks itself: the forward function
opens with ``rendezvous(HookRole.COMPUTE)`` and, if still coordinating, closes with
``notify_dispatched(HookRole.COMM)`` and ``rendezvous(HookRole.COMPUTE)``; the backward
function closes with ``rendezvous(HookRole.COMPUTE)``; the hooks ``CHUNK_START`` /
``CHUNK_END`` on a chunk's input and output do the same from inside the model. Here the
forward's opening is ``wait_backward_started`` (which ``CommComputeOverlap.run`` has
already done, so it returns at once); a closing marks the side as past its hooks (the
other side's hooks stop waiting for it, as after ``finish``) and waits until the other
side is past its hooks too, so neither thread leaves the chunk while the other still
runs hooks. The forward passes its ``D_LAST`` before its closing and stops coordinating
there (``is_enabled()`` is then false, which is how MindFormers' callback skips its
closing); ``notify_dispatched`` marks this side's latest communication as issued, which
releases a computing partner as the side's next rendezvous would.

[Note: serial tails] Outside the paired segments both threads run free: the backward
after its last rendezvous (the layers before the first MoE layer), the forward after its
``D_LAST`` (the layers after the last one). Work there that is ordered across ranks (a
fully_shard unit's all-gather, issued on a group the other thread also uses) would then
be issued in an order that differs from rank to rank. ``hold_forward_tail=True`` keeps one
order: the forward, at its ``D_LAST``, marks itself past its hooks (the backward's hooks
stop waiting for it) and waits until the backward has finished, then runs its tail. Every
segment then runs on one thread at a time, in the same order on every rank; only the
communication issued before each switch (the combine before ``D_LAST``, the dispatch and
combine of the paired segments) runs under the other thread's compute.
The second reason to hold the tail is the framework's: MindSpore's PyNative records a
forward and replays a backward through one executor, and a forward tail recorded while
the backward thread replays corrupts gradients (rarely: once in several CI runs of
MindFormers' callback, every rank's gradients off; MindFormers' own callback notes the
same of a chunk's head). So the tail is held by default wherever the platform lacks
``Capability.CONCURRENT_RECORD_AND_BACKWARD``, and cannot be released there.
"""

from __future__ import annotations

import enum
import threading
import time

from hyper_parallel.platform import Capability, get_platform

FORWARD, BACKWARD = "forward", "backward"
#: hooks after which a side's next segment communicates (see [Note: A/B/C/D rendezvous])
_COMM_NEXT = {FORWARD: frozenset({"A", "C"}), BACKWARD: frozenset({"B", "D"})}
#: the chunk brackets of [Note: chunk brackets]
CHUNK_HOOKS = frozenset({"CHUNK_START", "CHUNK_END"})
HOOK_NAMES = frozenset({"A", "B", "C", "D", "D_LAST"}) | CHUNK_HOOKS


class HookRole(enum.Enum):
    """What the calling thread does next at an explicit rendezvous (upstream
    hyper-parallel's and MindFormers' name): communicate or compute."""

    COMM = "comm"
    COMPUTE = "compute"


class HookCoordinator:
    """The rendezvous of one forward thread and one backward thread.

    ``platform.differentiable_sync_hook(x, name, coordinator)`` calls ``forward_hook(name)``
    in its forward and ``backward_hook(name)`` in its backward; a hook coordinates only
    when called on the thread registered for its direction (``begin``): a forward
    re-run on the backward thread (MindSpore's recompute of an out-of-order backward)
    passes through. A chunk's own brackets (``is_enabled``, ``rendezvous``,
    ``notify_dispatched``; the ``CHUNK_START`` / ``CHUNK_END`` hooks) follow [Note: chunk
    brackets].

    Args:
        timeout_s: the longest a thread waits for its partner; past it the waiting
            thread raises ``RuntimeError`` (a partner stuck in a collective, say).
        hold_forward_tail: the forward waits at its ``D_LAST`` until the backward has
            finished ([Note: serial tails]). ``None`` (default): where the platform
            needs it (no ``Capability.CONCURRENT_RECORD_AND_BACKWARD``: MindSpore);
            ``True`` also where collectives in the tails must keep one order.

    Raises:
        ValueError: ``hold_forward_tail=False`` on a platform that cannot record and
            run a backward on two threads at once.
    """

    def __init__(self, timeout_s: float = 300.0, *, hold_forward_tail: bool | None = None) -> None:
        p = get_platform()
        concurrent = Capability.CONCURRENT_RECORD_AND_BACKWARD in p.capabilities()
        if hold_forward_tail is False and not concurrent:
            raise ValueError(f"HookCoordinator(hold_forward_tail=False) on {p.name}: this framework "
                             "cannot record the forward's tail while the other thread runs its backward (gradients "
                             "come out corrupted); leave hold_forward_tail out (or pass True)")
        self.timeout_s = timeout_s
        self.hold_forward_tail = not concurrent if hold_forward_tail is None else hold_forward_tail
        self._cond = threading.Condition()
        self._threads: dict[str, int | None] = {FORWARD: None, BACKWARD: None}  # thread ident per side
        self._arrived: dict[str, int] = {FORWARD: 0, BACKWARD: 0}  # rendezvous reached per side
        self._names: dict[str, list[str]] = {FORWARD: [], BACKWARD: []}  # hook name of each rendezvous
        self._done: dict[str, bool] = {FORWARD: True, BACKWARD: True}  # side no longer coordinating
        self._closing: dict[str, bool] = {FORWARD: False, BACKWARD: False}  # side past its hooks
        self._issued: dict[str, int] = {FORWARD: 0, BACKWARD: 0}  # rendezvous whose communication is issued
        #: rendezvous the two sides met at, over every pairing so far (0: the hooks never paired)
        self.paired: int = 0
        #: seconds each side spent blocked waiting for the other, over every pairing so far
        self.waited_s: dict[str, float] = {FORWARD: 0.0, BACKWARD: 0.0}

    def begin(self, forward_thread: int, backward_thread: int) -> None:
        """Start a pairing: hooks on ``forward_thread`` (a thread ident) are the forward
        side, hooks' backwards on ``backward_thread`` the backward side.

        Raises:
            RuntimeError: a pairing is still running.
        """
        with self._cond:
            if not (self._done[FORWARD] and self._done[BACKWARD]):
                raise RuntimeError("HookCoordinator.begin: the previous forward/backward pairing has not finished; "
                                   "one CommComputeOverlap.run at a time per coordinator")
            self._threads = {FORWARD: forward_thread, BACKWARD: backward_thread}
            self._arrived = {FORWARD: 0, BACKWARD: 0}
            self._names = {FORWARD: [], BACKWARD: []}
            self._done = {FORWARD: False, BACKWARD: False}
            self._closing = {FORWARD: False, BACKWARD: False}
            self._issued = {FORWARD: 0, BACKWARD: 0}

    def finish(self, side: str) -> None:
        """``side`` stops coordinating (it returned, raised, or passed its ``D_LAST``);
        the other side's hooks stop waiting for it."""
        with self._cond:
            self._done[side] = True
            self._cond.notify_all()

    def wait_backward_started(self) -> None:
        """Block the forward side until the backward side reached its first rendezvous
        (its first communication is then issued) or finished: the forward's first
        compute pairs with the backward's first communication, and the backward has
        started before the forward records anything (MindSpore can run the backward of
        only the newest recording natively; see its ``vjp``)."""
        with self._cond:
            self._wait(lambda: self._done[BACKWARD] or self._closing[BACKWARD] or self._arrived[BACKWARD] >= 1,
                       FORWARD,
                       "the backward thread to start")

    def forward_hook(self, name: str) -> None:
        """Called by a sync hook's forward."""
        self._hook(FORWARD, name)

    def backward_hook(self, name: str) -> None:
        """Called by a sync hook's backward."""
        self._hook(BACKWARD, name)

    def _side(self) -> str | None:
        """The side the calling thread coordinates for, or ``None`` (not one of the
        pairing's threads, or its side stopped coordinating)."""
        ident = threading.get_ident()
        for side in (FORWARD, BACKWARD):
            if self._threads[side] == ident and not self._done[side]:
                return side
        return None

    def is_enabled(self) -> bool:
        """Whether the calling thread coordinates now: it is one of a running pairing's
        two threads and its side has not stopped (the forward stops at its ``D_LAST``)."""
        with self._cond:
            return self._side() is not None

    def rendezvous(self, role: HookRole) -> None:
        """A chunk bracket ([Note: chunk brackets]) called by the thread itself:
        on the forward before its first hook, wait for the backward to start; after its
        hooks (and on the backward), wait until the other side is past its hooks. A
        thread that does not coordinate returns at once. ``role`` (upstream's signature)
        is checked, not used: where the bracket stands decides what it waits for.

        Raises:
            TypeError: ``role`` is not a ``HookRole``.
            RuntimeError: the other side did not arrive within ``timeout_s``.
        """
        if not isinstance(role, HookRole):
            raise TypeError(f"HookCoordinator.rendezvous: role={role!r} must be HookRole.COMM or HookRole.COMPUTE")
        with self._cond:  # reentrant: the waits below take it again
            side = self._side()
            if side == FORWARD and self._arrived[FORWARD] == 0 and not self._closing[FORWARD]:
                self.wait_backward_started()
            elif side is not None:
                self._close(side)

    def notify_dispatched(self, role: HookRole = HookRole.COMM) -> None:
        """The calling thread has issued the communication after its latest rendezvous:
        a partner computing meanwhile may go on ([Note: chunk brackets]).

        Raises:
            ValueError: ``role`` is not ``HookRole.COMM`` (only communication is announced).
        """
        if role is not HookRole.COMM:
            raise ValueError(f"HookCoordinator.notify_dispatched: role={role!r}; only HookRole.COMM announces an "
                             "issued communication")
        with self._cond:
            side = self._side()
            if side is not None:
                self._issued[side] = self._arrived[side]
                self._cond.notify_all()

    def _close(self, side: str) -> None:
        other = BACKWARD if side == FORWARD else FORWARD
        with self._cond:
            self._closing[side] = True
            self._cond.notify_all()
            self._wait(lambda: self._done[other] or self._closing[other], side,
                       f"the {other} thread to pass its last hook")

    def _hook(self, side: str, name: str) -> None:
        if name not in HOOK_NAMES:
            raise ValueError(f"HookCoordinator: hook name {name!r} is not one of {sorted(HOOK_NAMES)}")
        if threading.get_ident() != self._threads[side] or self._done[side]:
            return
        if name in CHUNK_HOOKS:  # the forward meets START then END, the backward END then START
            if (side == FORWARD) != (name == "CHUNK_START"):  # the side's end: close
                self.notify_dispatched(HookRole.COMM)
                self.rendezvous(HookRole.COMPUTE)
            elif side == FORWARD:  # the forward's start: open (the backward's start needs nothing)
                self.rendezvous(HookRole.COMPUTE)
            return
        if name == "D_LAST":
            if side == FORWARD:
                if self.hold_forward_tail:  # [Note: serial tails]
                    with self._cond:
                        self._closing[FORWARD] = True
                        self._cond.notify_all()
                        self._wait(lambda: self._done[BACKWARD], FORWARD, "the backward thread to finish")
                self.finish(FORWARD)
            return  # the backward's first hook: nothing precedes it to pair with
        self._rendezvous(side, name)

    def _wait(self, ready: object, side: str, what: str) -> None:
        began = time.perf_counter()
        met = self._cond.wait_for(ready, timeout=self.timeout_s)  # type: ignore[arg-type]
        self.waited_s[side] += time.perf_counter() - began
        if not met:
            self._done[side] = True
            self._cond.notify_all()
            raise RuntimeError(f"HookCoordinator: the {side} thread waited {self.timeout_s} s for {what}; the other "
                               "thread is stuck (a collective that never completes?)")

    def _rendezvous(self, side: str, name: str) -> None:
        other = BACKWARD if side == FORWARD else FORWARD
        with self._cond:
            self._arrived[side] += 1  # also: this side's previous segment has been issued
            k = self._arrived[side]
            self._names[side].append(name)
            self._cond.notify_all()
            self._wait(lambda: self._done[other] or self._closing[other] or self._arrived[other] >= k, side,
                       f"rendezvous {k}")
            if self._arrived[other] < k:  # the other side stopped, or is past its hooks
                return
            if side == FORWARD:  # counted once per rendezvous
                self.paired += 1
            mine, theirs = name in _COMM_NEXT[side], self._names[other][k - 1] in _COMM_NEXT[other]
            if mine == theirs:
                self._done[side] = True
                self._cond.notify_all()
                raise RuntimeError(f"HookCoordinator: rendezvous {k} pairs {side} hook {name} with {other} hook "
                                   f"{self._names[other][k - 1]}: both next segments "
                                   f"{'communicate' if mine else 'compute'}; the two microbatches must run the same "
                                   "MoE layers, wrapped by wrap_dispatch/wrap_combine (the last with is_last_layer)")
            if mine:
                return
            self._wait(lambda: (self._done[other] or self._closing[other] or self._arrived[other] > k
                                or self._issued[other] >= k), side,
                       f"the {other} thread to issue its communication after rendezvous {k}")
