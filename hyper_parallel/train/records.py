"""What a checkpoint records of the run that wrote it, for a resume or an export to check
against: the layout, the model and the data stream. Plain data, read by the ranks
(``loop.py``) and by the command line before any rank starts (``preflight.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyper_parallel.train.config import Layout, TrainConfig
from hyper_parallel.train.hf_config import read_hf_config, recorded_config
from hyper_parallel.train.model_config import LATER_DEFAULTS, MOE_DEFAULTS


def layout_record(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """The layout a checkpoint was written by: the degrees (and the pipeline stages). A
    resume in another one reshards."""
    record: dict[str, Any] = {"degrees": layout.degrees()}
    if layout.ep > 1:  # only then: the records of runs without --ep stay as they were
        record["ep"] = layout.ep
    if layout.pp > 1:
        record["pipeline_stages"] = layout.num_stages
    return record


def model_record(cfg: TrainConfig) -> dict[str, Any]:
    """The model a checkpoint holds: every field of ``ModelConfig`` (a resume needs the same)
    and, for a dense ``--hf-config`` run (``TrainConfig.hf_module``; an MoE one is the job's
    decoder, exported as Mixtral or Qwen3-MoE from this record), the HF configuration under ``hf_config``
    (``hf_config.recorded_config``: plain JSON, read again here, no ``transformers``), from
    which ``hyper-parallel export`` writes the exported model's ``config.json``. A dense
    decoder's record leaves the MoE fields out (``MOE_DEFAULTS``): the same record as
    before they existed, so those checkpoints still resume; so does every record a field of
    ``LATER_DEFAULTS`` at that value."""
    record = dataclasses.asdict(cfg.model)
    if not cfg.model.moe_experts:
        for name in MOE_DEFAULTS:
            del record[name]
    for name, default in LATER_DEFAULTS.items():
        if record.get(name, default) == default:
            record.pop(name, None)
    if cfg.hf_module:  # an MoE --hf-config is the job's decoder: its record, exported from it
        record["hf_config"] = recorded_config(read_hf_config(cfg.hf_config))
    return record


def data_record(cfg: TrainConfig) -> dict[str, Any]:
    """What, with the step, decides the batches (``data.global_batch``): a resume with other
    values continues on another data stream (allowed, with a warning)."""
    return {"seed": cfg.seed, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len}
