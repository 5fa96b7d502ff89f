"""The main job, ``hyper-parallel train``: a Llama-style byte-level language model trained on
real text across N ranks with the parallel layout given on the command line, on torch or on
MindSpore. See ``docs/train.md``.

Written over the platform, as core is: the decoder is defined once (``model.py``, over
``Platform.module_types()``); ``hf_model.py`` is torch by nature. What is still per framework
(the optimizer, the launcher) is listed in ``tests/train/test_one_definition.py``. The
parallelism itself comes from core.
"""

from hyper_parallel.train.config import PRESETS, Layout, ModelConfig, TrainConfig

__all__ = ["PRESETS", "Layout", "ModelConfig", "TrainConfig"]
