"""q/k/v as DTensors inside a ``ContextParallel`` module, and fused attention ops on DTensors.

[Note: q/k/v as DTensors]
In the exchange modes (``ulysses_degree < cp``: all-gather or ring K/V, hybrid) the
pre-hook hands the module q, k, v as DTensors on the plan's mesh: ``Shard(seq_dim)``
over the exchange axis (and ``Shard(head_dim)`` over the Ulysses axis in hybrid mode),
with the global shape. Two things follow:

- the module's reshapes, transposes and casts of q/k/v run through the sharding rules
  and keep the sequence sharding, so whatever attention call the module ends with sees
  sequence-sharded DTensors;
- an attention call the module makes on them is *recognisable*, and routed to the
  plan's exchange: ``hyper_parallel.scaled_dot_product_attention`` (core, below), and a
  framework's fused attention op, which a backend intercepts on its DTensor class and
  translates into ``attention_on_dtensors`` here (MindSpore: the ``FlashAttentionScore``
  primitive that MindFormers' ``FlashAttention`` cell calls). This is how torch's own
  context parallelism reaches ``scaled_dot_product_attention`` too: a DTensor op handler
  for the fused attention op on sequence-sharded inputs.

The post-hook takes the module's output back to this rank's local piece (redistributing
first if the module changed its placements). Pure Ulysses (``ulysses_degree == cp``)
hands plain tensors: the module holds whole sequences and any attention runs as it is.

The same translations serve fused attention ops on q/k/v sharded by batch and heads only
(tensor parallelism's head-sharded q/k/v, no ``ContextParallel`` module):
``attention_on_local_shards`` has each rank attend on its own pieces, which is exact
because attention is independent across batch rows and heads.

The DTensors' global order along the sequence is the order of the shards: with
``load_balance`` (head-tail chunks) it is not the order of the tokens. Nothing in a
core-attention module reads it (the attention takes positions from the plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.context_parallel.context import Frame, Plan, current_frame
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard

#: fused-kernel input layouts: the dims of batch, sequence and heads; ``None`` where
#: heads and head features share the last dim (``H = heads * head_dim``)
FUSED_LAYOUTS: dict[str, tuple[int | None, int, int | None]] = {
    "BSH": (0, 1, None), "SBH": (1, 0, None), "BNSD": (0, 2, 1), "BSND": (0, 1, 2), "TND": (None, 0, 1),
}


def qkv_placements(plan: Plan, seq_dim: int, head_dim: int) -> tuple[Placement, ...]:
    """The placements of q/k/v on ``plan.mesh`` (see the Note)."""
    if plan.mesh.ndim == 2:  # (exchange, ulysses); a Ulysses axis of one rank shards nothing
        return Shard(seq_dim), (Shard(head_dim) if plan.ulysses_size > 1 else Replicate())
    return (Shard(seq_dim),)


#: q/k/v's mesh and placements when they reach the module as DTensors sharded by heads
#: (tensor parallelism): ``(mesh, placements)``
Outer = tuple[Any, tuple[Placement, ...]]


def take_outer_sharding(name: str, tensors: Sequence[Any], seq_dim: int,
                        cp_mesh: Any) -> tuple[list[Any], Outer | None]:
    """[Note: context parallelism over tensor-parallel heads] q/k/v that reach a
    ``ContextParallel`` module as DTensors of another mesh (MindFormers' tensor
    parallelism hands its core attention heads sharded over ``tp``) are independent
    attention problems per rank of that mesh: each rank runs context parallelism on its
    own heads. Returns their local pieces (``to_local``, differentiable) and ``(mesh,
    placements)``, which ``restore_outer_sharding`` puts back on the output; plain
    tensors come back as they are with ``None``. No communication.

    Raises:
        NotImplementedError: a mix of DTensors and plain tensors, different meshes or
            placements, a ``Partial``, a shard of the sequence dim, or the context-parallel
            mesh itself; naming the placements.
    """
    dtensors = [t for t in tensors if isinstance(t, DTensor)]
    if not dtensors:
        return list(tensors), None
    first = dtensors[0]
    given = "; ".join(f"{t.device_mesh} {list(t.placements)}" for t in dtensors)
    problem = None
    if len(dtensors) != len(tensors):
        problem = "some of q, k, v are DTensors and some plain tensors"
    elif any(t.device_mesh != first.device_mesh or tuple(t.placements) != tuple(first.placements) for t in dtensors):
        problem = "their meshes or placements differ"
    elif cp_mesh is not None and first.device_mesh == cp_mesh:
        problem = "they are on the context-parallel mesh itself"
    elif any(pl.is_partial() for pl in first.placements):
        problem = "a placement is Partial (reduce it first)"
    elif any(pl.is_shard() and pl.dim % first.ndim == seq_dim for pl in first.placements):
        problem = f"the sequence dim {seq_dim} is sharded already"
    if problem is not None:
        raise NotImplementedError(f"ContextParallel on {name}: q, k, v arrive as DTensors ({given}) and {problem}; "
                                  "context parallelism runs on each rank's heads of q, k, v sharded by heads (tensor "
                                  "parallelism) or replicated, all alike, or on plain tensors")
    return [t.to_local() for t in tensors], (first.device_mesh, tuple(first.placements))


def restore_outer_sharding(out: Any, outer: Outer | None) -> Any:
    """The module's output (this rank's piece, laid out as q) back on the mesh q/k/v
    came on with their placements (see ``take_outer_sharding``)."""
    if outer is None:
        return out
    mesh, placements = outer
    return DTensor.from_local(out, mesh, placements)


def refuse_dtensor_qkv(name: str, tensors: Sequence[Any]) -> None:
    """Raise if q/k/v reach an ``AsyncContextParallel`` module as DTensors (its
    projections hand the core attention this rank's plain pieces).

    Raises:
        NotImplementedError: naming their placements and the fix.
    """
    given = [f"{t.device_mesh} {list(t.placements)}" for t in tensors if isinstance(t, DTensor)]
    if given:
        raise NotImplementedError(f"ContextParallel on {name}: q, k, v arrive as DTensors ({'; '.join(given)}), e.g. "
                                  "heads sharded by tensor parallelism; asynchronous context parallelism takes this "
                                  "rank's plain pieces: hand the core attention local tensors (use_local_output=True), "
                                  "or use ContextParallel")


def wrap_qkv(plan: Plan, seq_len: int, tensors: Sequence[Any], seq_dim: int, head_dim: int) -> list[Any]:
    """This rank's q/k/v pieces (after any Ulysses all-to-all) as DTensors on
    ``plan.mesh`` with their global shapes; no communication."""
    placements = qkv_placements(plan, seq_dim, head_dim)
    out = []
    for t in tensors:
        shape = list(t.shape)
        shape[seq_dim] = seq_len
        if plan.ulysses_size > 1:
            shape[head_dim] *= plan.ulysses_size
        out.append(DTensor.from_local(t, plan.mesh, placements, shape=tuple(shape)))
    return out


def unwrap_output(plan: Plan, name: str, out: Any, seq_dim: int, head_dim: int) -> Any:
    """The module's output as this rank's piece: a DTensor on ``plan.mesh`` is brought to
    the q/k/v placements (a no-op when it kept them) and unwrapped; a framework tensor
    is returned as it is.

    Raises:
        ValueError: a DTensor on another mesh.
    """
    if not isinstance(out, DTensor):
        return out
    if out.device_mesh != plan.mesh:
        raise ValueError(f"ContextParallel on {name}: the forward returned a DTensor on {out.device_mesh}, not on the "
                         f"context-parallel mesh {plan.mesh} its q/k/v came on; return the attention output")
    placements = qkv_placements(plan, seq_dim, head_dim)
    if tuple(out.placements) != placements:
        out = out.redistribute(plan.mesh, placements)
    return out.to_local()


def frame_locals(frame: Frame, what: str, tensors: Sequence[Any]) -> list[Any] | None:
    """The local pieces of q/k/v that are DTensors on ``frame``'s mesh; ``None`` when
    none is a DTensor (a module that made plain tensors of them, or pure Ulysses).

    Raises:
        ValueError: a mix of DTensors and framework tensors, or DTensors on another mesh.
    """
    flags = [isinstance(t, DTensor) for t in tensors]
    if not any(flags):
        return None
    if not all(flags) or any(t.device_mesh != frame.plan.mesh for t in tensors):
        raise ValueError(f"{what} in {frame.module_name}: q, k, v must all be the DTensors the ContextParallel hooks "
                         f"handed in (on {frame.plan.mesh}), or all plain tensors; got "
                         f"{[type(t).__name__ if not isinstance(t, DTensor) else str(t.device_mesh) for t in tensors]}")
    return [t.to_local() for t in tensors]


def _heads(q: Any, k: Any, layout: str, head_num: int, op: str) -> tuple[int, int]:
    """The global query and key/value head counts.

    Raises:
        ValueError: ``head_num`` does not divide the merged ``H`` of ``BSH`` / ``SBH``.
    """
    heads = FUSED_LAYOUTS[layout][2]
    if heads is not None:
        return int(q.shape[heads]), int(k.shape[heads])
    if head_num <= 0 or int(q.shape[-1]) % head_num:
        raise ValueError(f"{op}: head_num={head_num} does not divide the hidden size {q.shape[-1]} of {layout} q")
    # H = heads * head_dim: k and v share their kv head count (v's head size may differ:
    # multi-latent attention)
    return head_num, int(k.shape[-1]) // (int(q.shape[-1]) // head_num)


def _head_split(q: DTensor, layout: str) -> int:
    """The number of pieces ``q``'s heads are cut into (the merged ``H`` of ``BSH`` / ``SBH``
    counts as heads)."""
    heads = FUSED_LAYOUTS[layout][2]
    head_dim = q.ndim - 1 if heads is None else heads
    split = 1
    for axis, pl in enumerate(q.placements):
        if isinstance(pl, Shard) and pl.dim % q.ndim == head_dim:
            split *= q.device_mesh.size(axis)
    return split


def _head_counts(q: DTensor, k: DTensor, layout: str, head_num: int, split: int, op: str) -> tuple[int, int, int]:
    """The local head counts of q, k, v for the reshape of merged-head layouts (``-1``:
    the layout has a head dim); ``split``: the pieces the heads are cut into."""
    if FUSED_LAYOUTS[layout][2] is not None:
        return -1, -1, -1
    q_heads, kv_heads = _heads(q, k, layout, head_num, op)
    return q_heads // split, kv_heads // split, kv_heads // split


def _in_layout(locals_: Sequence[Any], layout: str, head_counts: Sequence[int], attend: Any) -> Any:
    """``attend`` (BSHD q, k, v -> BSHD output) on local pieces in ``layout``; the output in
    ``layout``."""
    batch, seq, heads = FUSED_LAYOUTS[layout]

    def to_bshd(t: Any, n: int) -> Any:
        if batch is None:
            return t.unsqueeze(0)
        if heads is None:
            t = t if batch == 0 else t.permute(1, 0, 2)
            return t.reshape(int(t.shape[0]), int(t.shape[1]), n, -1)
        return t if (batch, seq, heads) == (0, 1, 2) else t.permute(batch, seq, heads, 3)

    out = attend(*(to_bshd(t, n) for t, n in zip(locals_, head_counts)))
    if batch is None:
        return out[0]
    if heads is None:
        out = out.reshape(int(out.shape[0]), int(out.shape[1]), -1)
        return out if batch == 0 else out.permute(1, 0, 2)
    return out if (batch, seq, heads) == (0, 1, 2) else out.permute(0, 2, 1, 3)  # BSHD -> BNSD


def like_q(out: Any, q: DTensor) -> DTensor:
    """``out`` (this rank's output piece) as a DTensor placed like ``q``: its global shape is
    ``q``'s but for the last dim (``v``'s head size, or heads x that size when merged), which
    is sharded only where ``q``'s merged heads are, evenly."""
    shape = list(q.shape)
    split = 1
    for axis, pl in enumerate(q.placements):
        if isinstance(pl, Shard) and pl.dim % len(shape) == len(shape) - 1:
            split *= q.device_mesh.size(axis)
    shape[-1] = int(out.shape[-1]) * split
    return DTensor.from_local(out, q.device_mesh, q.placements, shape=tuple(shape))


