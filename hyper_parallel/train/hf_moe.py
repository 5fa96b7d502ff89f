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
  MLP biases, attention dropout, another ``hidden_act``, an odd ``head_dim`` and a RoPE type
  other than ``default`` are refused; a ``head_dim`` other than ``hidden_size /
  num_attention_heads`` is the job's ``explicit_head_dim``.

The balance: ``transformers`` adds a balance loss only with ``output_router_logits: true``
(default ``false``), and its loss (``load_balancing_loss_func``) is Switch's
``E * sum_e f_e P_e`` over the whole batch's tokens of all layers pooled, ``f_e`` counting
(token, slot) rows per token (``top_k`` at perfect balance); the job's ``aux-loss`` takes it
per layer and per sequence (DeepSeek-V3's sequence-wise form, [Note: balance across
layouts]), 1 at balance. Not the same objective: a config with ``output_router_logits:
true`` is refused; without it, ``transformers`` trains on the cross-entropy alone, which is
the job's ``--moe-balance none``, the balance this mapping gives (``router_aux_loss_coef``
is kept as ``moe_aux_loss_coef``, unused, for the export's ``config.json``).

[Note: Qwen3-MoE as the job's MoE decoder]
``transformers``' ``Qwen3MoeForCausalLM`` (``model_type: qwen3_moe``) is Mixtral's model
above with these differences, each a field of the job's ``ModelConfig``:

- attention: each head's queries and keys are RMS-normalised over ``head_dim`` before RoPE
  (``self_attn.q_norm``/``k_norm``, epsilon ``rms_norm_eps``): ``qk_norm`` ([Note: per-head
  query/key norms] in ``model.py``); ``head_dim`` may differ from ``hidden_size /
  num_attention_heads`` (Qwen3-30B-A3B: 2048 / 32 heads, ``head_dim`` 128):
  ``explicit_head_dim``.
- router: softmax, top ``num_experts_per_tok``, the gates renormalised only with
  ``norm_topk_prob: true``; ``false`` (transformers' default) keeps the chosen
  probabilities: ``moe_norm_topk`` (top-1 with ``true`` is refused, as Mixtral's top-1).
- MoE blocks: block ``i`` is MoE when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not
  in ``mlp_only_layers``: the job's ``moe_every = decoder_sparse_step`` where
  ``mlp_only_layers`` names only blocks that rule leaves dense already, refused otherwise;
  the dense blocks' SwiGLU is ``intermediate_size`` wide (``hidden_dim``), the experts'
  ``moe_intermediate_size`` (``moe_hidden_dim``). No shared expert.
- the experts' names are ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, the router's
  ``mlp.gate`` (``hf_names.QWEN3_MOE_NAMES``); ``num_experts`` (which ``save_pretrained``
  writes as ``num_local_experts``) counts them.
- sliding window: ``sliding_window`` applies only with ``use_sliding_window: true``, refused.

The balance, biases, dropout, activation and RoPE are refused or kept as for Mixtral.

Qwen2-MoE (a sigmoid-gated shared expert, biased q/k/v projections), OLMoE (norms on
the whole query and key vectors, not per head) and DeepSeek-V2/V3 (latent attention,
grouped routing) are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyper_parallel.train.hf_names import MOE_TITLES
from hyper_parallel.train.model_config import ModelConfig

#: The MoE ``model_type``s refused by name, and what in each the job's decoder does not compute.
REFUSED_MOE_TYPES: dict[str, str] = {
    "qwen2_moe": "its shared expert is scaled by a sigmoid gate (shared_expert_gate) and its q/k/v projections "
                 "have biases, which the job's decoder has not",
    "olmoe": "its attention normalises the whole query and key vectors (q_norm/k_norm over all heads), which the "
             "job's per-head norms do not",
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

#: ``transformers.Qwen3MoeConfig``'s defaults, likewise (``norm_topk_prob`` false; the
#: window applies only with ``use_sliding_window``; ``num_experts`` also read as
#: ``num_local_experts``, the name ``save_pretrained`` writes).
QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 128, "num_experts_per_tok": 8, "num_key_value_heads": 4, "rope_theta": 1e4, "rms_norm_eps": 1e-6,
    "use_sliding_window": False, "sliding_window": 4096, "router_jitter_noise": 0.0, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0,
    "max_position_embeddings": 32768, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
    "moe_intermediate_size": 768,
}

#: The MoE ``model_type``s the job's MoE decoder computes, and their defaults.
MAPPED_DEFAULTS: dict[str, dict[str, Any]] = {"mixtral": MIXTRAL_DEFAULTS, "qwen3_moe": QWEN3_MOE_DEFAULTS}


class _Values:
    """One MoE ``config.json``'s values with its type's defaults (``MAPPED_DEFAULTS``)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values, self.kind = values, str(values.get("model_type", "unknown"))
        self.defaults = MAPPED_DEFAULTS[self.kind]

    def __call__(self, key: str) -> Any:
        if key == "num_experts" and self.kind == "qwen3_moe" and key not in self.values:
            return self.values.get("num_local_experts", self.defaults[key])
        return self.values.get(key, self.defaults.get(key))

    @property
    def experts(self) -> int:
        return int(self("num_local_experts" if self.kind == "mixtral" else "num_experts"))

    @property
    def norm_topk(self) -> bool:
        """Whether the top-k gates are renormalised (Mixtral: always)."""
        return self.kind == "mixtral" or bool(self("norm_topk_prob"))

    @property
    def sliding_window(self) -> Any:
        """The window the model's attention applies (``None``: full causal)."""
        if self.kind == "qwen3_moe" and not self("use_sliding_window"):
            return None
        return self("sliding_window")

    @property
    def head_dim(self) -> int:
        """Each head's width: ``head_dim``, or (absent or null) ``hidden_size / num_attention_heads``."""
        return int(self.values.get("head_dim") or int(self.values["hidden_size"]) // int(self.values["num_attention_heads"]))


def moe_every(get: _Values) -> tuple[int, list[str]]:
    """``(moe_every, problems)``: the job's ``moe_every`` whose MoE blocks are the config's
    ([Note: Qwen3-MoE as the job's MoE decoder]; Mixtral: every block), and what in the
    config no ``moe_every`` gives, with the fix."""
    if get.kind == "mixtral":
        return 1, []
    layers, step, only = int(get.values["num_hidden_layers"]), get("decoder_sparse_step"), get("mlp_only_layers") or []
    if not isinstance(step, int) or not 1 <= step <= layers:
        return 1, [f"decoder_sparse_step={step!r} with num_hidden_layers={layers}: the job's MoE blocks are every "
                   f"L-th block with 1 <= L <= num_hidden_layers (else the model is dense); use 1 to {layers}, or a "
                   "dense config (model_type qwen3)"]
    theirs = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
    ours = [i for i in range(layers) if (i + 1) % step == 0]
    if theirs != ours:
        dense = sorted(set(ours) - set(theirs))
        return step, [f"mlp_only_layers={only!r} makes blocks {dense} dense, which decoder_sparse_step={step} makes "
                      f"MoE: the job's MoE blocks are every {step}-th block (blocks {ours}), with no exceptions; "
                      "use \"mlp_only_layers\": [] (or list only blocks the step leaves dense)"]
    return step, []


def _problems(get: _Values) -> list[str]:
    """What in the MoE configuration the job's decoder does not compute, each with its fix
    ([Note: Mixtral as the job's MoE decoder], [Note: Qwen3-MoE as the job's MoE decoder])."""
    out = []
    experts, top_k = get.experts, int(get("num_experts_per_tok"))
    name = "num_local_experts" if get.kind == "mixtral" else "num_experts"
    if top_k < 1 or top_k > experts or (top_k == 1 and get.norm_topk):
        why = ("Mixtral's" if get.kind == "mixtral" else "with norm_topk_prob=true, Qwen3-MoE's") + \
            " top-1 gate is renormalised to 1, the job's is the probability"
        out.append(f"num_experts_per_tok={top_k} with {name}={experts}: the job maps top-k routing with "
                   f"1 <= k <= experts, and k >= 2 where the gates are renormalised ({why}); use 2 or more")
    window = get.sliding_window
    if window is not None:
        key = "use_sliding_window=true with sliding_window" if get.kind == "qwen3_moe" else "sliding_window"
        fix = "\"use_sliding_window\": false" if get.kind == "qwen3_moe" else "\"sliding_window\": null"
        out.append(f"{key}={window!r}: the job's attention is full causal attention; set {fix} (the same model "
                   "for sequences no longer than the window)")
    if float(get("router_jitter_noise")):
        out.append(f"router_jitter_noise={get('router_jitter_noise')!r} multiplies the experts' input by random "
                   "noise in training, which the job does not; set it to 0.0")
    if get("output_router_logits"):
        out.append("output_router_logits=true adds transformers' balance loss (pooled over the batch and all "
                   "layers), which is not the job's (per sequence and layer); set it to false (transformers' default: "
                   "cross-entropy alone, the job's --moe-balance none), and give --moe-balance aux-loss (or aux-free) "
                   "for the job's own balancing")
    if get("hidden_act") != "silu":
        out.append(f"hidden_act={get('hidden_act')!r}: the job's experts are SwiGLU (silu); use \"silu\"")
    if float(get("attention_dropout")):
        out.append(f"attention_dropout={get('attention_dropout')!r}: the job has no dropout; set it to 0.0")
    for key in ("attention_bias", "mlp_bias"):
        if get.values.get(key):
            out.append(f"{key}=true: the job's projections have no biases; use a model without them")
    dim, heads = int(get.values["hidden_size"]), int(get.values["num_attention_heads"])
    if get.head_dim < 1 or get.head_dim % 2 or (not get.values.get("head_dim") and dim % heads):
        out.append(f"head_dim={get.values.get('head_dim')!r} with hidden_size={dim}, num_attention_heads={heads}: "
                   "the job's heads are an even number of features wide (RoPE rotates pairs), head_dim or else "
                   "hidden_size / num_attention_heads; give an even head_dim")
    rope = get.values.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or get.values.get("rope_scaling"):
        out.append(f"rope_parameters={rope!r} / rope_scaling={get.values.get('rope_scaling')!r}: the job's RoPE is "
                   "the default type (no scaling); use \"rope_type\": \"default\"")
    out += moe_every(get)[1]
    return out


def moe_model_config(values: dict[str, Any], config_file: Path, seq_len: int) -> ModelConfig:
    """The job's MoE ``ModelConfig`` of a mixture-of-experts ``--hf-config`` ([Note: Mixtral
    as the job's MoE decoder], [Note: Qwen3-MoE as the job's MoE decoder]) whose
    ``config.json`` ``config_file`` holds ``values`` (``HFSource.values``; this module
    imports no ``hf_config``, which imports it): the model's sizes, its MoE blocks as
    ``moe_every``, no shared expert, ``moe_balance="none"``; the rotary tables cover
    ``max(max_position_embeddings, seq_len)`` (RoPE has no table to outgrow).

    Raises:
        ValueError: a model type other than ``MAPPED_DEFAULTS``' (``REFUSED_MOE_TYPES`` say
            why), or a configuration the job's decoder does not compute exactly (every key
            named, with its value, the rule and the fix).
    """
    v, where = values, f"--hf-config={str(config_file)!r}"
    kind = str(v.get("model_type", "unknown"))
    if kind not in MAPPED_DEFAULTS:
        why = REFUSED_MOE_TYPES.get(kind, "only Mixtral (model_type mixtral) and Qwen3-MoE (qwen3_moe) are mapped to "
                                          "the job's MoE decoder")
        raise ValueError(f"{where}: a mixture-of-experts model of type {kind!r}, which --hf-config does not train: "
                         f"{why}; use a Mixtral or Qwen3-MoE config, a dense one, or the job's own MoE decoder "
                         "(--model moe-small, or --moe-experts N with the other --moe-* flags)")
    get = _Values(v)
    problems = _problems(get)
    if problems:
        raise ValueError(f"{where}: this {MOE_TITLES[kind]} configuration is not one the job's MoE decoder computes exactly: "
                         + "; ".join(problems))
    dim, heads = int(v["hidden_size"]), int(v["num_attention_heads"])
    rope = v.get("rope_parameters") or {}
    qwen3 = kind == "qwen3_moe"
    return ModelConfig(dim=dim, n_layers=int(v["num_hidden_layers"]), n_heads=heads,
                       # absent: the type's default; null: one per query head (earlier transformers' rule)
                       n_kv_heads=int(get("num_key_value_heads") or heads), hidden_dim=int(v["intermediate_size"]),
                       max_seq_len=max(int(get("max_position_embeddings")), seq_len),
                       tie_embeddings=bool(get("tie_word_embeddings")),
                       rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
                       norm_eps=float(get("rms_norm_eps")), vocab_size=int(v["vocab_size"]),
                       explicit_head_dim=get.head_dim if get.head_dim * heads != dim else 0, qk_norm=qwen3,
                       moe_experts=get.experts, moe_top_k=int(get("num_experts_per_tok")),
                       moe_hidden_dim=int(get("moe_intermediate_size")) if qwen3 else 0,
                       moe_norm_topk=get.norm_topk, moe_shared_experts=0, moe_every=moe_every(get)[0],
                       moe_balance="none", moe_aux_loss_coef=float(get("router_aux_loss_coef")))
