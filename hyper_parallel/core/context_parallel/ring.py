"""Ring attention: key/value blocks travel around the ring of the exchange axis while each
rank attends its queries to the block it holds (Liu et al., "Ring Attention with
Blockwise Transformers", 2023; torch's ``_templated_ring_attention``).

[Note: the ring and its backward]
Rank ``g`` of ``n`` holds its query block throughout. At step ``s`` it holds the key/value
block of rank ``(g - s) mod n``: before attending to it, it starts sending that block to
rank ``g + 1`` and receiving the next from rank ``g - 1`` (one ``batch_isend_irecv``),
so the transfer overlaps the block's attention, and waits only after. Partial outputs
are merged by log-sum-exp in float32 ([Note: log-sum-exp merge] in ``blocks``). Which
pairs a block may attend to comes from global positions ([Note: segments] in ``masks``),
so causal offsets, the head-tail layout and packed documents need nothing ring-specific;
blocks entirely in a query's future are skipped, not masked.

Backward is autograd's: each step's block attention is differentiated where it ran, and
the receive ``_ShiftWait`` is an autograd function whose backward sends the gradient of
the block it received back to the rank it came from. The gradient of a key/value block
thus travels the ring in the opposite direction, accumulating each rank's dK/dV
contribution on the way, and arrives home after ``n - 1`` hops.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.blocks import BlockResult, merge, run_call
from hyper_parallel.core.context_parallel.context import Plan
from hyper_parallel.core.context_parallel.masks import plan_block, segments
from hyper_parallel.platform import P2POp
from hyper_parallel.platform.contract.common import CustomFunction, Work


def _shift(p: Any, x: Any, group: Any, to: int, frm: int) -> list[Work]:
    """Start sending ``x`` to group rank ``to`` and receiving a tensor like it from ``frm``."""
    buffer = p.zeros(tuple(x.shape), x.dtype)
    return p.batch_isend_irecv([P2POp("isend", x.contiguous(), to, group), P2POp("irecv", buffer, frm, group)])


class _ShiftWait(CustomFunction):
    """Forward: finish the shift started by ``_shift`` and return the received block.
    Backward: send the block's gradient back to where it came from and receive the
    gradient of ``x`` from where ``x`` went; see [Note: the ring and its backward]."""

    @staticmethod
    def forward(ctx: Any, p: Any, x: Any, works: list[Work], group: Any, to: int, frm: int) -> Any:
        ctx.p, ctx.group, ctx.to, ctx.frm = p, group, to, frm
        works[0].wait()
        return works[1].wait()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        works = _shift(ctx.p, grad, ctx.group, ctx.frm, ctx.to)
        works[0].wait()
        return None, works[1].wait(), None, None, None, None


class _Anchor(CustomFunction):
    """Identity on ``out`` that also takes the last received block, with a zero gradient
    for it. A rank that skips that block (all of it in its queries' future) would
    otherwise leave the last ``_ShiftWait`` out of its autograd graph, never run its
    backward, and leave the peer's backward send unmatched: every rank must run every
    backward shift, in the same order."""

    @staticmethod
    def forward(ctx: Any, p: Any, out: Any, last: Any) -> Any:
        ctx.p, ctx.shape, ctx.dtype = p, tuple(last.shape), last.dtype
        return p.clone(out)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        return None, grad, ctx.p.zeros(ctx.shape, ctx.dtype)


def ring_attention(p: Any, q: Any, k: Any, v: Any, plan: Plan, seq_len: int, causal: bool,
                   docs: np.ndarray | None, scale: float | None) -> Any:
    """Attention of this rank's ``q`` (BSHD) over the keys of every rank of the exchange
    axis, passed around the ring; returns ``[batch, q_seq, heads, head_dim]`` in
    ``q``'s dtype. Point-to-point over ``plan.kv_group``: ``n - 1`` shifts of
    ``[2, batch, kv_seq, kv_heads, head_dim]`` forward and as many of its gradient
    backward."""
    n, g, group = plan.kv_size, plan.kv_index, plan.kv_group
    q_pos = plan.block_positions(seq_len, g)
    runs = segments(q_pos)
    accs: list[BlockResult | None] = [None] * len(runs)
    kv = p.stack([k, v], 0).contiguous()  # one message per step
    nxt, prev = (g + 1) % n, (g - 1) % n
    for step in range(n):
        works = _shift(p, kv, group, nxt, prev) if step < n - 1 else None
        k_block, v_block = kv[0], kv[1]
        calls = plan_block(q_pos, plan.block_positions(seq_len, (g - step) % n), causal, docs)
        for i, call in enumerate(calls):
            if call is not None:
                accs[i] = merge(p, accs[i], run_call(p, q, k_block, v_block, call, scale))
        if works is not None:
            kv = p.apply_function(_ShiftWait, p, kv, works, group, nxt, prev)
    outs = []
    for (_, length), acc in zip(runs, accs):
        if acc is None:  # sees no key anywhere: the contract's output for such a query is 0
            outs.append(p.zeros((q.shape[0], length, q.shape[2], q.shape[3]), q.dtype))
        else:
            outs.append(p.to_dtype(acc[0], q.dtype))
    out = outs[0] if len(outs) == 1 else p.cat(outs, 1)
    return p.apply_function(_Anchor, p, out, kv) if n > 1 else out
