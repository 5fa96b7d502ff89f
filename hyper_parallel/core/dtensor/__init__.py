"""DTensor: device meshes, placements, distributed tensors, their redistribution, and
ops on them under sharding-propagation rules."""

from hyper_parallel.core.dtensor import functional
from hyper_parallel.core.dtensor.clip_grad import clip_grads_by_global_norm, global_grad_norm
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.dispatch import SkipDTensorDispatch
from hyper_parallel.core.dtensor.distribute_module import distribute_module, distribute_parameter
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.dtensor.op_rules import OP_RULES, OpRule, Strategy
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["DTensor", "DeviceMesh", "OP_RULES", "OpRule", "Partial", "Placement", "Replicate", "Shard",
           "SkipDTensorDispatch", "Strategy", "clip_grads_by_global_norm", "distribute_module", "distribute_parameter", "distribute_tensor", "functional",
           "global_grad_norm", "init_device_mesh"]
