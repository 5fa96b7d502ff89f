"""``scaled_dot_product_attention``: local attention, or the distributed algorithm of the
``ContextParallel`` module it runs in (see [Note: where the active context lives])."""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.blocks import block_attention
from hyper_parallel.core.context_parallel.context import Frame, current_frame
from hyper_parallel.core.context_parallel.masks import document_ids, plan_block
from hyper_parallel.core.context_parallel.ring import ring_attention
from hyper_parallel.core.context_parallel.sharded_qkv import frame_locals, like_q
from hyper_parallel.platform import get_platform

LAYOUTS = ("BSHD", "BNSD")


def _attend(p: Any, q: Any, k: Any, v: Any, q_pos: np.ndarray, k_pos: np.ndarray, causal: bool,
            docs: np.ndarray | None, scale: float | None) -> Any:
    """Attention of BSHD ``q`` at global positions ``q_pos`` over ``k``/``v`` at ``k_pos``:
    the calls of ``plan_block`` through the fused kernels ([Note: block attention])."""
    return block_attention(p, q, k, v, plan_block(q_pos, k_pos, causal, docs), scale)


def local_attention(q: Any, k: Any, v: Any, *, is_causal: bool = False, scale: float | None = None) -> Any:
    """Attention of BSHD ``q`` over ``k``/``v`` as they are, never routed to context
    parallelism, differentiable in ``q``, ``k``, ``v``: ``Platform.local_attention`` (the
    backend's fused kernel, forward and backward; shapes, defaults and errors there)."""
    return get_platform().local_attention(q, k, v, is_causal=is_causal, scale=scale)


def attend_locally(q: Any, k: Any, v: Any, *, is_causal: bool, scale: float | None, cu_seqlens: Any = None) -> Any:
    """Attention of BSHD ``q`` over ``k``/``v`` as they are (never routed to context
    parallelism), with packed documents when ``cu_seqlens`` is given: what
    ``scaled_dot_product_attention`` computes outside a ``ContextParallel`` module.

    Raises:
        ValueError: ``cu_seqlens`` with unequal q and k lengths, or not a valid cumulative
            length list of the sequence.
    """
    if cu_seqlens is None:
        return local_attention(q, k, v, is_causal=is_causal, scale=scale)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"scaled_dot_product_attention: cu_seqlens needs equal q and k sequence lengths "
                         f"(self-attention over one packed sequence); got {q.shape[1]} and {k.shape[1]}")
    docs = document_ids(cu_seqlens, q.shape[1])
    pos = np.arange(q.shape[1], dtype=np.int64)
    return _attend(get_platform(), q, k, v, pos, pos, is_causal, docs, scale)


def _check(q: Any, k: Any, v: Any, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"scaled_dot_product_attention: layout={layout!r} is not supported; use 'BSHD' "
                         "([batch, seq, heads, head_dim]) or 'BNSD' ([batch, heads, seq, head_dim])")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"scaled_dot_product_attention: q, k, v must be 4-D ({layout}); got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def _distributed(p: Any, frame: Frame, q: Any, k: Any, v: Any, causal: bool, cu_seqlens: Any,
                 scale: float | None) -> Any:
    plan = frame.plan
    expected = frame.seq_len // plan.kv_size
    if q.shape[1] != expected or k.shape[1] != expected:
        raise ValueError(f"scaled_dot_product_attention in {frame.module_name}: q/k sequence lengths "
                         f"{q.shape[1]}/{k.shape[1]} differ from the {expected} this rank holds after the hooks; "
                         "call it with the q, k, v the ContextParallel module received (self-attention)")
    docs = None if cu_seqlens is None else document_ids(cu_seqlens, frame.seq_len)
    if plan.kv_size == 1:  # pure Ulysses: whole sequences, in shard order
        pos = plan.block_positions(frame.seq_len, 0)
        return _attend(p, q, k, v, pos, pos, causal, docs, scale)
    return ring_attention(p, q, k, v, plan, frame.seq_len, causal, docs, scale)


def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, is_causal: bool = False, scale: float | None = None,
                                 cu_seqlens: Any = None, layout: str = "BSHD") -> Any:
    """Softmax attention ``softmax(q k^T * scale + mask) v``, local or context-parallel.

    Every path runs the platform's fused kernels, forward (``platform.attention``, which
    returns the log-sum-exp) and backward (``platform.attention_backward``), with
    structural masks: no score matrix is built (see ``docs/platform.md`` for the kernel
    of each backend and dtype). Outside a module hooked by ``ContextParallel`` this is
    one kernel call (``is_causal`` aligned top-left, as torch's). Inside one, ``q``/``k``/``v`` are the tensors that module
    received (sequence-sharded, or head-sharded after the Ulysses all-to-all of its
    hooks) and the module's algorithm runs: all-gather of K/V (one all-gather over the
    exchange axis, forward and again backward; dK/dV accumulated around the ring, see
    [Note: all-gather as a ring source] in ``ring``), ring attention (``n - 1``
    point-to-point shifts), or local attention over whole sequences (Ulysses). Masks follow the global positions each rank holds, so
    causal offsets, load balance and documents are exact in every mode. There q, k, v
    are the sequence-sharded DTensors the hooks hand in (or their local pieces), and
    so is the output ([Note: q/k/v as DTensors] in ``sharded_qkv``).

    Args:
        q: ``[batch, seq, heads, head_dim]`` (BSHD) or ``[batch, heads, seq, head_dim]``
            (BNSD), any floating dtype.
        k, v: like ``q`` with ``kv_heads`` heads, ``heads`` divisible by ``kv_heads``
            (grouped-query attention).
        is_causal: query at global position ``i`` sees keys at ``j <= i``.
        scale: multiplies ``q k^T``; default ``head_dim ** -0.5``.
        cu_seqlens: cumulative document lengths of the packed sequence
            ``[0, l0, l0 + l1, ..., seq]`` (ints, numpy or a 1-D integer tensor), of the
            whole sequence even when it is sharded: a query sees only keys of its own
            document (and, with ``is_causal``, not after it). The same for every batch row.
        layout: ``"BSHD"`` or ``"BNSD"``.

    Returns:
        The attention output, shaped and laid out like ``q``, in ``q``'s dtype (softmax
        statistics and the merge of partial results in ``max(float32, dtype)``: float64
        inputs are float64 end to end).

    Raises:
        ValueError: an unknown layout, non-4-D inputs, ``cu_seqlens`` that is not a valid
            cumulative length list of the full sequence, or sequence lengths that do not
            match what the hooks delivered (all raised before any communication).
    """
    _check(q, k, v, layout)
    p = get_platform()
    if layout == "BNSD":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    frame = current_frame()
    if frame is None:
        out = attend_locally(q, k, v, is_causal=is_causal, scale=scale, cu_seqlens=cu_seqlens)
    else:
        # the DTensors the hooks handed in ([Note: q/k/v as DTensors]) come back as one
        like = q
        locals_ = frame_locals(frame, "scaled_dot_product_attention", (q, k, v))
        if locals_ is not None:
            q, k, v = locals_
        frame.called = True
        out = _distributed(p, frame, q, k, v, is_causal, cu_seqlens, scale)
        if locals_ is not None:
            out = like_q(out, like)
    return out.transpose(1, 2) if layout == "BNSD" else out
