"""The MindSpore backend: CPU (MCCL host collectives) and Ascend (HCCL).

``MindSporePlatform`` implements the platform contract; ``run_scheduler`` runs the
scheduler process of a cluster launched without msrun.
"""

from hyper_parallel.platform.mindspore.groups import run_scheduler
from hyper_parallel.platform.mindspore.platform import MindSporePlatform

__all__ = ["MindSporePlatform", "run_scheduler"]
