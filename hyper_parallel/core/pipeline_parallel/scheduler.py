"""Upstream hyper-parallel's import path for the custom-step protocol, kept because
MindFormers imports ``MetaStepType`` from here (``docs/mindformers.md``). The protocol
lives in ``custom_step``; this module only names it under the old path."""

from hyper_parallel.core.pipeline_parallel.custom_step import (CUSTOM_TYPES, CustomStepFn, MetaStepType,
                                                               PipelineContext)

__all__ = ["CUSTOM_TYPES", "CustomStepFn", "MetaStepType", "PipelineContext"]
