"""Pipeline parallelism: stages, schedules as data (per-rank action lists), their
lowering to point-to-point communication, a validator, a time/memory simulator, and the
runtime that executes the action lists (GPipe, 1F1B, interleaved 1F1B)."""

from hyper_parallel.core.pipeline_parallel.messages import TensorSpec
from hyper_parallel.core.pipeline_parallel.named_schedules import (Schedule1F1B, ScheduleGPipe,
                                                                   ScheduleInterleaved1F1B)
from hyper_parallel.core.pipeline_parallel.runtime import PipelineSchedule, in_stage_backward
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage

__all__ = ["PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "TensorSpec", "in_stage_backward"]

from hyper_parallel.core.pipeline_parallel.comm_compute_overlap import CommComputeOverlap  # noqa: E402
from hyper_parallel.core.pipeline_parallel.hook_coordinator import HookCoordinator, HookRole  # noqa: E402
from hyper_parallel.core.pipeline_parallel.custom_step import MetaStepType, PipelineContext  # noqa: E402

__all__ += ["CommComputeOverlap", "HookCoordinator", "HookRole", "MetaStepType", "PipelineContext"]

from hyper_parallel.core.pipeline_parallel.named_schedules import (ScheduleDualPipeV,  # noqa: E402
                                                                   ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

__all__ += ["ScheduleDualPipeV", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]

from hyper_parallel.core.pipeline_parallel.schedule_table import SCHEDULES, ScheduleEntry, schedule_entry  # noqa: E402

__all__ += ["SCHEDULES", "ScheduleEntry", "schedule_entry"]
