"""``--hf-config PATH``: read a Hugging Face model configuration before any rank starts
(plain JSON: the launching process imports neither torch nor ``transformers``), and the
job's ``ModelConfig`` of its sizes, against which ``TrainConfig`` checks the layout. The
model itself is built on the ranks (``hf_model``).

Vocabulary: the job's tokens are bytes, ids ``0 .. 255``; a model whose ``vocab_size`` is
at least 256 trains on them as they are (the rows above 255 of its embedding and head get
no targets, and a pretrained tokenizer's meaning of ids 0-255 is not used: to evaluate the
result, tokenize text as its UTF-8 bytes). A smaller vocabulary is refused.

A mixture-of-experts configuration (``MOE_CONFIG_KEYS``) is not a ``transformers`` model in
the job: the ones the job's own MoE decoder computes exactly (Mixtral, Qwen3-MoE) become that decoder's
``ModelConfig``, the others are refused by name (``hf_moe``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyper_parallel.train.hf_moe import MAPPED_DEFAULTS, moe_model_config
from hyper_parallel.train.model_config import VOCAB_SIZE, ModelConfig

#: Files whose presence in an ``--hf-config`` folder means "load these weights".
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class HFSource:
    """What ``--hf-config`` points at.

    Attributes:
        config_file: the ``config.json``.
        weights_dir: the folder holding weights (``WEIGHT_FILES``): ``from_pretrained``'s
            for a dense model, ``hf_weights``' for an MoE one (``None``: random init on the seed).
        values: the configuration's JSON (its ``text_config`` where it has one).
        document: the whole ``config.json`` as read: what checkpoints record
            (``recorded_config``) and ``hyper-parallel export`` writes back.
    """

    config_file: Path
    weights_dir: Path | None
    values: dict[str, Any]
    document: dict[str, Any]

    @property
    def model_type(self) -> str:
        return str(self.values.get("model_type", "unknown"))

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts configuration (``MOE_CONFIG_KEYS``, or ``model_type`` mixtral or
        qwen3_moe, whose expert count may be left at its default): trained as the job's own MoE decoder
        where it maps, refused otherwise (``hf_moe.moe_model_config``)."""
        return self.model_type in MAPPED_DEFAULTS or any(self.values.get(key) for key in MOE_CONFIG_KEYS)


#: ``config.json`` keys that make a model a mixture of experts (Mixtral, Qwen2/3-MoE,
#: DeepSeek-V2/V3, OLMoE, ...): ``HFSource.is_moe``.
MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def read_hf_config(path: str) -> HFSource:
    """``--hf-config PATH``: a ``config.json``, or a model folder holding one (and maybe
    weights). Plain JSON: no ``transformers`` import in the launching process.

    Raises:
        ValueError: no such file or folder, no ``config.json`` in it, not JSON, or not a
            text model with the fields the job needs.
    """
    given = Path(path)
    config_file = given / "config.json" if given.is_dir() else given
    if not config_file.is_file():
        raise ValueError(f"--hf-config={path!r}: no such file, or a folder without config.json; give a model's "
                         "config.json or its folder (config.json, and weights to load them)")
    try:
        values = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--hf-config={path!r}: {config_file} is not readable JSON ({err})") from err
    document = values
    values = values.get("text_config", values) if isinstance(values, dict) else values
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in need if not isinstance(values, dict) or key not in values]
    if missing:
        raise ValueError(f"--hf-config={path!r}: {config_file} lacks {missing}; give the config of a decoder-only "
                         "causal LM (Llama, Qwen2, Mistral, ...)")
    if int(values["vocab_size"]) < VOCAB_SIZE:
        raise ValueError(f"--hf-config={path!r}: vocab_size={values['vocab_size']} is smaller than the job's "
                         f"{VOCAB_SIZE} byte tokens; use a model with vocab_size >= {VOCAB_SIZE}")
    weights = config_file.parent if any((config_file.parent / f).is_file() for f in WEIGHT_FILES) else None
    return HFSource(config_file, weights, values, document)


#: ``config.json`` keys that describe the file, not the model: left out of the checkpoint's
#: record, so that a config saved again (by another ``transformers``, from another folder)
#: still resumes.
UNRECORDED_KEYS = ("transformers_version", "_name_or_path")


def recorded_config(source: HFSource) -> dict[str, Any]:
    """The HF configuration a checkpoint of an ``--hf-config`` run records in its manifest's
    model record (``records.model_record``, key ``hf_config``): the ``config.json`` as read,
    without ``UNRECORDED_KEYS``. ``--resume`` needs the same one (another configuration is
    another model); ``hyper-parallel export`` writes it as the exported ``config.json``."""
    return {key: value for key, value in source.document.items() if key not in UNRECORDED_KEYS}


def model_config(source: HFSource, seq_len: int) -> ModelConfig:
    """The job's ``ModelConfig`` of the HF model's sizes, against which ``TrainConfig``
    checks the layout (heads per ``--tp``, Ulysses and hybrid degrees). A mixture of experts
    (``HFSource.is_moe``): the job's MoE decoder that computes it (``hf_moe.moe_model_config``,
    with ``moe_experts`` > 0: ``TrainConfig.hf_module`` is false), the only case in which
    the result has experts.

    Raises:
        ValueError: an MoE configuration the job's decoder does not compute exactly.
    """
    if source.is_moe:
        return moe_model_config(source.values, source.config_file, seq_len)
    v = source.values
    heads = int(v["num_attention_heads"])
    rope = v.get("rope_parameters") or {}
    return ModelConfig(dim=int(v["hidden_size"]), n_layers=int(v["num_hidden_layers"]), n_heads=heads,
                       n_kv_heads=int(v.get("num_key_value_heads") or heads),
                       hidden_dim=int(v["intermediate_size"]),
                       # RoPE has no table to outgrow: the job's check against it is moot here
                       max_seq_len=max(int(v.get("max_position_embeddings") or seq_len), seq_len),
                       tie_embeddings=bool(v.get("tie_word_embeddings", False)),
                       rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
                       norm_eps=float(v.get("rms_norm_eps", 1e-5)), vocab_size=int(v["vocab_size"]))
