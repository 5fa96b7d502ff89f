"""Context parallelism: Ulysses all-to-all, all-gather K/V, ring attention, hybrid 2-D,
head-tail load balance, packed documents, and the all-to-all overlapped with the q/k/v
projections (``AsyncContextParallel``). See ``docs/context_parallel.md``."""

from hyper_parallel.core.context_parallel.async_context_parallel import AsyncContextParallel
from hyper_parallel.core.context_parallel.attention import scaled_dot_product_attention
from hyper_parallel.core.context_parallel.context_parallel import ContextParallel
from hyper_parallel.core.context_parallel.load_balance import context_parallel_shard, context_parallel_unshard

__all__ = ["AsyncContextParallel", "ContextParallel", "context_parallel_shard", "context_parallel_unshard", "scaled_dot_product_attention"]
