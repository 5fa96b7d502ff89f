"""The one mapping between the job's decoder's parameter names (``model.parameter_shapes``)
and Hugging Face's: Llama's for the dense decoder ([Note: the job's decoder as Hugging
Face's Llama] in ``export.py``; Qwen3's names for the per-head query/key norms),
Mixtral's or Qwen3-MoE's for the MoE blocks. ``hyper-parallel export`` writes by it
(``export.hf_state``, ``export.moe_state``) and an MoE ``--hf-config`` folder's weights
are read by it (``hf_weights``). Plain data: no framework, no I/O.
"""

from __future__ import annotations

import re


#: The job's parameter names (``model.parameter_shapes``) -> Hugging Face Llama's, by
#: pattern (``{i}`` the block). See [Note: the job's decoder as Hugging Face's Llama].
HF_NAMES: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """Hugging Face Llama's name of the job's parameter ``name``
    (``layers.3.feed_forward.w1.weight`` -> ``model.layers.3.mlp.gate_proj.weight``).

    Raises:
        ValueError: ``name`` is not a parameter of the job's decoder.
    """
    block = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    pattern = f"layers.{{i}}.{block.group(2)}" if block else name
    if pattern not in HF_NAMES:
        raise ValueError(f"{name!r} is not a parameter of hyper-parallel train's decoder "
                         f"(model.parameter_shapes); cannot name it for Hugging Face's Llama")
    return HF_NAMES[pattern].replace("{i}", block.group(1)) if block else HF_NAMES[pattern]


#: The job's MoE block parameters -> Mixtral's, per block ``{i}`` (and expert ``{e}`` for the
#: stacked experts, ``[experts, ...]`` split into one tensor each): the per-expert layout
#: transformers 5 converts on load (to its fused ``gate_up_proj``) and vLLM reads.
MIXTRAL_NAMES: dict[str, str] = {
    "layers.{i}.moe.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "layers.{i}.moe.experts.w1": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "layers.{i}.moe.experts.w2": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    "layers.{i}.moe.experts.w3": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
}


#: Qwen3-MoE's names of the same (``transformers.Qwen3MoeForCausalLM``'s files: one tensor
#: per expert, ``gate_proj``/``up_proj``/``down_proj``, which transformers 5 fuses on load;
#: its dense blocks' MLP has Llama's names).
QWEN3_MOE_NAMES: dict[str, str] = {
    "layers.{i}.moe.router.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.moe.experts.w1": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "layers.{i}.moe.experts.w2": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "layers.{i}.moe.experts.w3": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
}

#: The MoE ``model_type``s the job's MoE decoder maps to (``hf_moe``): their block names and
#: the name they go by in messages.
MOE_NAMES: dict[str, dict[str, str]] = {"mixtral": MIXTRAL_NAMES, "qwen3_moe": QWEN3_MOE_NAMES}
MOE_TITLES: dict[str, str] = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}


def moe_name(name: str, model_type: str) -> str:
    """The Hugging Face name, in ``model_type``'s files (``MOE_NAMES``), of the job's MoE
    decoder parameter ``name``: the MoE table's in an MoE sublayer, where ``{e}`` is left for
    the expert (the job stacks the experts on dim 0: its ``[experts, ...]`` tensor is the
    ``experts`` tensors of ``[...]``), ``hf_name``'s elsewhere. What ``export.moe_state``
    writes and ``hf_weights`` reads.

    Raises:
        ValueError: ``name`` is not a parameter of the job's decoder.
        KeyError: ``model_type`` is not one of ``MOE_NAMES``.
    """
    table = MOE_NAMES[model_type]
    block = re.fullmatch(r"layers\.(\d+)\.(moe\..+)", name)
    pattern = f"layers.{{i}}.{block.group(2)}" if block else None
    if block is None or pattern not in table:
        return hf_name(name)
    return table[pattern].replace("{i}", block.group(1))
