"""``ContextParallel``: shard attention over the sequence of a context-parallel mesh.

Applied to a core-attention module (one whose forward takes ``q``, ``k``, ``v`` and
returns the attention output); composes in ``parallelize_module`` plans. The modes over a
mesh of ``cp`` ranks:

==========================  =====================================================
``ulysses_degree == cp``    Ulysses: all-to-all sequence -> heads in the pre-hook,
                            heads -> sequence in the post-hook; the module sees whole
                            sequences (any attention implementation works).
``ulysses_degree == 1``     ``kv_exchange="allgather"``: K/V all-gathered inside
                            ``scaled_dot_product_attention``; ``"ring"``: K/V passed
                            around the ring (``ring``).
``1 < ulysses_degree < cp`` hybrid 2-D: all-to-all over the Ulysses axis, then the
                            exchange over the other axis.
==========================  =====================================================

The hooks push a frame for the module's forward ([Note: where the active context
lives] in ``context``); ``scaled_dot_product_attention`` finds it and runs the exchange.
In the exchange modes the module gets q/k/v as sequence-sharded DTensors, which also
routes a framework's fused attention op called on them ([Note: q/k/v as DTensors] in
``sharded_qkv``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.context import (Frame, Plan, find_frame, module_call_site, pop_frame,
                                                          push_frame)
from hyper_parallel.core.context_parallel.load_balance import check_seq_len
from hyper_parallel.core.context_parallel.masks import document_ids
from hyper_parallel.core.context_parallel.sharded_qkv import (restore_outer_sharding, take_outer_sharding,
                                                             unwrap_output, wrap_qkv)
from hyper_parallel.core.context_parallel.ulysses import check_heads, heads_to_seq, replicate_heads, seq_to_heads
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.tensor_parallel.style import ParallelStyle
from hyper_parallel.platform import get_platform

KV_EXCHANGES = ("allgather", "ring")


class ContextParallel(ParallelStyle):
    """Context parallelism for one core-attention module.

    Args:
        seq_dim: the sequence dim of q, k, v and of the output (1 for BSHD, 2 for BNSD).
        head_dim: their head dim (2 for BSHD, 1 for BNSD).

    [Note: 3-D q/k/v] q, k, v may also be 3-D, in MindFormers' two layouts:
    ``[batch, seq, heads * head_dim]`` (BSH, colossal: ``seq_dim=1, head_dim=2``) when
    ``ulysses_degree`` is 1, and ``[tokens, heads, head_dim]`` (TND, packed documents:
    ``seq_dim=0, head_dim=1``) in every mode. The hooks check them, run the Ulysses
    all-to-all along ``seq_dim`` / ``head_dim`` (TND) and open the context frame; the module
    views them as 4-D before calling ``hyper_parallel.scaled_dot_product_attention``, which
    exchanges K/V, and returns its output in the layout it got. A 3-D tensor whose
    ``head_dim`` is its last dim holds heads and head features merged (BSH), which the
    all-to-all cannot split by head, so that case with ``ulysses_degree > 1`` raises.
        ulysses_degree: ranks of the all-to-all axis; ``None`` means all of ``cp``
            (pure Ulysses). On a 2-D mesh it must equal the mesh's second axis.
        kv_exchange: ``"allgather"`` or ``"ring"``: how K/V are exchanged when
            ``ulysses_degree < cp``.
        qkv_indices: positions of q, k, v in the module's positional arguments (an
            entry is unused where ``qkv_kwarg_names`` names that tensor).
        qkv_kwarg_names: ``()`` (q, k, v positional), or three entries, one each for q,
            k, v: the keyword the module is called with for that tensor, or ``None`` for
            one passed positionally at its ``qkv_indices`` entry. For example
            ``("query", "key", "value")`` for ``attn(x, query=q, key=k, value=v)``, or
            ``(None, "key", "value")`` for ``attn(q, key=k, value=v)``. A named keyword
            missing from a call raises ``ValueError`` there, before any collective.
        load_balance: the head-tail sequence layout (``context_parallel_shard(...,
            load_balance=True)``) that balances causal work for ``"ring"`` and
            ``"allgather"``. Not for pure Ulysses, which is balanced already.

    Inputs are sequence-sharded as ``context_parallel_shard`` does, over the mesh's ranks
    in row-major order. A call of the module with a keyword argument ``cu_seqlens``
    (packed documents, passed on by its forward to ``scaled_dot_product_attention``) has
    it validated against the global sequence length in the pre-hook, on every rank
    before any collective (in particular before the Ulysses all-to-all). In the modes
    with a K/V exchange the module receives q, k, v as DTensors sharded on the sequence
    (``Shard(seq_dim)`` on the mesh; hybrid: also ``Shard(head_dim)`` on its Ulysses
    axis) and its output is taken back to this rank's piece: its attention must be
    ``hyper_parallel.scaled_dot_product_attention`` or a fused op a backend routes
    (MindSpore: ``FlashAttentionScore``), else the forward raises ``RuntimeError``
    ([Note: q/k/v as DTensors]). Pure Ulysses hands plain tensors and works with any
    attention implementation.

    Raises:
        ValueError: invalid arguments (at construction); a mesh or q/k/v shapes that do
            not fit, a missing q/k/v argument or an invalid ``cu_seqlens`` keyword (at
            ``apply`` / in the pre-hook, before any collective).
    """

    def __init__(self, seq_dim: int = 1, head_dim: int = 2, ulysses_degree: int | None = None,
                 kv_exchange: str = "allgather", qkv_indices: tuple[int, int, int] = (0, 1, 2),
                 qkv_kwarg_names: tuple[str, ...] = (), load_balance: bool = False) -> None:
        if kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"ContextParallel: kv_exchange={kv_exchange!r}; use 'allgather' or 'ring'")
        if seq_dim == head_dim or not all(isinstance(d, int) and 0 <= d < 4 for d in (seq_dim, head_dim)):
            raise ValueError(f"ContextParallel: seq_dim={seq_dim}, head_dim={head_dim} must be distinct dims of the "
                             "4-D q/k/v (BSHD: seq_dim=1, head_dim=2; BNSD: seq_dim=2, head_dim=1)")
        if ulysses_degree is not None and (not isinstance(ulysses_degree, int) or ulysses_degree < 1):
            raise ValueError(f"ContextParallel: ulysses_degree={ulysses_degree!r} must be a positive int or None")
        if len(tuple(qkv_indices)) != 3 or len(set(qkv_indices)) != 3:
            raise ValueError(f"ContextParallel: qkv_indices={qkv_indices!r} must be three distinct argument positions")
        names = tuple(qkv_kwarg_names)
        given = [n for n in names if n is not None]
        if names and (len(names) != 3 or not all(isinstance(n, str) and n for n in given)
                      or len(set(given)) != len(given)):
            raise ValueError(f"ContextParallel: qkv_kwarg_names={names!r} must be () or three entries (for q, k, v), "
                             "each a distinct keyword name or None for a tensor passed positionally at its "
                             "qkv_indices entry; e.g. ('query', 'key', 'value')")
        self.seq_dim = seq_dim
        self.head_dim = head_dim
        self.ulysses_degree = ulysses_degree
        self.kv_exchange = kv_exchange
        self.qkv_indices: tuple[int, int, int] = tuple(qkv_indices)  # type: ignore[assignment]
        self.qkv_kwarg_names: tuple[str | None, ...] = names
        self.load_balance = load_balance

    # -- mesh -> plan ------------------------------------------------------------------
    def resolve(self, device_mesh: DeviceMesh) -> Plan:
        """The plan of this configuration on ``device_mesh`` (1-D, or 2-D ``(exchange,
        ulysses)``). A 1-D mesh over the whole world is split into a 2-D mesh named
        ``("cp_kv", "cp_ulysses")`` for hybrid mode (collective: creates groups).

        Raises:
            ValueError: the mesh does not fit the degrees (the message names both).
        """
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"ContextParallel.apply: device_mesh must be a DeviceMesh, got "
                            f"{type(device_mesh).__name__}")
        cp = device_mesh.size()
        if device_mesh.ndim == 2:
            ud = device_mesh.shape[1]
            if self.ulysses_degree not in (None, ud):
                raise ValueError(f"ContextParallel: ulysses_degree={self.ulysses_degree} but the 2-D mesh "
                                 f"{device_mesh.shape} has {ud} ranks on its Ulysses axis (the second); make them equal")
            mesh2d = device_mesh
        elif device_mesh.ndim == 1:
            ud = cp if self.ulysses_degree is None else self.ulysses_degree
            if cp % ud:
                raise ValueError(f"ContextParallel: ulysses_degree={ud} does not divide the context-parallel size {cp}")
            mesh2d = None
            if 1 < ud < cp:
                if cp != get_platform().world_size():
                    raise ValueError(f"ContextParallel: hybrid mode on a 1-D mesh of {cp} ranks inside a world of "
                                     f"{get_platform().world_size()}: pass a 2-D (exchange, ulysses) submesh, e.g. "
                                     "init_device_mesh(..., mesh_dim_names=(..., 'cp_kv', 'cp_ulysses'))"
                                     "['cp_kv', 'cp_ulysses']")
                mesh2d = DeviceMesh(device_mesh.device_type, device_mesh.mesh.reshape(cp // ud, ud),
                                    mesh_dim_names=("cp_kv", "cp_ulysses"))
        else:
            raise ValueError(f"ContextParallel: the mesh must be 1-D or 2-D (exchange, ulysses); got {device_mesh.ndim}-D")
        if self.load_balance and ud == cp and cp > 1:
            raise ValueError("ContextParallel: load_balance=True applies to the 'ring' and 'allgather' exchanges; "
                             f"pure Ulysses (ulysses_degree={ud} == cp) attends over whole sequences and is balanced "
                             "already: set load_balance=False (and shard the data without it)")
        coordinate = device_mesh.get_coordinate()
        if coordinate is None:
            raise RuntimeError(f"ContextParallel.apply: rank {get_platform().rank()} is not in {device_mesh}")
        cp_index = int(np.ravel_multi_index(coordinate, device_mesh.shape))
        if mesh2d is not None:
            return Plan(cp, cp_index, ud, mesh2d.get_group(1), cp // ud, mesh2d.get_local_rank(0),
                        mesh2d.get_group(0), self.kv_exchange, self.load_balance, mesh2d if cp // ud > 1 else None)
        if ud == cp:
            return Plan(cp, cp_index, cp, device_mesh.get_group() if cp > 1 else None, 1, 0, None,
                        self.kv_exchange, self.load_balance)
        return Plan(cp, cp_index, 1, None, cp, cp_index, device_mesh.get_group(), self.kv_exchange, self.load_balance,
                    device_mesh if cp > 1 else None)

    def apply(self, module: Any, device_mesh: DeviceMesh) -> Any:
        """Register the hooks on ``module``; returns it. Collective only for a hybrid
        split of a 1-D mesh (group creation)."""
        plan = self.resolve(device_mesh)
        p = get_platform()
        name = type(module).__name__
        p.register_forward_pre_hook(module, lambda m, args, kwargs: self._pre_hook(plan, name, m, args, kwargs),
                                    with_kwargs=True)
        p.register_forward_hook(module, lambda m, args, out: self._post_hook(plan, name, out))
        return module

    # -- hooks -------------------------------------------------------------------------
    def _slots(self) -> list[tuple[str, int, str | None]]:
        """``(label, positional index, keyword name or None)`` of q, k, v."""
        names = self.qkv_kwarg_names or (None, None, None)
        return list(zip("qkv", self.qkv_indices, names))

    def _qkv(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """q, k, v from the module call's arguments (no communication)."""
        p = get_platform()
        qkv = []
        for label, index, kw in self._slots():
            if kw is not None:
                if kw not in kwargs:
                    raise ValueError(f"ContextParallel on {name}: {label} is expected as keyword argument {kw!r} "
                                     f"(qkv_kwarg_names={self.qkv_kwarg_names}) but the call passed keywords "
                                     f"{sorted(kwargs)}; call the module with {kw}=<{label}> or change "
                                     "qkv_kwarg_names")
                t = kwargs[kw]
            else:
                if index >= len(args):
                    raise ValueError(f"ContextParallel on {name}: {label} is expected as positional argument {index} "
                                     f"(qkv_indices={self.qkv_indices}) but forward got {len(args)} positional "
                                     f"arguments; pass it there, or name its keyword in qkv_kwarg_names")
                t = args[index]
            if not p.is_tensor(t) or t.ndim not in (3, 4):
                raise ValueError(f"ContextParallel on {name}: {label} must be a 4-D tensor (or 3-D [batch, seq, "
                                 f"heads * head_dim] without Ulysses), got {getattr(t, 'shape', type(t).__name__)}")
            qkv.append(t)
        if len({t.ndim for t in qkv}) != 1:
            raise ValueError(f"ContextParallel on {name}: q, k, v have {[t.ndim for t in qkv]} dims; give all three "
                             "the same layout")
        return qkv

    def _replace(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 qkv: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with q, k, v replaced by ``qkv``."""
        new_args, new_kwargs = list(args), dict(kwargs)
        for (_, index, kw), t in zip(self._slots(), qkv):
            if kw is None:
                new_args[index] = t
            else:
                new_kwargs[kw] = t
        return tuple(new_args), new_kwargs

    def check(self, plan: Plan, name: str, q: Any, k: Any, v: Any, kwargs: dict[str, Any]) -> int:
        """Validate q/k/v and a ``cu_seqlens`` keyword of the call for ``plan`` (every
        rank, before any collective); returns the global sequence length."""
        s, h = self.seq_dim, self.head_dim
        if q.ndim == 3:
            # [Note: 3-D q/k/v]: BSH (heads merged into the last dim) or TND; the module views
            # them as 4-D before hyper_parallel.scaled_dot_product_attention
            if s > 2 or h > 2:
                raise ValueError(f"ContextParallel on {name}: seq_dim={s}, head_dim={h} are out of range for 3-D "
                                 "q/k/v (BSH: seq_dim=1, head_dim=2; TND: seq_dim=0, head_dim=1)")
            if plan.ulysses_size > 1 and h == 2:
                raise ValueError(f"ContextParallel on {name}: 3-D q/k/v {tuple(q.shape)} with head_dim=2 (BSH, "
                                 f"[batch, seq, heads * head_dim]) need ulysses_degree=1 (got {plan.ulysses_size}): "
                                 "the all-to-all splits the head dim, which such a tensor does not expose; pass 4-D "
                                 "q/k/v, or TND [tokens, heads, head_dim] (seq_dim=0, head_dim=1)")
        if not q.shape[s] == k.shape[s] == v.shape[s]:
            raise ValueError(f"ContextParallel on {name}: q, k, v sequence lengths {q.shape[s]}, {k.shape[s]}, "
                             f"{v.shape[s]} differ; context parallelism shards self-attention")
        seq_len = int(q.shape[s]) * plan.cp
        check_seq_len(seq_len, plan.cp, plan.load_balance, f"ContextParallel on {name}")
        if plan.ulysses_size > 1:
            check_heads(int(q.shape[h]), int(k.shape[h]), plan.ulysses_size, f"ContextParallel on {name}")
        if kwargs.get("cu_seqlens") is not None:
            document_ids(kwargs["cu_seqlens"], seq_len, f"ContextParallel on {name}")
        if q.ndim == 4:
            # The kernel's own checks (dtype, head_dim, ...) on BSHD views, before any collective.
            batch, dim = (i for i in range(4) if i not in (s, h))
            get_platform().check_attention(*(t.permute(batch, s, h, dim) for t in (q, k, v)))
        return seq_len

    def _pre_hook(self, plan: Plan, name: str, module: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        q, k, v = self._qkv(name, args, kwargs)
        # [Note: context parallelism over tensor-parallel heads] in sharded_qkv
        (q, k, v), outer = take_outer_sharding(name, (q, k, v), self.seq_dim, plan.mesh)
        seq_len = self.check(plan, name, q, k, v, kwargs)
        if plan.ulysses_size > 1:
            p = get_platform()
            n, s, h = plan.ulysses_size, self.seq_dim, self.head_dim
            k, v = replicate_heads(p, k, h, n), replicate_heads(p, v, h, n)
            q, k, v = (seq_to_heads(p, t, s, h, plan.ulysses_group) for t in (q, k, v))
        if plan.mesh is not None:
            q, k, v = wrap_qkv(plan, seq_len, (q, k, v), self.seq_dim, self.head_dim)
        push_frame(Frame(name, plan, seq_len, module_call_site(module), module=module, outer=outer))
        return self._replace(args, kwargs, [q, k, v])

    def _post_hook(self, plan: Plan, name: str, out: Any) -> Any:
        frame = find_frame(plan)
        if frame is None:
            raise RuntimeError(f"ContextParallel on {name}: no running frame at the end of forward (were the hooks "
                               "removed or called out of order?)")
        pop_frame(frame)
        if plan.kv_size > 1 and not frame.called:
            raise RuntimeError(f"ContextParallel on {name}: the forward computed its attention without "
                               "hyper_parallel.scaled_dot_product_attention or a fused op the backend routes "
                               "(MindSpore: FlashAttentionScore), so this module's K/V exchange "
                               f"(kv_exchange={plan.kv_exchange!r} over {plan.kv_size} ranks) never ran. Compute the "
                               "attention with hyper_parallel.scaled_dot_product_attention(q, k, v, ...) on the q, k, v "
                               "the hooks hand in, or use pure Ulysses (ulysses_degree == cp), which works with any "
                               "attention implementation")
        if plan.mesh is not None:
            out = unwrap_output(plan, name, out, self.seq_dim, self.head_dim)
        if plan.ulysses_size > 1:
            if not get_platform().is_tensor(out):
                raise TypeError(f"ContextParallel on {name}: the forward must return the attention output tensor, "
                                f"got {type(out).__name__}")
            out = heads_to_seq(get_platform(), out, self.seq_dim, self.head_dim, plan.ulysses_group)
        return restore_outer_sharding(out, frame.outer)
