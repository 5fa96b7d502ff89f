"""Tensor parallelism: Megatron-style column/row parallel linear layers and sequence
parallel, declared as a plan ``{module fqn glob: style}``."""

from hyper_parallel.core.tensor_parallel.api import parallelize_module
from hyper_parallel.core.tensor_parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "RowwiseParallel", "SequenceParallel",
           "parallelize_module"]
