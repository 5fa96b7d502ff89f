"""``distribute_module`` and ``distribute_parameter``: place a module's parameters on a
mesh and convert its inputs and outputs at its edges.

A distributed parameter is a framework parameter made from a DTensor (see [Note:
parameters are DTensors, forwards compute on local tensors] in
``core/tensor_parallel/style.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Placement
from hyper_parallel.platform import get_platform


def distribute_parameter(module: Any, name: str, device_mesh: DeviceMesh, placements: Sequence[Placement]) -> Any:
    """Replace ``module``'s own parameter ``name`` by a parameter made from the DTensor
    ``distribute_tensor(param, device_mesh, placements)`` (``src_data_rank=0``: the values
    of mesh coordinate 0 are **broadcast** first): global shape, this rank's piece as its
    local tensor. Returns the new parameter.

    Raises:
        KeyError: ``module`` has no parameter ``name``.
        ValueError: placements that do not fit the mesh or the parameter.
    """
    p = get_platform()
    own = dict(p.named_parameters(module))
    if name not in own:
        raise KeyError(f"distribute_parameter: {type(module).__name__} has no parameter {name!r}; "
                       f"its parameters: {sorted(own)}")
    with p.no_grad():
        param = p.make_parameter(distribute_tensor(p.detach(own[name]), device_mesh, placements),
                                 requires_grad=bool(getattr(own[name], "requires_grad", True)))
    p.set_parameter(module, name, param)
    return param


def distribute_module(module: Any, device_mesh: DeviceMesh,
                      partition_fn: Callable[[str, Any, DeviceMesh], None] | None = None,
                      input_fn: Callable[[Any, tuple, DeviceMesh], Any] | None = None,
                      output_fn: Callable[[Any, Any, DeviceMesh], Any] | None = None) -> Any:
    """Distribute ``module`` over ``device_mesh`` (torch's ``distribute_module`` contract).

    Args:
        partition_fn: called as ``partition_fn(fqn, submodule, device_mesh)`` for every
            submodule, root first (``fqn`` ``""``), typically calling
            ``distribute_parameter``. ``None``: parameters stay whole (replicated).
        input_fn: ``input_fn(module, args, device_mesh) -> args | None``, run before the
            root's forward (a forward pre-hook).
        output_fn: ``output_fn(module, output, device_mesh) -> output | None``, run after
            it (a forward hook).

    Returns:
        ``module``.
    """
    p = get_platform()
    if partition_fn is not None:
        for fqn, submodule in list(p.named_modules(module)):
            partition_fn(fqn, submodule, device_mesh)
    if input_fn is not None:
        p.register_forward_pre_hook(module, lambda mod, args: input_fn(mod, args, device_mesh))
    if output_fn is not None:
        p.register_forward_hook(module, lambda mod, args, out: output_fn(mod, out, device_mesh))
    return module
