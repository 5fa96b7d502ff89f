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
``platform.attention_pieces``). Which
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.blocks import (
    BlockResult,
    backward_calls,
    finish,
    forward_calls,
    keep_for_backward,
)
from hyper_parallel.core.context_parallel.context import Plan
from hyper_parallel.core.context_parallel.masks import RunPlan, plan_block, segments
from hyper_parallel.platform import P2POp
from hyper_parallel.platform.attention_pieces import stat_dtype
from hyper_parallel.platform.contract.common import CustomFunction, Work

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
    from ``frm`` (one batch; separate messages, so that nothing is copied into one)."""
    sends = [P2POp("isend", x.contiguous(), to, group) for x in xs]
    receives = [P2POp("irecv", p.zeros(tuple(x.shape), x.dtype), frm, group) for x in xs]
    return p.batch_isend_irecv(sends + receives)


def _finish(works: list[Work]) -> list[Any]:
    """Wait for a ``_shift``; returns the received tensors."""
    half = len(works) // 2
    for work in works[:half]:
        work.wait()
    return [work.wait() for work in works[half:]]


class RingAttention(CustomFunction):
    """The ring of [Note: the ring and its backward] as one autograd function.

    ``forward(ctx, p, q, k, v, spec)``: ``q`` ``[batch, q_seq, heads, dim]``, ``k``/``v``
    ``[batch, kv_seq, kv_heads, dim]`` (BSHD, this rank's shard) -> the output
    ``[batch, q_seq, heads, dim]`` in ``q``'s dtype. Saves ``ctx.saved = (q, k, v, out,
    lse)`` and nothing else of tensor size, until its backward runs (once). Collectives:
    ``n - 1`` shifts of the ``[batch, kv_seq, kv_heads, dim]`` pair ``k``, ``v`` (one
    batch of two messages each way) forward; ``n - 1`` of it and ``n`` of its
    ``max(float32, dtype)`` gradient pair backward, point-to-point over
    ``spec.plan.kv_group``.
    """

    @staticmethod
    def forward(ctx: Any, p: Any, q: Any, k: Any, v: Any, spec: RingSpec) -> Any:
        plan = spec.plan
        n, g, group = plan.kv_size, plan.kv_index, plan.kv_group
        q_pos = plan.block_positions(spec.seq_len, g)
        accs: list[BlockResult | None] = [None] * len(segments(q_pos))
        kv = [k, v]
        for step in range(n):
            works = _shift(p, kv, group, (g + 1) % n, (g - 1) % n) if step < n - 1 else None
            forward_calls(p, accs, spec.calls(q_pos, step), q, kv[0], kv[1], spec.scale, merge_all=True)
            if works is not None:
                kv = _finish(works)
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
        kv = [k, v]
        incoming: list[Work] | None = None  # the shift of the accumulator received last step
        dkv: list[Any] = []
        for step in range(n):
            kv_works = _shift(p, kv, group, nxt, prev) if step < n - 1 else None
            grads = backward_calls(p, spec.calls(q_pos, step), dout, q, kv[0], kv[1], out, lse, spec.scale)
            if grads is None:
                mine = [p.zeros(tuple(k.shape), dtype), p.zeros(tuple(v.shape), dtype)]
            else:
                dq = grads[0] if dq is None else dq + grads[0]
                mine = [grads[1], grads[2]]
            del grads
            # Waiting for the last shift also ends its send: the accumulator sent then
            # (the previous ``dkv``) is released here, not a step later.
            dkv = mine if incoming is None else [a + b for a, b in zip(mine, _finish(incoming))]
            del mine
            incoming = _shift(p, dkv, group, nxt, prev) if n > 1 else None
            if kv_works is not None:
                kv = _finish(kv_works)
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
