"""Comm/compute overlap: one microbatch's forward and another's backward on two threads,
paired at the A/B/C/D hooks around all-to-all dispatch and combine, give exactly the
values and gradients of running them one after the other; an exception on either thread
surfaces on the caller's thread without leaving the other waiting."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hyper_parallel.core.pipeline_parallel import CommComputeOverlap, HookCoordinator
from hyper_parallel.platform import get_platform

DIM, TOKENS, LAYERS = 4, 8, 3


class _Events(HookCoordinator):
    """Records (thread side, hook) in order, to check the pairing."""

    def __init__(self, fail_at: str | None = None) -> None:
        super().__init__(timeout_s=60.0)
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.fail_at = fail_at  # a backward hook that raises on the backward thread (mid-backward)
        self.backward_thread: int | None = None

    def begin(self, forward_thread: int, backward_thread: int) -> None:
        super().begin(forward_thread, backward_thread)
        self.backward_thread = backward_thread

    def forward_hook(self, name: str) -> None:
        super().forward_hook(name)
        with self._lock:
            self.log.append(("F", name))

    def backward_hook(self, name: str) -> None:
        if name == self.fail_at and threading.get_ident() == self.backward_thread:
            raise RuntimeError(f"injected on the backward thread at {name}")
        super().backward_hook(name)
        with self._lock:
            self.log.append(("B", name))


def _model(p, overlap, chunk_hooks: bool = False):
    rng = np.random.default_rng(1)
    weights = [p.make_parameter(p.from_numpy((rng.standard_normal((DIM, DIM)) / 2).astype(np.float32)))
               for _ in range(2 * LAYERS)]
    dispatch = lambda t: p.differentiable_all_to_all(t, 0, 0)  # noqa: E731  tokens to their experts' ranks
    combine = lambda t: p.differentiable_all_to_all(t, 0, 0)  # noqa: E731  and back
    if overlap is not None:
        dispatches = [overlap.wrap_dispatch(dispatch) for _ in range(LAYERS)]
        combines = [overlap.wrap_combine(combine, is_last_layer=layer == LAYERS - 1) for layer in range(LAYERS)]
    else:
        dispatches, combines = [dispatch] * LAYERS, [combine] * LAYERS

    def forward(x):
        if chunk_hooks:  # MindFormers' apply_chunk_overlap_hooks: the chunk's input and output
            x = p.differentiable_sync_hook(x, "CHUNK_START", overlap.coordinator)
        for layer in range(LAYERS):
            routed = dispatches[layer](x @ weights[2 * layer])
            expert = routed @ weights[2 * layer + 1] * 0.5 + routed * routed * 0.1
            x = x + combines[layer](expert)
        if chunk_hooks:
            x = p.differentiable_sync_hook(x, "CHUNK_END", overlap.coordinator)
        return x

    return forward, weights


def check_overlap(inject: str) -> None:
    p = get_platform()
    r = p.rank()
    rng = np.random.default_rng(10 + r)
    xs = [p.from_numpy(rng.standard_normal((TOKENS, DIM)).astype(np.float32)) for _ in range(2)]
    gs = [p.from_numpy(rng.standard_normal((TOKENS, DIM)).astype(np.float32)) for _ in range(2)]
    forward, weights = _model(p, None)
    expected = []
    for x, g in zip(xs, gs):
        out, backward = p.vjp(forward, [x], weights)
        expected.append((p.to_numpy(out), [p.to_numpy(t) for t in backward([g])[1]]))

    coordinator = _Events(fail_at="B" if inject == "backward_hook" else None)
    overlap = CommComputeOverlap(coordinator, timeout_s=60.0)
    chunk_hooks = inject == "chunk_hooks"
    forward, weights = _model(p, overlap, chunk_hooks)
    out0, backward0 = p.vjp(forward, [xs[0]], weights)  # microbatch 0's forward, before the pair
    np.testing.assert_array_equal(p.to_numpy(out0), expected[0][0])
    coordinator.log.clear()
    if inject == "backward":
        def bwd():
            raise RuntimeError("injected on the backward thread")
    else:
        bwd = lambda: backward0([gs[0]])  # noqa: E731
    fwd = lambda: p.vjp(forward, [xs[1]], weights)  # noqa: E731
    if inject in ("backward", "backward_hook"):
        # before its first hook, or inside the backward with the forward waiting at a rendezvous
        with pytest.raises(RuntimeError, match="injected on the backward thread"):
            overlap.run(fwd, bwd)
        return
    (out1, backward1), (_, grads0) = overlap.run(fwd, bwd)
    np.testing.assert_array_equal(p.to_numpy(out1), expected[1][0], err_msg="forward under overlap")
    for i, grad in enumerate(grads0):
        np.testing.assert_array_equal(p.to_numpy(grad), expected[0][1][i], err_msg=f"gradient {i} under overlap")
    # The pairing: forward A..C of each layer against backward C..A, D_LAST unpaired.
    # With chunk hooks, the forward's CHUNK_END comes after it stopped at D_LAST and passes.
    hooks = {side: [name for s, name in coordinator.log if s == side] for side in "FB"}
    start, end = (["CHUNK_START"], ["CHUNK_END"]) if chunk_hooks else ([], [])
    assert hooks["F"] == start + ["A", "B", "C", "D"] * (LAYERS - 1) + ["A", "B", "C", "D_LAST"] + end, hooks
    assert hooks["B"] == end + ["D_LAST", "C", "B", "A"] + ["D", "C", "B", "A"] * (LAYERS - 1) + start, hooks
    grads1 = backward1([gs[1]])[1]
    for i, grad in enumerate(grads1):
        np.testing.assert_array_equal(p.to_numpy(grad), expected[1][1][i], err_msg=f"gradient {i} after overlap")


@pytest.mark.parametrize("inject", ["none", "chunk_hooks", "backward", "backward_hook"])
def test_overlap_matches_sequential(run_on_ranks, inject: str) -> None:
    run_on_ranks(check_overlap, inject, world_size=2)


def test_explicit_calls_outside_a_pairing() -> None:
    """MindFormers' explicit calls: outside ``run`` a thread does not coordinate and they
    return at once; a wrong role is refused."""
    from hyper_parallel.core.pipeline_parallel import HookRole

    coordinator = HookCoordinator(timeout_s=1.0)
    assert not coordinator.is_enabled()
    coordinator.rendezvous(HookRole.COMPUTE)
    coordinator.notify_dispatched(HookRole.COMM)
    with pytest.raises(TypeError, match="role='compute' must be HookRole.COMM or HookRole.COMPUTE"):
        coordinator.rendezvous("compute")
    with pytest.raises(ValueError, match="only HookRole.COMM announces"):
        coordinator.notify_dispatched(HookRole.COMPUTE)
    seen = []
    CommComputeOverlap(coordinator).run(lambda: seen.append(coordinator.is_enabled()),
                                        lambda: seen.append(coordinator.is_enabled()))
    assert seen == [True, True] and not coordinator.is_enabled()

    def bracketed_forward() -> None:  # MindFormers' forward brackets around a chunk without hooks
        coordinator.rendezvous(HookRole.COMPUTE)
        coordinator.notify_dispatched(HookRole.COMM)
        coordinator.rendezvous(HookRole.COMPUTE)

    # a backward without hooks that closes at once: the forward's opening must not wait for a
    # first rendezvous that never comes (timeout_s=1 would raise)
    CommComputeOverlap(coordinator, timeout_s=5.0).run(bracketed_forward,
                                                       lambda: coordinator.rendezvous(HookRole.COMPUTE))


def test_forward_tail_held_where_the_framework_needs_it() -> None:
    """[Note: serial tails]: by default the forward's tail waits for the backward wherever
    the platform cannot record and run a backward on two threads at once (MindSpore), and
    releasing it there is refused; torch runs the tails concurrently unless asked."""
    from hyper_parallel.platform import Capability, get_platform

    concurrent = Capability.CONCURRENT_RECORD_AND_BACKWARD in get_platform().capabilities()
    assert HookCoordinator().hold_forward_tail is (not concurrent)
    assert HookCoordinator(hold_forward_tail=True).hold_forward_tail is True
    if concurrent:
        assert HookCoordinator(hold_forward_tail=False).hold_forward_tail is False
    else:
        with pytest.raises(ValueError, match=r"hold_forward_tail=False\) on .*cannot record the forward's tail"):
            HookCoordinator(hold_forward_tail=False)
