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
  plan's exchange: ``hyper_parallel.scaled_dot_product_attention`` (core), and a
  framework's fused attention op, which a backend intercepts on its DTensor class and
  translates into ``fused_attention.attention_on_dtensors`` (MindSpore: the ``FlashAttentionScore``
  primitive that MindFormers' ``FlashAttention`` cell calls). This is how torch's own
  context parallelism reaches ``scaled_dot_product_attention`` too: a DTensor op handler
  for the fused attention op on sequence-sharded inputs.

The post-hook takes the module's output back to this rank's local piece (redistributing
first if the module changed its placements). Pure Ulysses (``ulysses_degree == cp``)
hands plain tensors: the module holds whole sequences and any attention runs as it is.

The same translations serve fused attention ops on q/k/v sharded by batch and heads only
(tensor parallelism's head-sharded q/k/v, no ``ContextParallel`` module):
``fused_attention.attention_on_local_shards`` has each rank attend on its own pieces, which is exact
because attention is independent across batch rows and heads.

The DTensors' global order along the sequence is the order of the shards: with
``load_balance`` (head-tail chunks) it is not the order of the tokens. Nothing in a
core-attention module reads it (the attention takes positions from the plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.context_parallel.context import Frame, Plan
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
