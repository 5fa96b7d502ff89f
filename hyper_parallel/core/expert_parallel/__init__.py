"""Expert parallelism: an MoE layer's routing, dispatch and combine with experts sharded
over an expert-parallel group."""

from hyper_parallel.core.expert_parallel.moe import MoE, RoutingPlan

__all__ = ["MoE", "RoutingPlan"]
