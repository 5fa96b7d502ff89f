"""Which backend the tests run on. How a world's processes start and what environment
each gets is ``hyper_parallel.platform.launch``, shared with ``hyper-parallel train``;
its names are re-exported here for the harness's users."""

from __future__ import annotations

from hyper_parallel.platform.launch import (
    HOST,
    LAUNCH_BLOCKING_VAR,
    PLATFORM_ENV_VAR,
    ProcessPlan,
    check_world,
    framework_of,
    launch_plan,
)
from hyper_parallel.platform.selection import requested_platform

__all__ = ["HOST", "LAUNCH_BLOCKING_VAR", "PLATFORM_ENV_VAR", "ProcessPlan", "check_world", "framework_of",
           "launch_plan", "selected_platform"]


def selected_platform() -> str:
    """The backend the tests run on: ``$HYPER_PARALLEL_PLATFORM``, else the CPU backend of
    the framework the selection rule picks (``platform.requested_platform``: the one
    imported, else the only one installed, else MindSpore)."""
    name = requested_platform()
    return f"{name}-cpu" if name in ("torch", "mindspore") else name
