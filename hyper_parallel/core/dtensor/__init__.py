"""DTensor: device meshes, placements, distributed tensors and their redistribution."""

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.distribute_module import distribute_module, distribute_parameter
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_module",
           "distribute_parameter", "distribute_tensor", "init_device_mesh"]
