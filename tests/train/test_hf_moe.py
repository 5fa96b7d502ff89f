"""``hyper-parallel train --hf-config`` of a mixture-of-experts model (``train/hf_moe.py``): a
Mixtral ``config.json`` trains as the job's own MoE decoder on both frameworks (``--ep 2``
on 2 ranks against one process), and the configurations that decoder does not compute
exactly are refused by name, before any rank starts.

Tolerances: ``_moe_ranks``' (``LOSS_RTOL``, ``GRAD_*``), reasoned there: the layouts' float32
sums in other orders, and routing counts compared exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hyper_parallel.train.config import Layout
from tests.train._ranks import tiny_config

#: A tiny Mixtral, as ``transformers.MixtralConfig(...).save_pretrained`` writes it (the keys
#: the mapping reads and the ones it refuses when set), written here without transformers.
TINY_MIXTRAL: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 256, "hidden_size": 32,
    "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": None, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "sliding_window": None, "router_jitter_noise": 0.0, "output_router_logits": False, "router_aux_loss_coef": 0.02,
    "hidden_act": "silu", "attention_dropout": 0.0, "tie_word_embeddings": False, "initializer_range": 0.02,
}


def write_config(folder: Path, **changes: Any) -> str:
    """``folder/config.json`` of ``TINY_MIXTRAL`` with ``changes``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_MIXTRAL, **changes}))
    return str(folder / "config.json")


def test_mixtral_maps_to_the_job_moe_decoder(tmp_path: Path) -> None:
    """The job's MoE decoder of Mixtral's sizes, on either framework (no transformers needed:
    a MindSpore run takes it), with ``--ep``; its checkpoint record is the decoder's."""
    from hyper_parallel.train.records import model_record

    for platform in ("torch", "mindspore"):
        cfg = tiny_config(str(tmp_path / platform), nproc=2, layout=Layout(dp_shard=2, ep=2), platform=platform,
                          hf_config=write_config(tmp_path / "mixtral"))
        mod = cfg.model
        assert (mod.dim, mod.n_layers, mod.n_heads, mod.n_kv_heads, mod.hidden_dim, mod.expert_hidden_dim) == \
            (32, 2, 8, 4, 32, 32)
        assert (mod.moe_experts, mod.moe_top_k, mod.moe_shared_experts, mod.moe_every, mod.moe_balance,
                mod.moe_aux_loss_coef, mod.rope_theta, mod.norm_eps) == (4, 2, 0, 1, "none", 0.02, 1e4, 1e-5)
        assert not cfg.hf_module and cfg.build_on_meta and cfg.model_name == "hf:mixtral"
        assert "hf_config" not in model_record(cfg)
    # a key left out means transformers' MixtralConfig default (rope_theta 1e6, not Llama's 1e4)
    values = {k: v for k, v in TINY_MIXTRAL.items() if k not in ("rope_parameters", "num_experts_per_tok")}
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps(values))
    mod = tiny_config(str(tmp_path / "bare_run"), hf_config=str(tmp_path / "bare")).model
    assert (mod.rope_theta, mod.moe_top_k) == (1e6, 2)


@pytest.mark.parametrize("changes, needles", [
    (dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32, norm_topk_prob=True),
     ["type 'qwen3_moe'", "per-head RMSNorm q_norm/k_norm"]),
    (dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64),
     ["type 'qwen2_moe'", "shared expert is scaled by a sigmoid gate"]),
    (dict(model_type="deepseek_v3", n_routed_experts=4), ["type 'deepseek_v3'", "latent attention"]),
    (dict(model_type="granitemoe"), ["type 'granitemoe'", "only Mixtral (model_type mixtral) is mapped"]),
    (dict(sliding_window=4096), ["sliding_window=4096", "full causal", "\"sliding_window\": null"]),
    (dict(num_experts_per_tok=1), ["num_experts_per_tok=1", "top-1 gate is renormalised to 1"]),
    (dict(output_router_logits=True), ["output_router_logits=true", "--moe-balance none"]),
    (dict(router_jitter_noise=0.1), ["router_jitter_noise=0.1", "set it to 0.0"]),
    (dict(attention_bias=True), ["attention_bias=true"]),
    (dict(head_dim=8), ["head_dim=8", "hidden_size / num_attention_heads"]),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), ["rope_type"]),
    (dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
])
def test_moe_configs_that_do_not_map_are_refused(tmp_path: Path, changes: dict, needles: list[str]) -> None:
    """Every refusal names ``--hf-config``, the key and value, and the fix, in the launching
    process (``TrainConfig``), on either framework."""
    path = write_config(tmp_path / "moe", **changes)
    for platform in ("torch", "mindspore"):
        with pytest.raises(ValueError, match="--hf-config=") as err:
            tiny_config(str(tmp_path / "run"), hf_config=path, platform=platform)
        for needle in needles:
            assert needle in str(err.value), (needle, str(err.value))


def test_mixtral_flags_against_the_layout(tmp_path: Path) -> None:
    """The job's own MoE checks apply: ``--ep`` must divide the experts."""
    with pytest.raises(ValueError, match="--ep=3 must divide --moe-experts=4"):
        tiny_config(str(tmp_path / "run"), nproc=3, layout=Layout(dp_shard=3, ep=3),
                    hf_config=write_config(tmp_path / "mixtral"))


def test_mixtral_trains_with_expert_parallelism(run_on_ranks, tmp_path: Path) -> None:
    """``--hf-config`` Mixtral on dp-shard 2 x ep 2 against one process: first-step gradients,
    losses, gradient norms and routing counts (``_moe_ranks.check_hf_moe_parity``)."""
    from tests.train._moe_ranks import check_hf_moe_parity

    hf_config = write_config(tmp_path / "mixtral")
    curves = run_on_ranks(check_hf_moe_parity, str(tmp_path), hf_config, {"dp_shard": 2, "ep": 2}, world_size=2,
                          timeout_s=600)
    assert curves[0] == curves[1] and len(curves[0]) == 4
