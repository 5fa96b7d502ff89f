"""hyper_parallel: distributed training of large models on MindSpore and torch.

The core algorithms are written once against ``hyper_parallel.platform``; pick the
backend with ``hyper_parallel.init(platform=...)`` or ``HYPER_PARALLEL_PLATFORM``.
"""

from hyper_parallel.platform import Capability, P2POp, Platform, ReduceOp, Work, get_platform, init

__all__ = ["Capability", "P2POp", "Platform", "ReduceOp", "Work", "get_platform", "init"]
__version__ = "0.1.0"
