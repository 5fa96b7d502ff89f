"""A framework's fused attention op called on DTensors: on the sequence-sharded q/k/v a
``ContextParallel`` module hands in (the module's algorithm), or on q/k/v sharded by batch
and heads only (each rank attends on its own pieces). See [Note: q/k/v as DTensors] in
``sharded_qkv``; the backends' translations of their fused ops (MindSpore's
``FlashAttentionScore``: ``flash_attention_score.py``) end here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.context_parallel.attention import attend_locally, scaled_dot_product_attention
from hyper_parallel.core.context_parallel.context import current_frame
from hyper_parallel.core.context_parallel.sharded_qkv import FUSED_LAYOUTS, frame_locals, like_q
from hyper_parallel.core.dtensor.dispatch import plan_op
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec
from hyper_parallel.core.dtensor.placement_types import Placement, Shard

#: The ``OP_RULES`` rule that says which dims of ``[batch, heads, seq, head_dim]`` attention
#: is independent across (batch and heads). torch's SDPA on DTensors is planned by it
#: (``fused_dispatch.dispatch_aligned``), and so is a 4-D fused op here (MindSpore's
#: ``FlashAttentionScore`` in ``BNSD`` / ``BSND``): one rule for both frameworks.
ATTENTION_RULE = "scaled_dot_product_attention"


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


def _as_bnsd(spec: DTensorSpec, layout: str) -> DTensorSpec:
    """``spec`` of a 4-D ``layout`` tensor seen as ``[batch, heads, seq, head_dim]``."""
    batch, seq, heads = FUSED_LAYOUTS[layout]
    order = (batch, heads, seq, 3)  # head_dim is last in every 4-D layout

    def moved(pl: Placement) -> Placement:
        return Shard(order.index(pl.dim % 4)) if isinstance(pl, Shard) else pl

    return DTensorSpec(spec.mesh, tuple(moved(pl) for pl in spec.placements), tuple(spec.shape[d] for d in order))


def _rule_problem(q: DTensor, k: DTensor, v: DTensor, layout: str) -> str | None:
    """Why ``ATTENTION_RULE``'s plan for 4-D q/k/v would move one of them (then the op is not
    computed on the pieces as they are), or ``None`` when it keeps all three."""
    specs = [_as_bnsd(t._spec, layout) for t in (q, k, v)]
    plan = plan_op(ATTENTION_RULE, specs)
    for name, spec, target in zip("qkv", specs, plan.targets):
        if tuple(target) != tuple(spec.placements):
            return (f"the attention rule ({ATTENTION_RULE}) plans {name} as {list(target)} of [batch, heads, seq, "
                    f"head_dim], not as it is ({list(spec.placements)})")
    return None


def independent_shards_problem(q: Any, k: Any, v: Any, layout: str, head_num: int) -> str | None:
    """Why a fused attention op on ``q``, ``k``, ``v`` cannot be computed by each rank on its
    own pieces (``attention_on_local_shards``), or ``None`` when it can: all three are
    DTensors on one mesh with the same placements, sharding only the batch and head dims of
    ``layout`` (the merged ``H`` of ``BSH`` / ``SBH`` counts as heads), evenly over the heads
    of q and of k/v, never ``Partial``. No communication. For the 4-D layouts the decision is
    ``ATTENTION_RULE``'s plan (the rule torch's SDPA on DTensors takes); the merged ``H`` of
    the 3-D layouts is no dim that rule knows, so those are checked here structurally."""
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
    return _rule_problem(q, k, v, layout) if q.ndim == 4 else None


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
