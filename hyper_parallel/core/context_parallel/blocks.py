"""Attention of query runs against planned key calls through the platform's fused kernels,
forward and backward, and the autograd function of local (communication-free) attention.

[Note: block attention]
Every mode of context parallelism computes, on each rank, attention of its query runs
against some key tensor, as the calls of ``masks.plan_block``. The forward runs
``platform.attention`` per call and merges the calls of a run by log-sum-exp
([Note: log-sum-exp merge] in ``platform.contract.attention_merge``); it keeps only the merged
output and log-sum-exp. The backward runs ``platform.attention_backward`` per call with
the *merged* output and log-sum-exp of the call's rows, which makes each call's
``dq``/``dk``/``dv`` its exact share of the gradient ([Note: attention kernels] in
``platform.contract.attention``): shares are summed, no merge is differentiated and no
score matrix exists anywhere in core. ``BlockAttention`` is this as one autograd
function for Ulysses and single-device packed documents (plain single-device attention is
``Platform.local_attention``, one fused call); the ring and all-gather run the same
two halves per rotating block (``ring``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.context_parallel.masks import BlockCall, RunPlan
from hyper_parallel.platform.contract.attention_merge import LSE_FLOOR, merge, stat_dtype
from hyper_parallel.platform.contract.common import CustomFunction

#: A partial result: output ``[batch, q_len, heads, head_dim]`` and log-sum-exp
#: ``[batch, heads, q_len]``.
BlockResult = tuple[Any, Any]


def key_runs(p: Any, x: Any, call: BlockCall) -> Any:
    """The key runs of ``call`` out of ``[batch, kv_seq, ...]``, concatenated."""
    if len(call.k_runs) == 1 and call.k_runs[0] == (0, x.shape[1]):
        return x
    if len(call.k_runs) == 1:
        return p.narrow(x, 1, *call.k_runs[0])
    return p.cat([p.narrow(x, 1, s, n) for s, n in call.k_runs], 1)


def _rows(p: Any, x: Any, dim: int, start: int, length: int) -> Any:
    return x if start == 0 and length == x.shape[dim] else p.narrow(x, dim, start, length)


def _pad_rows(p: Any, result: BlockResult, call: BlockCall, run: RunPlan) -> BlockResult:
    """A call's result over some rows of its run, padded to the whole run (output 0,
    log-sum-exp -inf where the call has no rows)."""
    before, after = call.q_start - run.start, run.start + run.length - call.q_start - call.q_len
    if before == 0 and after == 0:
        return result
    out, lse = result
    return p.pad(out, 1, before, after), p.pad(lse, 2, before, after, float("-inf"))


def forward_calls(p: Any, accs: list[BlockResult | None], plans: list[RunPlan], q: Any, k: Any, v: Any,
                  scale: float | None, *, merge_all: bool = False) -> None:
    """Merge the calls of each run of ``plans`` into ``accs`` (one entry per run,
    ``None`` until a call lands): ``q`` BSHD, ``k``/``v`` the key tensor of the calls.
    A call spanning later runs ([Note: coalesced calls]) hands each its rows. A run's
    only result is kept as the kernel returned it unless ``merge_all`` (more calls will
    be merged in later: the ring)."""
    landings = [0] * len(plans)
    for run in plans:
        for call in run.calls:
            for j in _runs_of(plans, call):
                landings[j] += 1
    for run in plans:
        for call in run.calls:
            result = p.attention(_rows(p, q, 1, call.q_start, call.q_len), key_runs(p, k, call),
                                 key_runs(p, v, call), scale=scale, mask=call.mask)
            for j in _runs_of(plans, call):
                part, rows = _clip(p, result, call, plans[j])
                part = _pad_rows(p, part, rows, plans[j])
                accs[j] = part if landings[j] == 1 and not merge_all else merge(p, accs[j], part)


def _runs_of(plans: list[RunPlan], call: BlockCall) -> list[int]:
    """The indices of the runs whose rows ``call`` covers (runs are sorted and adjacent)."""
    end = call.q_start + call.q_len
    return [j for j, run in enumerate(plans) if run.start < end and call.q_start < run.start + run.length]


def _clip(p: Any, result: BlockResult, call: BlockCall, run: RunPlan) -> tuple[BlockResult, BlockCall]:
    """The rows of ``call``'s result that lie in ``run``, and the call narrowed to them."""
    lo, hi = max(call.q_start, run.start), min(call.q_start + call.q_len, run.start + run.length)
    if (lo, hi) == (call.q_start, call.q_start + call.q_len):
        return result, call
    out, lse = result
    rows = BlockCall(lo, hi - lo, call.k_runs, call.mask)
    return (p.narrow(out, 1, lo - call.q_start, hi - lo), p.narrow(lse, 2, lo - call.q_start, hi - lo)), rows