def attention_on_dtensors(q: DTensor, k: DTensor, v: DTensor, *, layout: str, head_num: int, is_causal: bool,
                          scale: float | None, cu_seqlens: Any = None, op: str = "attention") -> DTensor:
    """A framework's fused attention op called on the DTensors a ``ContextParallel`` module
    received, computed by the module's algorithm (for the backends' translations of such
    ops; see [Note: q/k/v as DTensors]).

    Args:
        q: ``BSH`` ``[batch, seq, heads * head_dim]``, ``SBH`` ``[seq, batch, heads * head_dim]``,
            ``BNSD`` ``[batch, heads, seq, head_dim]``, ``BSND`` ``[batch, seq, heads, head_dim]``
            or ``TND`` ``[tokens, heads, head_dim]`` (``layout``), sequence-sharded as
            the hooks handed it in; any floating dtype.
        k, v: like ``q`` with ``kv_heads`` heads (grouped-query attention).
        layout: one of ``FUSED_LAYOUTS``.
        head_num: the global number of query heads (splits ``H`` in ``BSH`` / ``SBH``).
        is_causal: query at global position ``i`` sees keys at ``j <= i``.
        scale: multiplies ``q k^T``; default ``head_dim ** -0.5``.
        cu_seqlens: cumulative lengths of the packed documents of the whole sequence
            (``TND``: of all tokens), as ``scaled_dot_product_attention`` takes them.
        op: the framework op's name, for messages.

    Returns:
        The attention output, a DTensor shaped and placed like ``q`` (``H`` from ``v``'s
        head size), in ``q``'s dtype.

    Raises:
        ValueError: no ``ContextParallel`` module is running, q/k/v are not its DTensors,
            an unknown layout, or ``head_num`` does not divide ``H``.
    """
    # core/context_parallel/attention imports this module: import it at call time
    from hyper_parallel.core.context_parallel.attention import scaled_dot_product_attention

    frame = current_frame()
    if frame is None or frame.plan.mesh is None:
        raise ValueError(f"{op} on sequence-sharded DTensors runs only inside a module under ContextParallel with a "
                         "K/V exchange (ulysses_degree < cp), which hands it q, k, v as such DTensors")
    if layout not in FUSED_LAYOUTS:
        raise ValueError(f"{op}: input layout {layout!r} is not one of {sorted(FUSED_LAYOUTS)}")
    locals_ = frame_locals(frame, op, (q, k, v))
    if locals_ is None:
        raise ValueError(f"{op} in {frame.module_name}: q, k, v must be the DTensors the ContextParallel hooks handed "
                         "in")
    counts = _head_counts(q, k, layout, head_num, _head_split(q, layout), op)
    out = _in_layout(locals_, layout, counts, lambda *qkv: scaled_dot_product_attention(
        *qkv, is_causal=is_causal, scale=scale, cu_seqlens=cu_seqlens))
    return like_q(out, q)


