"""``shard_module`` / ``ShardingPlan``: lay a module's parameters, inputs and outputs out
on a device mesh as a plan of placements; ``DFunction``: custom autograd functions on
local tensors. The module paths MindFormers imports (``hyper_parallel.core.shard.sharding_plan``)."""

from hyper_parallel.core.shard.api import shard_module
from hyper_parallel.core.shard.dfunction import DFunction
from hyper_parallel.core.shard.sharding_plan import ShardingPlan

__all__ = ["DFunction", "ShardingPlan", "shard_module"]
