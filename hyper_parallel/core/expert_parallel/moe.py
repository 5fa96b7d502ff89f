"""Mixture of experts with the experts sharded over an expert-parallel group: top-k
routing, dispatch of each token to its experts' ranks and combine of their outputs, both
through the differentiable uneven all-to-all (GShard, Lepikhin et al. 2020; Switch,
Fedus et al. 2021; the layout of torchtitan's ``ExpertParallel``).

Experts ``0 .. num_experts - 1`` live ``num_experts / group_size`` per rank, expert ``e`` on
group rank ``e // (num_experts / group_size)``. A forward is::

    plan = moe.route(x, router_weight)       # compute: gates and the token order
    routed = moe.dispatch(plan.permute(x), plan)   # comm: counts all-gather + all-to-all
    y = moe.run_experts(routed, plan, expert_fn)   # compute: each local expert on its tokens
    out = plan.unpermute(moe.combine(y, plan))     # comm, then the gate-weighted sum

which ``MoE.forward`` strings together; ``CommComputeOverlap.wrap_dispatch`` and
``wrap_combine`` wrap ``dispatch`` and ``combine`` (the communication segments) for the
two-thread overlap of pipeline parallelism. Routing decisions (which experts, how many
tokens each) are integers taken to the host, as in every MoE implementation that sizes its
all-to-all; the gates stay differentiable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform
from hyper_parallel.core.tensor_ops import dtype_name, stack

#: expert_fn(local expert index, tokens [n, dim]) -> [n, dim_out]
ExpertFn = Callable[[int, Any], Any]
#: grouped_fn(tokens [n, dim] grouped expert-major, rows per local expert) -> [n, dim_out]
GroupedFn = Callable[[Any, list[int]], Any]


@dataclass
class RoutingPlan:
    """One forward's routing.

    Attributes:
        gates: ``[tokens, top_k]`` differentiable softmax probabilities of the chosen experts.
        order: ``[tokens * top_k]`` int64: (token, slot) rows sorted by expert (stable).
        inverse: the inverse permutation of ``order``.
        send_counts: ``[num_experts]`` rows this rank sends to each expert.
        counts: ``[group_size, num_experts]`` every rank's ``send_counts`` (set by dispatch).
    """

    gates: Any
    top_k: int
    order: np.ndarray
    inverse: np.ndarray
    send_counts: np.ndarray
    counts: np.ndarray | None = field(default=None)

    def permute(self, x: Any) -> Any:
        """``[tokens, dim]`` -> ``[tokens * top_k, dim]``: each token once per chosen
        expert, rows sorted by expert."""
        p = get_platform()
        return x[p.from_numpy(self.order // self.top_k)]

    def unpermute(self, y: Any) -> Any:
        """``[tokens * top_k, dim]`` in expert order -> ``[tokens, dim]``: the gate-weighted
        sum of each token's expert outputs."""
        p = get_platform()
        rows = y[p.from_numpy(self.inverse)]
        tokens = rows.shape[0] // self.top_k
        return (rows.reshape(tokens, self.top_k, rows.shape[-1]) * self.gates.unsqueeze(-1)).sum(1)


