"""Ring attention: key/value blocks travel around the ring of the exchange axis while each
rank attends its queries to the block it holds (Liu et al., "Ring Attention with
Blockwise Transformers for Near-Infinite Context", 2023; torch's
``_templated_ring_attention`` and ``_templated_ring_attention_backward``).

[Note: the ring and its backward]
Rank ``g`` of ``n`` holds its query block throughout. At step ``s`` it holds the key/value
block of rank ``(g - s) mod n``: before attending to it, it starts sending that block to
rank ``g + 1`` and receiving the next from rank ``g - 1`` (one ``batch_isend_irecv``),
so the transfer overlaps the block's attention, and waits only after. Partial outputs
are merged by log-sum-exp in float32 ([Note: log-sum-exp merge] in ``blocks``). Which
pairs a block may attend to comes from global positions ([Note: segments] in ``masks``),
so causal offsets, the head-tail layout and packed documents need nothing ring-specific;
blocks entirely in a query's future are skipped, not masked.

The whole ring is one autograd function (``RingAttention``) that saves only this rank's
``q``, ``k``, ``v``, its output and the float32 log-sum-exp ``lse`` of the merged scores:
``O(seq / n)`` per rank, where differentiating each step's block attention would keep
every block received (``O(seq)``, like all-gather). Backward rotates the key/value blocks
around the ring again, in the same direction, and recomputes each block's probabilities
from the saved ``lse`` (``P = exp(q k^T * scale - lse)``: the global softmax, so block
gradients add up without any merge; FlashAttention's backward):
``dV += P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ += dS K * scale``,
``dK += dS^T Q * scale``. dQ stays on the rank; the dK/dV accumulator of a block travels
with the block: at step ``s`` rank ``g`` adds its queries' contribution to block
``g - s`` into the accumulator it received from rank ``g - 1`` and sends it on to
``g + 1``; after ``n`` such hops (the last one without its block) every accumulator is
home, holding the contributions of every rank's queries. The block send is started
before the block's gradient is computed and the accumulator's send right after, so both
overlap computation; the accumulators are float32 whatever the input dtype. Every rank
runs every step and every shift in the same order, including steps whose block it
skips (a zero contribution is sent on), so sends and receives always match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.blocks import BlockResult, floor_lse, merge, run_call
from hyper_parallel.core.context_parallel.context import Plan
from hyper_parallel.core.context_parallel.masks import BlockCall, plan_block, segments
from hyper_parallel.platform import P2POp
from hyper_parallel.platform.contract.common import CustomFunction, Work

#: Added to the scores of disallowed pairs before the exponential in backward; with the
#: multiplicative mask after it, a disallowed pair's probability is exactly 0 (see
#: ``_block_grads``).
_MASKED = -1.0e30


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

    def calls(self, q_pos: np.ndarray, step: int) -> list[BlockCall | None]:
        """The attention calls of this rank's queries against the block it holds at
        ``step`` (that of exchange rank ``(g - step) mod n``)."""
        n, g = self.plan.kv_size, self.plan.kv_index
        return plan_block(q_pos, self.plan.block_positions(self.seq_len, (g - step) % n), self.causal, self.docs)


def _shift(p: Any, x: Any, group: Any, to: int, frm: int) -> list[Work]:
    """Start sending ``x`` to group rank ``to`` and receiving a tensor like it from ``frm``."""
    buffer = p.zeros(tuple(x.shape), x.dtype)
    return p.batch_isend_irecv([P2POp("isend", x.contiguous(), to, group), P2POp("irecv", buffer, frm, group)])


def _finish(works: list[Work]) -> Any:
    """Wait for a ``_shift``; returns the received tensor."""
    works[0].wait()
    return works[1].wait()


def _key_runs(p: Any, x: Any, call: BlockCall) -> Any:
    """The key runs of ``call`` out of a block ``[batch, kv_seq, ...]``, concatenated."""
    if len(call.k_runs) == 1 and call.k_runs[0] == (0, x.shape[1]):
        return x
    return p.cat([p.narrow(x, 1, s, n) for s, n in call.k_runs], 1)


def _scatter_runs(p: Any, part: Any, call: BlockCall, length: int) -> Any:
    """Inverse of ``_key_runs`` for a gradient: ``part`` ``[batch, sum of runs, ...]`` laid
    out at its runs of a ``[batch, length, ...]`` zero tensor."""
    pieces, at, used = [], 0, 0
    shape = list(part.shape)
    for start, n in call.k_runs:
        if start > at:
            pieces.append(p.zeros(tuple([shape[0], start - at] + shape[2:]), part.dtype))
        pieces.append(p.narrow(part, 1, used, n))
        at, used = start + n, used + n
    if at < length:
        pieces.append(p.zeros(tuple([shape[0], length - at] + shape[2:]), part.dtype))
    return pieces[0] if len(pieces) == 1 else p.cat(pieces, 1)


def _repeat_heads(p: Any, x: Any, group: int) -> Any:
    """``[batch, seq, kv_heads, dim]`` -> ``[batch, seq, kv_heads * group, dim]``, each
    key/value head repeated for the ``group`` query heads that use it (query head ``h``
    uses key/value head ``h // group``)."""
    if group == 1:
        return x
    b, s, kh, d = (int(n) for n in x.shape)
    return p.stack([x] * group, 3).reshape(b, s, kh * group, d)


def _fold_heads(x: Any, group: int) -> Any:
    """Inverse of ``_repeat_heads`` for a gradient: sum over the query heads of a group."""
    if group == 1:
        return x
    b, s, h, d = (int(n) for n in x.shape)
    return x.reshape(b, s, h // group, group, d).sum(3)


def _block_grads(p: Any, q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, call: BlockCall,
                 scale: float) -> tuple[Any, Any, Any]:
    """Float32 ``(dq, dk, dv)`` of one block call from the global softmax statistics; see
    [Note: the ring and its backward].

    Args:
        q: ``[batch, q_len, heads, dim]`` (the call's query rows), float32.
        k, v: ``[batch, k_len, kv_heads, dim]`` (the call's key runs), float32.
        dout: ``[batch, q_len, heads, dim]`` float32, the output gradient of those rows.
        lse: ``[batch, heads, q_len]`` float32, their log-sum-exp over every key.
        delta: ``[batch, heads, q_len]`` float32, ``rowsum(dout * out)``.

    Returns:
        ``dq`` like ``q``; ``dk``, ``dv`` like ``k``.
    """
    group = int(q.shape[2]) // int(k.shape[2])
    qh = q.transpose(1, 2)  # [batch, heads, q_len, dim]
    kh = _repeat_heads(p, k, group).transpose(1, 2)  # [batch, heads, k_len, dim]
    vh = _repeat_heads(p, v, group).transpose(1, 2)
    doh = dout.transpose(1, 2)
    scores = (qh @ kh.transpose(2, 3)) * scale  # [batch, heads, q_len, k_len]
    allowed = call.mask
    if call.causal:
        allowed = np.tril(np.ones((call.q_len, int(k.shape[1])), dtype=bool))
    if allowed is not None:
        # The additive bias keeps exp() of a disallowed pair from overflowing; the factor
        # makes it exactly 0 even for a query whose lse is floored (it sees no key).
        scores = scores + p.from_numpy(np.where(allowed, 0.0, _MASKED).astype(np.float32))
    probs = (scores - lse.unsqueeze(-1)).exp()
    if allowed is not None:
        probs = probs * p.from_numpy(allowed.astype(np.float32))
    dv = probs.transpose(2, 3) @ doh  # [batch, heads, k_len, dim]
    dscores = probs * ((doh @ vh.transpose(2, 3)) - delta.unsqueeze(-1))
    dq = (dscores @ kh) * scale
    dk = (dscores.transpose(2, 3) @ qh) * scale
    return (dq.transpose(1, 2), _fold_heads(dk.transpose(1, 2), group), _fold_heads(dv.transpose(1, 2), group))


class RingAttention(CustomFunction):
    """The ring of [Note: the ring and its backward] as one autograd function.

    ``forward(ctx, p, q, k, v, spec)``: ``q`` ``[batch, q_seq, heads, dim]``, ``k``/``v``
    ``[batch, kv_seq, kv_heads, dim]`` (BSHD, this rank's shard) -> the output
    ``[batch, q_seq, heads, dim]`` in ``q``'s dtype. Saves ``ctx.saved = (q, k, v, out,
    lse)`` and nothing else of tensor size, until its backward runs (once). Collectives: ``n - 1`` shifts of
    ``[2, batch, kv_seq, kv_heads, dim]`` forward; ``n - 1`` of it and ``n`` of its
    float32 gradient backward, point-to-point over ``spec.plan.kv_group``.
    """

    @staticmethod
    def forward(ctx: Any, p: Any, q: Any, k: Any, v: Any, spec: RingSpec) -> Any:
        plan = spec.plan
        n, g, group = plan.kv_size, plan.kv_index, plan.kv_group
        q_pos = plan.block_positions(spec.seq_len, g)
        runs = segments(q_pos)
        accs: list[BlockResult | None] = [None] * len(runs)
        kv = p.stack([k, v], 0).contiguous()  # one message per step
        for step in range(n):
            works = _shift(p, kv, group, (g + 1) % n, (g - 1) % n) if step < n - 1 else None
            for i, call in enumerate(spec.calls(q_pos, step)):
                if call is not None:
                    accs[i] = merge(p, accs[i], run_call(p, q, kv[0], kv[1], call, spec.scale))
            if works is not None:
                kv = _finish(works)
        outs, lses = [], []
        b, heads, dim = int(q.shape[0]), int(q.shape[2]), int(q.shape[3])
        for (_, length), acc in zip(runs, accs):
            if acc is None:  # sees no key anywhere: the contract's output for such a query is 0
                outs.append(p.zeros((b, length, heads, dim), q.dtype))
                lses.append(floor_lse(p, p.full((b, heads, length), float("-inf"), p.dtype("float32"))))
            else:
                outs.append(p.to_dtype(acc[0], q.dtype))
                lses.append(acc[1])
        out = outs[0] if len(outs) == 1 else p.cat(outs, 1)
        lse = lses[0] if len(lses) == 1 else p.cat(lses, 2)  # [batch, heads, q_seq] float32
        ctx.p, ctx.spec = p, spec
        # ``out`` itself on ctx would make a cycle through the autograd node (out ->
        # its grad_fn -> ctx -> out) that outlives the step: keep a detached alias.
        ctx.saved = (q, k, v, p.detach(out), lse)
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
        scale = spec.scale if spec.scale is not None else float(q.shape[3]) ** -0.5
        q_pos = plan.block_positions(spec.seq_len, g)
        runs = segments(q_pos)
        qf, dof = q.float(), dout.float()
        delta = (dof * out.float()).sum(-1).transpose(1, 2)  # [batch, heads, q_seq]
        dq_runs: list[Any] = [None] * len(runs)
        kv_shape = (2,) + tuple(int(x) for x in k.shape)
        kv = p.stack([k, v], 0).contiguous()
        incoming: list[Work] | None = None  # the shift of the accumulator received last step
        for step in range(n):
            kv_works = _shift(p, kv, group, nxt, prev) if step < n - 1 else None
            kf, vf = kv[0].float(), kv[1].float()
            dk_block = dv_block = None
            for i, call in enumerate(spec.calls(q_pos, step)):
                if call is None:
                    continue
                rows = (call.q_start, call.q_len)
                dq, dk, dv = _block_grads(p, p.narrow(qf, 1, *rows), _key_runs(p, kf, call), _key_runs(p, vf, call),
                                          p.narrow(dof, 1, *rows), p.narrow(lse, 2, *rows),
                                          p.narrow(delta, 2, *rows), call, scale)
                dq_runs[i] = dq if dq_runs[i] is None else dq_runs[i] + dq
                dk = _scatter_runs(p, dk, call, int(k.shape[1]))
                dv = _scatter_runs(p, dv, call, int(k.shape[1]))
                dk_block = dk if dk_block is None else dk_block + dk
                dv_block = dv if dv_block is None else dv_block + dv
            dkv = p.zeros(kv_shape, p.dtype("float32")) if dk_block is None else p.stack([dk_block, dv_block], 0)
            if incoming is not None:
                dkv = dkv + _finish(incoming)
            incoming = _shift(p, dkv.contiguous(), group, nxt, prev) if n > 1 else None
            if kv_works is not None:
                kv = _finish(kv_works)
            home = dkv
        if incoming is not None:  # the last hop: each accumulator back to its block's rank
            home = _finish(incoming)
        b, heads, dim = int(q.shape[0]), int(q.shape[2]), int(q.shape[3])
        dqs = [p.zeros((b, length, heads, dim), p.dtype("float32")) if dq is None else dq
               for (_, length), dq in zip(runs, dq_runs)]
        dq = dqs[0] if len(dqs) == 1 else p.cat(dqs, 1)
        return None, p.to_dtype(dq, q.dtype), p.to_dtype(home[0], k.dtype), p.to_dtype(home[1], v.dtype), None


def ring_attention(p: Any, q: Any, k: Any, v: Any, plan: Plan, seq_len: int, causal: bool,
                   docs: np.ndarray | None, scale: float | None) -> Any:
    """Attention of this rank's ``q`` (BSHD) over the keys of every rank of the exchange
    axis, passed around the ring; returns ``[batch, q_seq, heads, head_dim]`` in
    ``q``'s dtype. See ``RingAttention`` for the communication and what is saved."""
    return p.apply_function(RingAttention, p, q, k, v, RingSpec(plan, seq_len, causal, docs, scale))
