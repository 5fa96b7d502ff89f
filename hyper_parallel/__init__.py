"""hyper_parallel: distributed training of large models on MindSpore and torch.

The core algorithms are written once against ``hyper_parallel.platform``; pick the
backend with ``hyper_parallel.init(platform=...)`` or ``HYPER_PARALLEL_PLATFORM``.
"""

from hyper_parallel.core.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_parameter,
    distribute_tensor,
    init_device_mesh,
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

__all__ = ["Capability", "ColwiseParallel", "DTensor", "DeviceMesh", "P2POp", "ParallelStyle", "Partial",
           "Placement", "Platform", "PrepareModuleInput", "ReduceOp", "Replicate", "RowwiseParallel",
           "SequenceParallel", "Shard", "Work", "distribute_module", "distribute_parameter",
           "distribute_tensor", "get_platform", "init", "init_device_mesh", "parallelize_module"]
__version__ = "0.1.0"

from hyper_parallel.core.expert_parallel import MoE  # noqa: E402  appended: expert parallelism
from hyper_parallel.core.pipeline_parallel import (  # noqa: E402  appended: pipeline parallelism
    CommComputeOverlap,
    HookCoordinator,
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

__all__ += ["CommComputeOverlap", "HookCoordinator", "MoE", "PipelineSchedule", "PipelineStage", "Schedule1F1B",
            "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
            "ScheduleDualPipeV"]
