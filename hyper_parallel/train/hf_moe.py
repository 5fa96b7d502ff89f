"""``--hf-config`` of a mixture-of-experts model: the Hugging Face MoE configurations whose
model the job's own MoE decoder (``model.py`` with ``moe_model.py``) computes exactly, mapped
to its ``ModelConfig``, so that the run is the job's decoder on both frameworks (``--ep``,
``--pp``, ``--ep-overlap``, checkpoints, ``hyper-parallel export``); the others refused by
name. Plain JSON: no ``transformers`` import (``hf_config``'s rule).

[Note: Mixtral as the job's MoE decoder]
``transformers``' ``MixtralForCausalLM`` (``model_type: mixtral``) is, block for block, the
job's decoder of ``--moe-every 1 --moe-shared-experts 0`` ([Note: the job's decoder as
Hugging Face's Llama] in ``export.py`` for attention, norms, RoPE, head):

- router: ``softmax(x W_gate^T)`` in float32 over ``num_local_experts``, the
  ``num_experts_per_tok`` largest probabilities (``torch.topk``), divided by their sum: the
  job's ``route`` with a zero balance bias and ``top_k > 1`` ([Note: the job's MoE
  routing]). Top-1 is refused: Mixtral's renormalised single gate is 1, the job's is the
  probability (so that its router keeps a gradient). Ties between probabilities (a set of
  measure zero) may break otherwise: numpy's stable argsort against ``torch.topk``.
- experts: ``w2(silu(w1 x) * w3 x)``, ``w1`` the gate; the job's experts' ``w1``/``w3``/``w2``
  (``hf_names.MIXTRAL_NAMES``). No shared expert, every block MoE.
- ``router_jitter_noise`` > 0 multiplies the block's input by uniform noise while training:
  refused. ``sliding_window`` set: Mistral's windowed attention, the job's is full causal:
  refused (``null`` is the same model for sequences no longer than the window). Attention or
  MLP biases, attention dropout, another ``hidden_act``, a ``head_dim`` other than
  ``hidden_size / num_attention_heads`` and a RoPE type other than ``default`` are refused.

The balance: ``transformers`` adds a balance loss only with ``output_router_logits: true``
(default ``false``), and its loss (``load_balancing_loss_func``) is Switch's
``E * sum_e f_e P_e`` over the whole batch's tokens of all layers pooled, ``f_e`` counting
(token, slot) rows per token (``top_k`` at perfect balance); the job's ``aux-loss`` takes it
per layer and per sequence (DeepSeek-V3's sequence-wise form, [Note: balance across
layouts]), 1 at balance. Not the same objective: a config with ``output_router_logits:
true`` is refused; without it, ``transformers`` trains on the cross-entropy alone, which is
the job's ``--moe-balance none``, the balance this mapping gives (``router_aux_loss_coef``
is kept as ``moe_aux_loss_coef``, unused, for the export's ``config.json``).

Qwen3-MoE's (``qwen3_moe``) routing would map where its ``norm_topk_prob`` is true (false: the gates
are not renormalised) and its MoE blocks are the job's ``moe_every`` rule
(``decoder_sparse_step``, no ``mlp_only_layers``), but its attention normalises each head's
queries and keys (``q_norm``, ``k_norm``), which the job's attention does not: refused by
name, as Qwen2-MoE (a sigmoid-gated shared expert, biased q/k/v projections), OLMoE (norms
on queries and keys, no renormalisation) and DeepSeek-V2/V3 (latent attention, grouped
routing) are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyper_parallel.train.model_config import ModelConfig

#: The MoE ``model_type``s refused by name, and what in each the job's decoder does not compute.
REFUSED_MOE_TYPES: dict[str, str] = {
    "qwen3_moe": "its attention normalises each head's queries and keys (per-head RMSNorm q_norm/k_norm), which "
                 "the job's attention does not",
    "qwen2_moe": "its shared expert is scaled by a sigmoid gate (shared_expert_gate) and its q/k/v projections "
                 "have biases, which the job's decoder has not",
    "olmoe": "its attention normalises queries and keys (q_norm/k_norm) and it does not renormalise the top-k "
             "gates, which the job's decoder does",
    "deepseek_v2": "its multi-head latent attention and grouped routing are not the job's",
    "deepseek_v3": "its multi-head latent attention and sigmoid grouped routing are not the job's",
}

#: ``transformers.MixtralConfig``'s defaults of the keys read here: a ``config.json`` that
#: leaves one out means this value (``rope_theta`` is 1e6 for Mixtral, not Llama's 1e4).
MIXTRAL_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 8, "num_experts_per_tok": 2, "num_key_value_heads": 8, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
    "sliding_window": None, "router_jitter_noise": 0.0, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0,
    "max_position_embeddings": 4096 * 32,
}


def _problems(v: dict[str, Any]) -> list[str]:
    """What in the Mixtral configuration ``v`` the job's decoder does not compute, each with
    its fix ([Note: Mixtral as the job's MoE decoder])."""
    get = lambda key: v.get(key, MIXTRAL_DEFAULTS.get(key))  # noqa: E731 -- the defaults of one config
    out = []
    experts, top_k = int(get("num_local_experts")), int(get("num_experts_per_tok"))
    if top_k < 2 or top_k > experts:
        out.append(f"num_experts_per_tok={top_k} with num_local_experts={experts}: the job maps top-k routing with "
                   "2 <= k <= experts (Mixtral's top-1 gate is renormalised to 1, the job's is the probability); "
                   "use 2 or more")
    if get("sliding_window") is not None:
        out.append(f"sliding_window={get('sliding_window')!r}: the job's attention is full causal attention; set "
                   "\"sliding_window\": null (the same model for sequences no longer than the window)")
    if float(get("router_jitter_noise")):
        out.append(f"router_jitter_noise={get('router_jitter_noise')!r} multiplies the experts' input by random "
                   "noise in training, which the job does not; set it to 0.0")
    if get("output_router_logits"):
        out.append("output_router_logits=true adds transformers' balance loss (pooled over the batch and all "
                   "layers), which is not the job's (per sequence and layer); set it to false (transformers' default: "
                   "cross-entropy alone, the job's --moe-balance none)")
    if get("hidden_act") != "silu":
        out.append(f"hidden_act={get('hidden_act')!r}: the job's experts are SwiGLU (silu); use \"silu\"")
    if float(get("attention_dropout")):
        out.append(f"attention_dropout={get('attention_dropout')!r}: the job has no dropout; set it to 0.0")
    for key in ("attention_bias", "mlp_bias"):
        if v.get(key):
            out.append(f"{key}=true: the job's projections have no biases; use a model without them")
    dim, heads = int(v["hidden_size"]), int(v["num_attention_heads"])
    if v.get("head_dim") not in (None, dim // heads) or dim % heads:
        out.append(f"head_dim={v.get('head_dim')!r} with hidden_size={dim}, num_attention_heads={heads}: the job's "
                   "heads are hidden_size / num_attention_heads wide; use such a head_dim (or null)")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or v.get("rope_scaling"):
        out.append(f"rope_parameters={rope!r} / rope_scaling={v.get('rope_scaling')!r}: the job's RoPE is the "
                   "default type (no scaling); use \"rope_type\": \"default\"")
    return out


def moe_model_config(values: dict[str, Any], config_file: Path, seq_len: int) -> ModelConfig:
    """The job's MoE ``ModelConfig`` of a mixture-of-experts ``--hf-config`` ([Note: Mixtral
    as the job's MoE decoder]) whose ``config.json`` ``config_file`` holds ``values``
    (``HFSource.values``; this module imports no ``hf_config``, which imports it): Mixtral's
    sizes, ``moe_every=1``, no shared expert, ``moe_balance="none"``; the rotary tables
    cover ``max(max_position_embeddings, seq_len)`` (RoPE has no table to outgrow).

    Raises:
        ValueError: a model type other than ``mixtral`` (``REFUSED_MOE_TYPES`` say why), or a
            Mixtral configuration the job's decoder does not compute exactly (every key named,
            with its value, the rule and the fix).
    """
    v, where = values, f"--hf-config={str(config_file)!r}"
    kind = str(v.get("model_type", "unknown"))
    if kind != "mixtral":
        why = REFUSED_MOE_TYPES.get(kind, "only Mixtral (model_type mixtral) is mapped to the job's MoE decoder")
        raise ValueError(f"{where}: a mixture-of-experts model of type {kind!r}, which --hf-config does not train: "
                         f"{why}; use a Mixtral config, a dense one, or the job's own MoE decoder (--model moe-small, "
                         "or --moe-experts N with the other --moe-* flags)")
    problems = _problems(v)
    if problems:
        raise ValueError(f"{where}: this Mixtral configuration is not one the job's MoE decoder computes exactly: "
                         + "; ".join(problems))
    get = lambda key: v.get(key, MIXTRAL_DEFAULTS.get(key))  # noqa: E731 -- as in _problems
    heads = int(v["num_attention_heads"])
    rope = v.get("rope_parameters") or {}
    return ModelConfig(dim=int(v["hidden_size"]), n_layers=int(v["num_hidden_layers"]), n_heads=heads,
                       # absent: MixtralConfig's 8; null: one per query head (earlier transformers' rule)
                       n_kv_heads=int(get("num_key_value_heads") or heads), hidden_dim=int(v["intermediate_size"]),
                       max_seq_len=max(int(get("max_position_embeddings")), seq_len),
                       tie_embeddings=bool(get("tie_word_embeddings")),
                       rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
                       norm_eps=float(get("rms_norm_eps")), vocab_size=int(v["vocab_size"]),
                       moe_experts=int(get("num_local_experts")), moe_top_k=int(get("num_experts_per_tok")),
                       moe_shared_experts=0, moe_every=1, moe_balance="none",
                       moe_aux_loss_coef=float(get("router_aux_loss_coef")))
