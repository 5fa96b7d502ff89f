"""Activation checkpointing: blocks whose activations are recomputed in the backward
instead of kept (torch ``checkpoint_wrapper``/``apply_activation_checkpointing``,
MindSpore ``Cell.recompute()``), composed with tensor, context and fully-sharded data
parallelism."""

from hyper_parallel.core.activation_checkpoint.checkpoint import (
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_wrapper,
    is_checkpointed,
    remove_checkpoint_wrapper,
)
from hyper_parallel.core.activation_checkpoint.policy import CheckpointPolicy, SwapManager, swap_wrapper
from hyper_parallel.core.activation_checkpoint.region import CheckpointPhase, checkpoint_phase

__all__ = ["CheckpointPhase", "CheckpointPolicy", "SwapManager", "apply_activation_checkpointing", "checkpoint",
           "checkpoint_phase", "checkpoint_wrapper", "is_checkpointed", "remove_checkpoint_wrapper", "swap_wrapper"]
