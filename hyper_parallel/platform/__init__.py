"""The platform contract and its backends (see ``docs/platform.md``): ``Platform`` and its
types from ``base``, and backend selection (``get_platform``, ``init``; the rule is in
``selection.py``).
"""

from __future__ import annotations

from hyper_parallel.platform.base import (
    BACKENDS,
    FULL,
    Activation,
    AttentionMask,
    Capability,
    P2POp,
    Platform,
    ReduceOp,
    Work,
    mesh_device_types,
)
from hyper_parallel.platform.selection import (
    ENV_VAR,
    backend_problem,
    framework_of,
    get_platform,
    init,
    installed_frameworks,
    requested_platform,
    reset_platform,
)

__all__ = ["BACKENDS", "ENV_VAR", "FULL", "Activation", "AttentionMask", "Capability", "P2POp", "Platform", "ReduceOp", "Work",
           "backend_problem", "framework_of", "get_platform", "init", "installed_frameworks", "mesh_device_types",
           "requested_platform", "reset_platform"]
