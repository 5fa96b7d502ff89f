"""hyper_parallel: distributed training of large models on MindSpore and torch.

The core algorithms are written once against ``hyper_parallel.platform``; pick the
backend with ``hyper_parallel.init(platform=...)`` or ``HYPER_PARALLEL_PLATFORM``.
"""

from hyper_parallel.core.activation_checkpoint import apply_activation_checkpointing, checkpoint_wrapper
from hyper_parallel.core.context_parallel import (
    AsyncContextParallel,
    ContextParallel,
    context_parallel_shard,
    context_parallel_unshard,
    scaled_dot_product_attention,
)
from hyper_parallel.core.dtensor import (
    OP_RULES,
    DeviceMesh,
    DTensor,
    OpRule,
    Partial,
    Placement,
    Replicate,
    Shard,
    SkipDTensorDispatch,
    clip_grads_by_global_norm,
    distribute_module,
    distribute_parameter,
    distribute_tensor,
    global_grad_norm,
    init_device_mesh,
)
from hyper_parallel.core.dtensor import functional as dtensor_functional
from hyper_parallel.core.expert_parallel import MoE
from hyper_parallel.core.fully_shard import (CPUOffloadPolicy, HSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                             fully_shard)
from hyper_parallel.core.shard import DFunction, ShardingPlan, shard_module
from hyper_parallel.core.pipeline_parallel import (
    CommComputeOverlap,
    HookCoordinator,
    HookRole,
    MetaStepType,
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from hyper_parallel.core.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from hyper_parallel.platform import Capability, P2POp, Platform, ReduceOp, Work, get_platform, init

__all__ = [
    # platform
    "Capability", "P2POp", "Platform", "ReduceOp", "Work", "get_platform", "init",
    # DTensor
    "DTensor", "DeviceMesh", "OP_RULES", "OpRule", "Partial", "Placement", "Replicate", "Shard",
    "SkipDTensorDispatch", "clip_grads_by_global_norm", "distribute_module", "global_grad_norm", "distribute_parameter", "distribute_tensor", "dtensor_functional", "init_device_mesh",
    # tensor parallelism
    "ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "RowwiseParallel", "SequenceParallel",
    "parallelize_module",
    # context parallelism
    "AsyncContextParallel", "ContextParallel", "context_parallel_shard", "context_parallel_unshard",
    "scaled_dot_product_attention",
    # fully_shard / HSDP
    "CPUOffloadPolicy", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard",
    # pipeline and expert parallelism
    "CommComputeOverlap", "HookCoordinator", "HookRole", "MetaStepType", "MoE", "PipelineSchedule", "PipelineStage",
    "Schedule1F1B", "ScheduleDualPipeV", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    # activation checkpointing
    "apply_activation_checkpointing", "checkpoint_wrapper",
    # shard_module (the names MindFormers imports)
    "DFunction", "ShardingPlan", "shard_module",
]
__version__ = "1.0.0"