class MoE:
    """Top-k routing and expert-parallel dispatch/combine (parameters are the caller's).

    Args:
        num_experts: experts in the layer, a multiple of the group size.
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        group: the expert-parallel group (a mesh axis's group, ``mesh.get_group("ep")``;
            ``None``: the world). A group of one rank holds every expert and communicates
            nothing.

    Raises:
        ValueError: ``num_experts`` not a multiple of the group size; ``top_k`` out of range.
    """

    def __init__(self, num_experts: int, top_k: int, group: Any = None) -> None:
        p = get_platform()
        size = p.world_size(group)
        if num_experts < 1 or num_experts % size:
            raise ValueError(f"MoE: num_experts={num_experts} must be a positive multiple of the expert-parallel "
                             f"group size {size} (each rank holds num_experts / {size} experts)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.group = num_experts, top_k, group
        self.group_size, self.group_rank = size, p.rank(group)
        self.local_experts = num_experts // size

    @property
    def expert_range(self) -> range:
        """The global indices of this rank's experts."""
        return range(self.group_rank * self.local_experts, (self.group_rank + 1) * self.local_experts)

    def route(self, x: Any, router_weight: Any) -> RoutingPlan:
        """Softmax router over ``x @ router_weight.T`` and the top-k experts per token.

        Args:
            x: ``[tokens, dim]`` floating point.
            router_weight: ``[num_experts, dim]``.

        Ties in the probabilities go to the lower expert index.
        """
        p = get_platform()
        logits = x @ router_weight.transpose(0, 1)  # [tokens, experts]
        shifted = logits - p.detach(logits.amax(-1)).unsqueeze(-1)  # for exp's range; softmax is unchanged
        weights = shifted.exp()
        probs = weights / weights.sum(-1).unsqueeze(-1)
        chosen = np.argsort(-p.to_numpy(probs), axis=1, kind="stable")[:, :self.top_k]  # [tokens, top_k]
        eye = np.eye(self.num_experts, dtype=dtype_name(probs.dtype))
        gates = stack([(probs * p.from_numpy(eye[chosen[:, j]])).sum(-1) for j in range(self.top_k)], 1)
        flat = chosen.reshape(-1)
        order = np.argsort(flat, kind="stable").astype(np.int64)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size, dtype=np.int64)
        return RoutingPlan(gates, self.top_k, order, inverse, np.bincount(flat, minlength=self.num_experts))

    def dispatch(self, x_sorted: Any, plan: RoutingPlan) -> Any:
        """Communication: all-gather of the per-expert counts, then the uneven
        all-to-all sending each row to its expert's rank.

        Args:
            x_sorted: ``[tokens * top_k, dim]``, ``plan.permute(x)``.

        Returns:
            ``[received, dim]``: rows from each source rank (in rank order), each
            source's rows sorted by local expert.
        """
        p = get_platform()
        if self.group_size == 1:
            plan.counts = plan.send_counts[None, :]
            return x_sorted
        gathered = p.all_gather_into_tensor(p.from_numpy(plan.send_counts[None, :].astype(np.int64)),
                                            group=self.group).wait()
        plan.counts = p.to_numpy(gathered).reshape(self.group_size, self.num_experts)
        send, receive = self._split_sizes(plan)
        # waited for at the first use on torch: an overlapping thread reaches its next hook at once
        return p.differentiable_all_to_all_single_async(x_sorted, send, receive, self.group)

    def combine(self, y: Any, plan: RoutingPlan) -> Any:
        """Communication: the reverse all-to-all, bringing expert outputs ``[received,
        dim]`` back to their tokens' ranks, ``[tokens * top_k, dim]`` in expert order."""
        p = get_platform()
        if self.group_size == 1:
            return y
        send, receive = self._split_sizes(plan)
        return p.differentiable_all_to_all_single_async(y, receive, send, self.group)

    def _split_sizes(self, plan: RoutingPlan) -> tuple[list[int], list[int]]:
        assert plan.counts is not None, "dispatch sets the counts"
        per_rank = plan.send_counts.reshape(self.group_size, self.local_experts).sum(1)
        mine = plan.counts[:, self.expert_range.start:self.expert_range.stop].sum(1)
        return [int(v) for v in per_rank], [int(v) for v in mine]

    def run_experts(self, routed: Any, plan: RoutingPlan, expert_fn: ExpertFn) -> Any:
        """Compute: group the received rows by local expert, run ``expert_fn(l, rows)``
        on each local expert ``l`` (``0 .. local_experts - 1``; ``[rows, dim] -> [rows,
        dim]``) and put the outputs back in the received order. An expert that received
        nothing is not called."""
        p = get_platform()

        def per_expert(grouped: Any, sizes: list[int]) -> Any:
            outputs = [expert_fn(l, chunk) for l, chunk in enumerate(p.split(grouped, sizes, 0)) if sizes[l]]
            return p.cat(outputs, 0)

        return self.run_grouped(routed, plan, per_expert)

    def run_grouped(self, routed: Any, plan: RoutingPlan, grouped_fn: GroupedFn) -> Any:
        """Compute: reorder the received rows ``[rows, dim]`` so that each local expert's
        are consecutive (expert-major, ``sizes[l]`` rows for local expert ``l``), run
        ``grouped_fn(grouped, sizes)`` once on all of them (``[rows, dim] ->
        [rows, dim_out]``: the experts' grouped GEMMs, ``Platform.grouped_matmul``), and
        put the outputs back in the received order. With no row received, ``routed`` is
        returned as it is (``grouped_fn`` is not called)."""
        p = get_platform()
        assert plan.counts is not None, "dispatch sets the counts"
        local = plan.counts[:, self.expert_range.start:self.expert_range.stop]  # [sources, local experts]
        starts = np.concatenate([[0], np.cumsum(local.sum(1))[:-1]])  # each source's first row
        by_expert = [np.arange(starts[s] + local[s, :l].sum(), starts[s] + local[s, :l + 1].sum(), dtype=np.int64)
                     for l in range(self.local_experts) for s in range(self.group_size)]
        index = np.concatenate(by_expert) if by_expert else np.zeros(0, np.int64)
        if not index.size:
            return routed  # no rows came here (expert outputs keep the token dim)
        sizes = [int(v) for v in local.sum(0)]
        out = grouped_fn(routed[p.from_numpy(index)], sizes)
        back = np.empty_like(index)
        back[index] = np.arange(index.size, dtype=np.int64)
        return out[p.from_numpy(back)]

    def forward(self, x: Any, router_weight: Any, expert_fn: ExpertFn,
                dispatch: Callable[[Any, RoutingPlan], Any] | None = None,
                combine: Callable[[Any, RoutingPlan], Any] | None = None) -> Any:
        """``[tokens, dim]`` -> ``[tokens, dim_out]``: route, dispatch, experts, combine.
        ``dispatch``/``combine`` replace ``self.dispatch``/``self.combine`` (for example
        with ``CommComputeOverlap.wrap_dispatch(moe.dispatch)``)."""
        plan = self.route(x, router_weight)
        routed = (dispatch or self.dispatch)(plan.permute(x), plan)
        y = self.run_experts(routed, plan, expert_fn)
        return plan.unpermute((combine or self.combine)(y, plan))
