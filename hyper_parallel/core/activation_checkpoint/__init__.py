"""Activation checkpointing: blocks whose activations are recomputed in the backward
instead of kept (torch ``checkpoint_wrapper``/``apply_activation_checkpointing``,
MindSpore ``Cell.recompute()``) or swapped to host memory (``swap_wrapper``), composed
with tensor, context and fully-sharded data parallelism."""

from hyper_parallel.core.activation_checkpoint.checkpoint import (
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_wrapper,
    is_checkpointed,
    remove_checkpoint_wrapper,
)
from hyper_parallel.core.activation_checkpoint.policy import CheckpointPolicy, SelectiveCheckpointContext
from hyper_parallel.core.activation_checkpoint.region import CheckpointPhase, checkpoint_phase
from hyper_parallel.core.activation_checkpoint.swap import SwapManager, SwapStats, swap_stats, swap_wrapper

__all__ = ["CheckpointPhase", "CheckpointPolicy", "SelectiveCheckpointContext", "SwapManager", "SwapStats",
           "apply_activation_checkpointing", "checkpoint", "checkpoint_phase", "checkpoint_wrapper", "is_checkpointed",
           "remove_checkpoint_wrapper", "swap_stats", "swap_wrapper"]
