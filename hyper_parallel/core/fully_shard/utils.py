"""Re-exports ``OffloadPolicy`` and ``CPUOffloadPolicy`` (``policies``) at the path MindFormers imports."""

from hyper_parallel.core.fully_shard.policies import CPUOffloadPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "OffloadPolicy"]
