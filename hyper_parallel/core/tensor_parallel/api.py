"""``parallelize_module``: apply a tensor-parallel plan, ``{module fqn glob: style}``."""

from __future__ import annotations

import fnmatch
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.tensor_parallel.style import ParallelStyle
from hyper_parallel.platform import get_platform


def parallelize_module(module: Any, device_mesh: DeviceMesh,
                       parallelize_plan: ParallelStyle | dict[str, ParallelStyle]) -> Any:
    """Apply ``parallelize_plan`` to ``module`` over the 1-D ``device_mesh``.

    The plan is data: ``{"layers.*.attention.wq": ColwiseParallel(), ...}``; each key is
    an ``fnmatch`` glob over the dotted names of ``named_modules``, and every match gets
    its style (a style alone applies to ``module`` itself). Returns ``module``.

    Raises:
        TypeError: a plan value is not a ParallelStyle.
        ValueError: a key matches no module (the message lists the module names), or the
            mesh is not 1-D.
    """
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan.apply(module, device_mesh)
    modules = dict(get_platform().named_modules(module))
    for pattern, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_module: plan[{pattern!r}] = {style!r} is not a ParallelStyle")
        matches = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            raise ValueError(f"parallelize_module: {pattern!r} matches no submodule; modules: "
                             f"{[name for name in modules if name][:20]}")
    for pattern, style in parallelize_plan.items():
        for name in [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]:
            style.apply(modules[name], device_mesh)
    return module