def independent_shards_problem(q: Any, k: Any, v: Any, layout: str, head_num: int) -> str | None:
    """Why a fused attention op on ``q``, ``k``, ``v`` cannot be computed by each rank on its
    own pieces (``attention_on_local_shards``), or ``None`` when it can: all three are
    DTensors on one mesh with the same placements, sharding only the batch and head dims of
    ``layout`` (the merged ``H`` of ``BSH`` / ``SBH`` counts as heads), evenly over the heads
    of q and of k/v, never ``Partial``. No communication."""
    if layout not in FUSED_LAYOUTS:
        return f"input layout {layout!r} is not one of {sorted(FUSED_LAYOUTS)}"
    if not all(isinstance(t, DTensor) for t in (q, k, v)):
        return "q, k, v are not all DTensors"
    if k.device_mesh != q.device_mesh or v.device_mesh != q.device_mesh:
        return "q, k, v are on different meshes"
    if not tuple(q.placements) == tuple(k.placements) == tuple(v.placements):
        return f"q, k, v placements differ: {list(q.placements)}, {list(k.placements)}, {list(v.placements)}"
    batch, _, heads = FUSED_LAYOUTS[layout]
    head_dim = q.ndim - 1 if heads is None else heads
    for axis, pl in enumerate(q.placements):
        if pl.is_partial():
            return f"a Partial placement on mesh axis {axis}"
        if isinstance(pl, Shard) and pl.dim % q.ndim not in (batch, head_dim):
            return (f"{pl} on mesh axis {axis} shards dim {pl.dim % q.ndim} of {layout} q, which is neither its batch "
                    "nor its head dim")
    split = _head_split(q, layout)
    try:
        q_heads, kv_heads = _heads(q, k, layout, head_num, layout)
    except ValueError as e:
        return str(e)
    if q_heads % split or kv_heads % split:
        return f"{q_heads} query / {kv_heads} key-value heads do not divide evenly over {split} ranks"
    return None


