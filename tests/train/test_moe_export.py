"""Checkpoints of the job's mixture-of-experts decoder outside training: ``hyper-parallel
export`` as Hugging Face's Mixtral (``export.moe_state``), whose logits are the job's;
what the Mixtral format cannot hold, refused by name; and ``hyper-parallel generate`` /
``eval`` (``generate.load_decoder``), which route with the checkpoint's aux-free balance
biases.

Tolerance of the logits: as ``test_export.py`` (the rotary tables, float64 here and
float32 in HF, a few ulps apart in angle), and the experts' sums: the job runs each
expert's rows in one grouped GEMM, Mixtral one matmul per expert.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.train.config import PRESETS, Layout
from tests.train._ranks import tiny_config
from tests.train.test_export import LOGITS_ATOL, export, export_ok, hf_logits, on_mindspore, on_torch, sample_tokens

#: every block MoE, no shared expert, top-2, aux-loss balance: what Mixtral holds
MIXTRAL_LIKE = dataclasses.replace(PRESETS["moe-tiny"], moe_every=1, moe_shared_experts=0, moe_balance="aux-loss")
#: the default aux-free balance: biases that move every step
AUX_FREE = dataclasses.replace(MIXTRAL_LIKE, moe_balance="aux-free", moe_bias_rate=0.01)


def train_moe(out: str, names: tuple[str, ...] = ("mixtral_like", "aux_free")) -> None:
    """2 steps of each model on ep 2 over all ranks' dp-shard, checkpoints at the last step."""
    from hyper_parallel.platform import get_platform
    from hyper_parallel.train.loop import train

    n = get_platform().world_size()
    for name in names:
        model = {"mixtral_like": MIXTRAL_LIKE, "aux_free": AUX_FREE}[name]
        train(tiny_config(f"{out}/{name}", nproc=n, layout=Layout(dp_shard=n, ep=2), steps=2, eval_every=2,
                          model=model, model_name="tiny"))


def loaded_logits(root: str, tokens: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``generate.load_decoder``'s model of the newest checkpoint under ``root``: its logits
    of ``tokens`` and each MoE block's balance bias as loaded."""
    from hyper_parallel.platform import get_platform
    from hyper_parallel.train.export import find_checkpoint
    from hyper_parallel.train.generate import load_decoder
    from hyper_parallel.train.moe_model import moe_layers

    p = get_platform()
    loaded = load_decoder(p, *find_checkpoint(root))
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).copy()
    with p.no_grad():
        logits = p.to_numpy(loaded.model.logits(p.from_numpy(tokens), p.from_numpy(positions)))
    return logits, {name: layer.expert_bias.copy() for name, layer in moe_layers(p, loaded.model)}


def _recorded_biases(root: Path) -> dict[str, np.ndarray]:
    from hyper_parallel.train.config import ModelConfig
    from hyper_parallel.train.export import find_checkpoint, moe_biases

    path, manifest = find_checkpoint(root)
    return moe_biases(path, manifest, ModelConfig(**manifest["model"]))


@on_torch
def test_moe_export_generate_and_eval(run_on_ranks, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run_on_ranks(train_moe, str(tmp_path), world_size=4, timeout_s=600)
    tokens = sample_tokens()
    (logits, biases), = run_on_ranks(loaded_logits, str(tmp_path / "mixtral_like" / "checkpoints"), tokens,
                                     world_size=1)
    assert sorted(biases) == ["layers.0.moe", "layers.1.moe"] and not any(np.any(b) for b in biases.values())

    # Mixtral-shaped: exported, and transformers' MixtralForCausalLM computes the job's logits
    out = tmp_path / "mixtral_like" / "export"
    export_ok(tmp_path / "mixtral_like" / "checkpoints", out)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"]) == (["MixtralForCausalLM"], 4, 2, 32), config
    np.testing.assert_allclose(hf_logits(str(out), tokens), logits, rtol=0, atol=LOGITS_ATOL)

    # aux-free: the biases moved and choose the experts; generate/eval load them, export refuses
    root = tmp_path / "aux_free" / "checkpoints"
    recorded = _recorded_biases(root)
    moved = sum(bool(np.any(b)) for b in recorded.values())
    assert moved, recorded
    (_, loaded), = run_on_ranks(loaded_logits, str(root), tokens, world_size=1)
    for name, bias in recorded.items():
        np.testing.assert_array_equal(loaded[name], bias, err_msg=name)
    done = export(str(root), "--format", "hf", "--out", str(tmp_path / "aux_free" / "export"))
    assert done.returncode != 0 and f"aux-free balance biases of {moved} block(s)" in done.stderr \
        and "--moe-balance aux-loss" in done.stderr, done.stderr


@on_mindspore
def test_moe_generate_loads_biases_on_mindspore(run_on_ranks, tmp_path: Path) -> None:
    """An aux-free MoE run on MindSpore (ep 2 x dp-shard 2): ``generate.load_decoder`` gives
    each MoE block the checkpoint's biases, which moved."""
    run_on_ranks(train_moe, str(tmp_path), ("aux_free",), world_size=2, timeout_s=600)
    root = tmp_path / "aux_free" / "checkpoints"
    recorded = _recorded_biases(root)
    assert any(np.any(b) for b in recorded.values()), recorded
    (logits, loaded), = run_on_ranks(loaded_logits, str(root), sample_tokens(), world_size=1)
    assert logits.shape == (2, 64, 256) and np.isfinite(logits).all()
    for name, bias in recorded.items():
        np.testing.assert_array_equal(loaded[name], bias, err_msg=name)


def test_mixtral_refusals() -> None:
    """What Mixtral's format cannot hold, each named with the flag that avoids it."""
    from hyper_parallel.train.export import moe_state
    from hyper_parallel.train.model import parameter_shapes

    cases = [
        (dict(moe_every=2), "--moe-every 2 leaves dense blocks"),
        (dict(moe_shared_experts=1), "--moe-shared-experts 1 (Mixtral has no shared expert"),
        (dict(moe_top_k=1), "--moe-top-k 1 weights each token's expert by its probability"),
    ]
    for change, needle in cases:
        cfg = dataclasses.replace(MIXTRAL_LIKE, **change)
        params = {name: np.zeros(shape, np.float32) for name, shape in parameter_shapes(cfg).items()}
        biases = {f"layers.{i}.moe": np.zeros(cfg.moe_experts, np.float32)
                  for i in range(cfg.n_layers) if cfg.is_moe_block(i)}
        with pytest.raises(ValueError, match="Mixtral format cannot hold") as err:
            moe_state(Path("ckpt"), cfg, params, biases)
        assert needle in str(err.value), (needle, str(err.value))
    params = {name: np.zeros(shape, np.float32) for name, shape in parameter_shapes(MIXTRAL_LIKE).items()}
    config, tensors = moe_state(Path("ckpt"), MIXTRAL_LIKE, params,
                                    {f"layers.{i}.moe": np.zeros(4, np.float32) for i in range(2)})
    assert tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (32, 32)
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 32)
    assert "model.layers.0.mlp.gate_proj.weight" not in tensors and config["model_type"] == "mixtral"