def finish(p: Any, accs: list[BlockResult | None], plans: list[RunPlan], q: Any) -> BlockResult:
    """``(out, lse)`` of all runs: ``out`` ``[batch, q_seq, heads, dim]`` in ``q``'s dtype,
    ``lse`` ``[batch, heads, q_seq]`` in ``max(float32, dtype)`` (a run that saw no key
    has output 0 and log-sum-exp at or below ``LSE_FLOOR``)."""
    b, heads, dim = int(q.shape[0]), int(q.shape[2]), int(q.shape[3])
    dtype = stat_dtype(p, q.dtype)
    outs, lses = [], []
    for run, acc in zip(plans, accs):
        if acc is None:
            outs.append(p.zeros((b, run.length, heads, dim), q.dtype))
            lses.append(p.full((b, heads, run.length), LSE_FLOOR, dtype))
        else:
            outs.append(p.to_dtype(acc[0], q.dtype))
            lses.append(p.to_dtype(acc[1], dtype))
    return (outs[0] if len(outs) == 1 else p.cat(outs, 1)), (lses[0] if len(lses) == 1 else p.cat(lses, 2))


def add_rows(dst: Any, start: int, src: Any) -> Any:
    """``dst[:, start:start + n] += src`` for ``dst`` ``[batch, seq, ...]`` and ``src``
    ``[batch, n, ...]`` of ``dst``'s dtype (outside autograd); returns the sum. In place where
    the framework does it (a whole-tensor ``+=`` on MindSpore makes a new tensor, which
    is why the result is returned); a part is written through ``__setitem__``, in place
    on every backend."""
    n = int(src.shape[1])
    if start == 0 and n == int(dst.shape[1]):
        dst += src
        return dst
    dst[:, start:start + n] += src
    return dst


def _whole(call: BlockCall, q: Any, k: Any) -> bool:
    return call.q_start == 0 and call.q_len == int(q.shape[1]) and call.k_runs == ((0, int(k.shape[1])),)


def backward_calls(p: Any, plans: list[RunPlan], dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                   scale: float | None, *, dq: Any = None, accumulate: bool = True) -> tuple[Any, Any, Any] | None:
    """This key tensor's share of the gradients: ``(dq [like q], dk, dv [like k])`` in
    ``max(float32, dtype)``, or ``None`` when no call reads it; ``out``/``lse`` are the
    merged ones over every key the queries see ([Note: block attention]).

    Each call's gradients are added into the result as soon as the kernel returns them
    (``add_rows``), so the working set is the three results and one call's gradients,
    not every call's. ``dq``, when given, is an accumulator of ``max(float32, dtype)``
    the queries' share is added into (in place where the framework does it; the sum is
    returned either way). Without ``accumulate`` (nothing is added to the result later)
    a single call over everything keeps the kernel's gradients in the input dtype: a
    bfloat16 kernel's gradients are not widened to be narrowed back."""
    calls = [call for run in plans for call in run.calls]
    if not calls:
        return None
    dtype = stat_dtype(p, q.dtype)

    def kernel(call: BlockCall) -> tuple[Any, Any, Any]:
        rows = (call.q_start, call.q_len)
        return p.attention_backward(_rows(p, dout, 1, *rows), _rows(p, q, 1, *rows), key_runs(p, k, call),
                                    key_runs(p, v, call), _rows(p, out, 1, *rows), _rows(p, lse, 2, *rows),
                                    scale=scale, mask=call.mask)

    if len(calls) == 1 and _whole(calls[0], q, k):
        gq, gk, gv = kernel(calls[0])
        if not accumulate and dq is None:
            return gq, gk, gv
        gq = p.to_dtype(gq, dtype)
        return (gq if dq is None else add_rows(dq, 0, gq)), p.to_dtype(gk, dtype), p.to_dtype(gv, dtype)
    dq = p.zeros(tuple(q.shape), dtype) if dq is None else dq
    dk = dv = None
    every_key = ((0, int(k.shape[1])),)
    for call in calls:
        gq, gk, gv = kernel(call)
        dq = add_rows(dq, call.q_start, p.to_dtype(gq, dtype))
        gk, gv = p.to_dtype(gk, dtype), p.to_dtype(gv, dtype)
        if dk is None and call.k_runs == every_key:
            # The first share over every key becomes the sum itself: no zeros to add it to
            # (a load-balanced ring step: the tail queries against the whole block).
            dk, dv = gk, gv
            continue
        if dk is None:
            dk, dv = p.zeros(tuple(k.shape), dtype), p.zeros(tuple(v.shape), dtype)
        offset = 0
        for start, n in call.k_runs:
            whole = n == int(gk.shape[1])
            dk = add_rows(dk, start, gk if whole else p.narrow(gk, 1, offset, n))
            dv = add_rows(dv, start, gv if whole else p.narrow(gv, 1, offset, n))
            offset += n
        del gq, gk, gv
    return dq, dk, dv