def attention_on_local_shards(q: DTensor, k: DTensor, v: DTensor, *, layout: str, head_num: int, is_causal: bool,
                              scale: float | None, cu_seqlens: Any = None, op: str = "attention") -> DTensor:
    """A framework's fused attention op on DTensors sharded by batch and/or heads only (tensor
    parallelism's head-sharded q/k/v): each rank attends over its own rows and heads with the
    platform's fused kernels, no communication (the op is independent across both).

    Args:
        q, k, v, layout, head_num, is_causal, scale, cu_seqlens, op: as for
            ``attention_on_dtensors``; ``head_num`` is global, ``cu_seqlens`` covers the
            whole (unsharded) sequence.

    Returns:
        The attention output, a DTensor shaped and placed like ``q`` (``H`` from ``v``'s
        head size), in ``q``'s dtype.

    Raises:
        ValueError: ``independent_shards_problem`` names a reason; invalid ``cu_seqlens``.
    """
    from hyper_parallel.core.context_parallel.attention import attend_locally

    problem = independent_shards_problem(q, k, v, layout, head_num)
    if problem is not None:
        raise ValueError(f"{op}: each rank cannot attend on its own pieces: {problem}")
    counts = _head_counts(q, k, layout, head_num, _head_split(q, layout), op)
    out = _in_layout([t.to_local() for t in (q, k, v)], layout, counts, lambda *qkv: attend_locally(
        *qkv, is_causal=is_causal, scale=scale, cu_seqlens=cu_seqlens))
    return like_q(out, q)


def routes_to_context_parallel(tensors: Sequence[Any]) -> bool:
    """Whether a fused attention op called on ``tensors`` (q, k, v) is one to compute with
    ``attention_on_dtensors``: a ``ContextParallel`` module with a K/V exchange is running
    and they are all DTensors on its mesh. A backend's translation asks this first and
    otherwise leaves the op to the sharding rules (no communication either way)."""
    frame = current_frame()
    return (frame is not None and frame.plan.mesh is not None
            and all(isinstance(t, DTensor) and t.device_mesh == frame.plan.mesh for t in tensors))
