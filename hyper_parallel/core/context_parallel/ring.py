"""Ring attention: key/value blocks travel around the ring of the exchange axis while each
rank attends its queries to the block it holds (Liu et al., "Ring Attention with
Blockwise Transformers for Near-Infinite Context", 2023; torch's
``_templated_ring_attention`` and ``_templated_ring_attention_backward``).

[Note: the ring and its backward]
Rank ``g`` of ``n`` holds its query block throughout. At step ``s`` it holds the key/value
block of rank ``(g - s) mod n``: before attending to it, it starts sending that block to
rank ``g + 1`` and receiving the next from rank ``g - 1`` (one ``batch_isend_irecv``),
so the transfer overlaps the block's attention, and waits only after. Partial outputs
are merged by log-sum-exp in ``max(float32, dtype)`` ([Note: log-sum-exp merge] in
``platform.contract.attention_merge``). Which
pairs a block may attend to comes from global positions ([Note: segments] in ``masks``),
so causal offsets, the head-tail layout and packed documents need nothing ring-specific;
blocks entirely in a query's future are skipped, not masked.

The whole ring is one autograd function (``RingAttention``) that saves only this rank's
``q``, ``k``, ``v``, its output and the log-sum-exp ``lse`` of the merged scores:
``O(seq / n)`` per rank, where differentiating each step's block attention would keep
every block received (``O(seq)``, like all-gather). Backward rotates the key/value blocks
around the ring again, in the same direction, and runs the platform's fused backward
kernel on each block's calls with the saved global ``out`` and ``lse``
(``platform.attention_backward``, which recomputes ``P = exp(q k^T * scale - lse)``: the
global softmax, so block gradients add up without any merge; FlashAttention-2's
backward, [Note: block attention] in ``blocks``). dQ stays on the rank; the dK/dV accumulator of a block travels
with the block: at step ``s`` rank ``g`` adds its queries' contribution to block
``g - s`` into the accumulator it received from rank ``g - 1`` and sends it on to
``g + 1``; after ``n`` such hops (the last one without its block) every accumulator is
home, holding the contributions of every rank's queries. The block send is started
before the block's gradient is computed and the accumulator's send right after, so both
overlap computation; the accumulators are ``max(float32, dtype)`` whatever the input dtype. Every rank
runs every step and every shift in the same order, including steps whose block it
skips (a zero contribution is sent on), so sends and receives always match.

Each block's gradient is added into the accumulator received for it (in place where the
framework does it, ``blocks.add_rows``), and a send reads its tensor without a copy, so
the backward's working set is this rank's tensors, two key/value blocks (the current one
and the next, in flight), two accumulators (the one sent and the one received) and one
block's gradients: ``O(seq / n)``, with no term growing with ``n``.

[Note: all-gather as a ring source]
``kv_exchange="allgather"`` runs the same function with the blocks taken from one
all-gather of the stacked ``[2, batch, kv_seq, kv_heads, dim]`` pair instead of ``n - 1``
shifts (torch's ``_AllGatherRotater``). The gather starts before step 0, whose block
is this rank's own, so it overlaps that block's attention. Nothing gathered is saved: the
backward gathers again, and the dK/dV accumulators travel the ring as above (torch's
ring backward does the same for both rotation methods). Where a reduce-scatter of
full-length dK/dV would hold ``2 n`` blocks of gradients at once, the accumulators hold
two, so all-gather's per-rank memory is ``O(seq)`` only transiently (the gathered
blocks, one layer at a time) and its saved activations are ``O(seq / n)``, like the ring's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.blocks import (
    BlockResult,
    add_rows,
    backward_calls,
    finish,
    forward_calls,
    keep_for_backward,
)
from hyper_parallel.core.context_parallel.context import Plan
from hyper_parallel.core.context_parallel.masks import RunPlan, plan_block, segments
from hyper_parallel.platform import P2POp
from hyper_parallel.platform.contract.attention_merge import stat_dtype
from hyper_parallel.platform.contract.common import CustomFunction, Work
from hyper_parallel.core.tensor_ops import stack

@dataclass(frozen=True)
class RingSpec:
    """What the ring needs besides the tensors (one argument: custom functions take
    non-tensor arguments positionally and pass them through untouched).

    Attributes:
        plan: the resolved configuration (exchange axis size, index, group, layout).
        seq_len: the global sequence length.
        causal: the causal mask.
        docs: document index per global position (``cu_seqlens``), or ``None``.
        scale: multiplies ``q k^T``; ``None`` for ``head_dim ** -0.5``.
    """

    plan: Plan
    seq_len: int
    causal: bool
    docs: np.ndarray | None
    scale: float | None

    def calls(self, q_pos: np.ndarray, step: int) -> list[RunPlan]:
        """The attention calls of this rank's queries against the block it holds at
        ``step`` (that of exchange rank ``(g - step) mod n``)."""
        n, g = self.plan.kv_size, self.plan.kv_index
        return plan_block(q_pos, self.plan.block_positions(self.seq_len, (g - step) % n), self.causal, self.docs)


def _shift(p: Any, xs: list[Any], group: Any, to: int, frm: int) -> list[Work]:
    """Start sending the tensors ``xs`` to group rank ``to`` and receiving tensors like them
    from ``frm`` (one batch; separate messages, so that nothing is copied into one). The
    receive buffers are not filled first (``zeros(fill=False)``): the receive writes them
    whole."""
    sends = [P2POp("isend", x.contiguous(), to, group) for x in xs]
    receives = [P2POp("irecv", p.zeros(tuple(x.shape), x.dtype, fill=False), frm, group) for x in xs]
    return p.batch_isend_irecv(sends + receives)


def _finish(works: list[Work]) -> list[Any]:
    """Wait for a ``_shift``; returns the received tensors."""
    half = len(works) // 2
    for work in works[:half]:
        work.wait()
    return [work.wait() for work in works[half:]]


class _Blocks:
    """The key/value block a rank holds at each step of the ring: this rank's own at step
    0, then that of exchange rank ``(g - step) mod n``. ``"ring"``: each is received from
    the previous rank while the current one is attended to (``n - 1`` shifts).
    ``"allgather"``: one all-gather of the stacked pair, started before step 0 (this
    rank's own block needs none) and waited for at step 1; blocks are views of it."""

    def __init__(self, p: Any, k: Any, v: Any, spec: RingSpec) -> None:
        self.p, self.spec, self.kv = p, spec, [k, v]
        self.gathered: Work | None = None
        self.works: list[Work] | None = None
        plan = spec.plan
        if plan.kv_exchange == "allgather" and plan.kv_size > 1:
            self.gathered = p.all_gather_into_tensor(stack([k, v], 0), group=plan.kv_group, async_op=True)

    def current(self, step: int) -> list[Any]:
        """The block of ``step``; in ring mode, starts receiving the next one."""
        plan = self.spec.plan
        n, g = plan.kv_size, plan.kv_index
        if self.gathered is not None:
            if step == 0:
                return self.kv
            both = self.gathered.wait()  # [2 n, batch, kv_seq, kv_heads, head_dim]
            j = (g - step) % n
            return [both[2 * j], both[2 * j + 1]]
        if self.works is not None:
            self.kv = _finish(self.works)
            self.works = None
        if step < n - 1:
            self.works = _shift(self.p, self.kv, plan.kv_group, (g + 1) % n, (g - 1) % n)
        return self.kv


class RingAttention(CustomFunction):
    """The ring of [Note: the ring and its backward] as one autograd function, with the
    key/value blocks shifted around the ring or all-gathered at once (``_Blocks``).

    ``forward(ctx, p, q, k, v, spec)``: ``q`` ``[batch, q_seq, heads, dim]``, ``k``/``v``
    ``[batch, kv_seq, kv_heads, dim]`` (BSHD, this rank's shard) -> the output
    ``[batch, q_seq, heads, dim]`` in ``q``'s dtype. Saves ``ctx.saved = (q, k, v, out,
    lse)`` and nothing else of tensor size, until its backward runs (once). Collectives,
    over ``spec.plan.kv_group``: ring: ``n - 1`` point-to-point shifts of the ``k``, ``v``
    pair (one batch of two messages each way) forward and again backward; all-gather: one
    all-gather of ``[2, batch, kv_seq, kv_heads, dim]`` forward and again backward. Both:
    ``n`` shifts of the ``max(float32, dtype)`` dK/dV accumulator pair backward.
    """

    @staticmethod
    def forward(ctx: Any, p: Any, q: Any, k: Any, v: Any, spec: RingSpec) -> Any:
        q_pos = spec.plan.block_positions(spec.seq_len, spec.plan.kv_index)
        accs: list[BlockResult | None] = [None] * len(segments(q_pos))
        blocks = _Blocks(p, k, v, spec)
        for step in range(spec.plan.kv_size):
            kv = blocks.current(step)
            forward_calls(p, accs, spec.calls(q_pos, step), q, kv[0], kv[1], spec.scale, merge_all=True)
            del kv
        del blocks
        out, lse = finish(p, accs, spec.calls(q_pos, 0), q)
        keep_for_backward(ctx, p, spec, q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Any) -> tuple[Any, ...]:
        p, spec = ctx.p, ctx.spec
        if ctx.saved is None:
            raise RuntimeError("ring attention: backward ran twice through one forward; its saved tensors are "
                               "released by the first (run the forward again)")
        q, k, v, out, lse = ctx.saved
        ctx.saved = None  # released after this backward, as autograd releases saved tensors
        plan = spec.plan
        n, g, group = plan.kv_size, plan.kv_index, plan.kv_group
        nxt, prev = (g + 1) % n, (g - 1) % n
        q_pos = plan.block_positions(spec.seq_len, g)
        dtype = stat_dtype(p, q.dtype)
        dq = None
        blocks = _Blocks(p, k, v, spec)
        incoming: list[Work] | None = None  # the shift of the accumulator received last step
        dkv: list[Any] = []
        for step in range(n):
            kv = blocks.current(step)
            grads = backward_calls(p, spec.calls(q_pos, step), dout, q, kv[0], kv[1], out, lse, spec.scale, dq=dq)
            del kv
            if grads is not None:
                dq = grads[0]
            # Waiting for the last shift also ends its send: the accumulator sent then
            # (the previous ``dkv``) is released here, not a step later. The block's
            # share is added into the received accumulator, in place where the
            # framework does it.
            if incoming is None:
                dkv = [p.zeros(tuple(k.shape), dtype), p.zeros(tuple(v.shape), dtype)] if grads is None \
                    else [grads[1], grads[2]]
            else:
                dkv = _finish(incoming)
                if grads is not None:
                    dkv = [add_rows(dkv[0], 0, grads[1]), add_rows(dkv[1], 0, grads[2])]
            del grads
            incoming = _shift(p, dkv, group, nxt, prev) if n > 1 else None
        del blocks
        home = dkv if incoming is None else _finish(incoming)  # the last hop: each accumulator home
        if dq is None:
            dq = p.zeros(tuple(q.shape), dtype)
        return None, p.to_dtype(dq, q.dtype), p.to_dtype(home[0], k.dtype), p.to_dtype(home[1], v.dtype), None


def ring_attention(p: Any, q: Any, k: Any, v: Any, plan: Plan, seq_len: int, causal: bool,
                   docs: np.ndarray | None, scale: float | None) -> Any:
    """Attention of this rank's ``q`` (BSHD) over the keys of every rank of the exchange
    axis, passed around the ring; returns ``[batch, q_seq, heads, head_dim]`` in
    ``q``'s dtype. See ``RingAttention`` for the communication and what is saved."""
    return p.apply_function(RingAttention, p, q, k, v, RingSpec(plan, seq_len, causal, docs, scale))