def keep_for_backward(ctx: Any, p: Any, spec: Any, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
    """Store on ``ctx`` what an attention backward needs: the platform, the spec and
    ``(q, k, v, out, lse)``. ``out`` itself on ctx would make a cycle through the autograd
    node (out -> its grad_fn -> ctx -> out) that outlives the step: a detached alias is kept."""
    ctx.p, ctx.spec = p, spec
    ctx.saved = (q, k, v, p.detach(out), lse)


@dataclass(frozen=True)
class BlockSpec:
    """What ``BlockAttention`` needs besides the tensors: the planned runs and the scale
    (``None``: ``head_dim ** -0.5``)."""

    plans: tuple[RunPlan, ...]
    scale: float | None


class BlockAttention(CustomFunction):
    """Attention of ``q`` against ``k``/``v`` as planned (no communication); see
    [Note: block attention].

    ``forward(ctx, p, q, k, v, spec)``: ``q`` ``[batch, q_seq, heads, dim]``, ``k``/``v``
    ``[batch, kv_seq, kv_heads, dim]`` -> ``[batch, q_seq, heads, dim]`` in ``q``'s
    dtype. Saves ``q``, ``k``, ``v``, the output and the log-sum-exp
    (``[batch, heads, q_seq]``), like a fused kernel's own autograd.
    """

    @staticmethod
    def forward(ctx: Any, p: Any, q: Any, k: Any, v: Any, spec: BlockSpec) -> Any:
        plans = list(spec.plans)
        accs: list[BlockResult | None] = [None] * len(plans)
        forward_calls(p, accs, plans, q, k, v, spec.scale)
        out, lse = finish(p, accs, plans, q)
        keep_for_backward(ctx, p, spec, q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Any) -> tuple[Any, ...]:
        # Kept after the backward (released with the graph): torch's zero-bubble weight
        # pass re-walks a kept graph, running this backward a second time.
        q, k, v, out, lse = ctx.saved
        p = ctx.p
        grads = backward_calls(ctx.p, list(ctx.spec.plans), dout, q, k, v, out, lse, ctx.spec.scale,
                               accumulate=False)
        if grads is None:
            return None, p.zeros(tuple(q.shape), q.dtype), p.zeros(tuple(k.shape), k.dtype), \
                p.zeros(tuple(v.shape), v.dtype), None
        dq, dk, dv = grads
        return None, p.to_dtype(dq, q.dtype), p.to_dtype(dk, k.dtype), p.to_dtype(dv, v.dtype), None


def block_attention(p: Any, q: Any, k: Any, v: Any, plans: list[RunPlan], scale: float | None) -> Any:
    """``BlockAttention`` applied: differentiable in ``q``, ``k``, ``v``."""
    return p.apply_function(BlockAttention, p, q, k, v, BlockSpec(tuple(plans), scale))
