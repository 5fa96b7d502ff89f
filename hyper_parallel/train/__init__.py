"""The main job, ``hyper-parallel train``: a Llama-style byte-level language model trained on
real text across N ranks with the parallel layout given on the command line, on torch or on
MindSpore. See ``docs/train.md``.

Framework-specific code (the model in each framework, the launchers) lives here, outside
``hyper_parallel.core``; the parallelism itself comes from core.
"""

from hyper_parallel.train.config import PRESETS, Layout, ModelConfig, TrainConfig

__all__ = ["PRESETS", "Layout", "ModelConfig", "TrainConfig"]
