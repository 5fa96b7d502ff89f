"""Mixture-of-experts blocks in the job's decoder (``train/moe_model.py``, issue 36 item 1):
layout parity with one process on the session's backend, routing and balancing, the
flags' validation, checkpoints and the refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.config import Layout, ModelConfig, TrainConfig
from hyper_parallel.train.export import moe_biases
from hyper_parallel.train.hf_config import model_config, read_hf_config
from hyper_parallel.train.loop import train
from hyper_parallel.train.model import build_model, parameter_shapes
from hyper_parallel.train.model_config import LATER_DEFAULTS, MOE_DEFAULTS, PRESETS
from hyper_parallel.train.moe_model import balance_step, moe_layers, route, sequence_aux_loss
from hyper_parallel.train.records import model_record
from tests.train._moe_ranks import SKEWED_BIAS, check_moe_parity, check_resume_across_expert_parallel_degrees
from tests.train._ranks import losses, tiny_config

TINY = PRESETS["moe-tiny"]


def test_layouts_match_single_process(run_on_ranks, tmp_path: Path) -> None:
    """dp-shard 2 (experts and router fully_shard'ed over the data-parallel ranks) and tp 2
    (attention, the dense block's MLP and the shared expert split, the routed experts
    replicated) with aux-free balancing, dp-shard 2 with the sequence-wise auxiliary loss,
    and expert parallelism (ep 2 over the dp-shard ranks: two whole experts per rank,
    tokens sent by all-to-all) with each balance and with --activation-checkpointing (the
    dispatch and combine run again in the recomputation) and with uneven loads (a bias that
    sends every token to expert 0: one rank receives most rows), against the single process: gradients, losses, gradient norms, routing counts and
    balance biases (tolerances in ``_moe_ranks``), on 2 ranks of the session's backend."""
    cases = [({"dp_shard": 2}, "aux-free"), ({"tp": 2}, "aux-free"), ({"dp_shard": 2}, "aux-loss"),
             ({"dp_shard": 2, "ep": 2}, "aux-free"), ({"dp_shard": 2, "ep": 2}, "aux-loss"),
             ({"dp_shard": 2, "ep": 2}, "aux-free", {"activation_checkpointing": True}),
             ({"dp_shard": 2, "ep": 2}, "aux-free", {"initial_bias": SKEWED_BIAS})]
    results = run_on_ranks(check_moe_parity, str(tmp_path), cases, world_size=2, timeout_s=600)
    for other in results[1:]:  # every rank reports the whole batch's losses and the same biases
        assert other == results[0]


def test_four_rank_layouts_match_single_process(run_on_ranks, tmp_path: Path) -> None:
    """ep 2 over dp-shard 4 (two expert-parallel groups; each rank's two experts
    fully_shard'ed over the other group's rank that holds the same experts), ep 2 x tp 2
    x dp-shard 2 (the expert-parallel groups per tensor-parallel coordinate, the experts
    replicated over tp), dp-shard 2 x cp 2 (ring attention; each rank routes its half of
    every sequence, the counts summed over dp x cp), HSDP (dp-replicate 2 x dp-shard 2) and
    ep 2 x HSDP (the experts' gradients all-reduced over the replicas), ep 2 x dp-shard 2 x
    cp 2 (each expert-parallel group routes its halves of the sequences; the experts
    fully_shard'ed over the cp ranks, which hold the same experts), against the single
    process, as ``test_layouts_match_single_process``."""
    cases = [({"dp_shard": 4, "ep": 2}, "aux-free"), ({"dp_shard": 2, "tp": 2, "ep": 2}, "aux-free"),
             ({"dp_shard": 2, "cp": 2, "cp_mode": "ring"}, "aux-free"), ({"dp_replicate": 2, "dp_shard": 2}, "aux-free"),
             ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, "aux-free"),
             ({"dp_shard": 2, "cp": 2, "cp_mode": "ring", "ep": 2}, "aux-free")]
    results = run_on_ranks(check_moe_parity, str(tmp_path), cases, world_size=4, timeout_s=900)
    for other in results[1:]:
        assert other == results[0]


def test_resume_across_expert_parallel_degrees(run_on_ranks, tmp_path: Path) -> None:
    """A checkpoint of ep 2 resumes in one process (resharded) as one process would have
    continued (``check_resume_across_expert_parallel_degrees``)."""
    results = run_on_ranks(check_resume_across_expert_parallel_degrees, str(tmp_path), world_size=2, timeout_s=600)
    assert results[0] == results[1]


def test_block_structure_and_names() -> None:
    """moe-tiny: block 0 dense, block 1 MoE (``--moe-every 2``); the parameters are the
    declared ones, the experts stacked expert-major."""
    p = get_platform()
    model = build_model(p, TINY, seed=0)
    names = [name for name, _ in p.named_parameters(model)]
    assert names == list(parameter_shapes(TINY))
    assert "layers.0.feed_forward.w1.weight" in names and "layers.1.feed_forward.w1.weight" not in names
    assert parameter_shapes(TINY)["layers.1.moe.experts.w1"] == (4, 32, 32)
    assert parameter_shapes(TINY)["layers.1.moe.shared_expert.w2.weight"] == (32, 32)
    assert [name for name, _ in moe_layers(p, model)] == ["layers.1.moe"]


@pytest.mark.parametrize("renormalize", [True, False])
def test_gates_and_their_router_gradient(renormalize: bool) -> None:
    """``route``'s gates are the chosen probabilities, renormalised to sum to 1 or
    (``moe_norm_topk`` false: Qwen3-MoE's ``norm_topk_prob: false``) as they are, and the
    router logits' gradient of ``sum(gates * c)`` is the analytic one of that function of the
    softmax (``p_k (c_k - sum_j p_j c_j)`` with ``c`` the weights on the chosen experts,
    ``c_k / s - g . c / s`` renormalised, ``s`` the chosen probabilities' sum). 1e-5: the
    framework's fused float32 softmax against numpy's float32 ``exp`` and sum, a few ulps
    apart (MindSpore's measured 1.4e-6 relative)."""
    p = get_platform()
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, 5)).astype(np.float32)
    weights = rng.normal(size=(16, 2)).astype(np.float32)

    def forward(x: Any) -> Any:
        _, chosen, gates = route(p, x, 2, np.zeros(5, np.float32), renormalize)
        forward.chosen = chosen
        return (gates * p.from_numpy(weights)).sum().reshape(1)

    _, backward = p.vjp(forward, [p.from_numpy(logits)])
    (grad,), _ = backward([p.from_numpy(np.ones(1, np.float32))])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = forward.chosen
    picked = np.take_along_axis(probs, chosen, 1)
    total = picked.sum(-1, keepdims=True)
    gates = picked / total if renormalize else picked
    _, _, got = route(p, p.from_numpy(logits), 2, np.zeros(5, np.float32), renormalize)
    np.testing.assert_allclose(p.to_numpy(got), gates, rtol=1e-5)
    # d(sum_j c_j q_j)/dq for the chosen q = p[chosen]: c (as they are) or c / s - (g . c) / s (renormalised)
    dq = weights / total - (gates * weights).sum(-1, keepdims=True) / total if renormalize else weights
    upstream = np.zeros_like(probs)
    np.put_along_axis(upstream, chosen, dq, 1)
    expected = probs * (upstream - (upstream * probs).sum(-1, keepdims=True))  # the softmax's backward
    np.testing.assert_allclose(p.to_numpy(grad), expected, rtol=1e-5, atol=1e-6)


def test_routing_is_dropless_and_the_bias_steers_the_choice() -> None:
    """A router that sends most tokens to expert 0 (uneven loads): every (token, slot) row
    is routed; the gates sum to 1; a bias against expert 0 moves its tokens elsewhere
    without changing the gates' probabilities; one aux-free step lowers expert 0's bias."""
    p = get_platform()
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 4)).astype(np.float32)
    logits[:, 0] += 3.0  # expert 0 is everyone's favourite
    probs, chosen, gates = route(p, p.from_numpy(logits), 2, np.zeros(4, np.float32))
    assert (chosen[:, 0] == 0).mean() > 0.9 and chosen.shape == (64, 2)
    assert (chosen[:, 0] != chosen[:, 1]).all()
    np.testing.assert_allclose(p.to_numpy(gates).sum(-1), 1.0, rtol=1e-6)
    _, steered, steered_gates = route(p, p.from_numpy(logits), 2, np.asarray([-10, 0, 0, 0], np.float32))
    assert not (steered == 0).any()
    chosen_probs = np.take_along_axis(p.to_numpy(probs), steered, 1)
    np.testing.assert_allclose(p.to_numpy(steered_gates), chosen_probs / chosen_probs.sum(-1, keepdims=True),
                               rtol=1e-6)
    model = build_model(p, TINY, seed=0)
    layers = moe_layers(p, model)
    _, layer = layers[0]
    layer.counts.tokens[:] = np.bincount(chosen.reshape(-1), minlength=4)
    layer.counts.rows, layer.counts.forwards = chosen.size, 1
    stats = balance_step(p, layers, None, TINY)
    assert stats.dropped_tokens == 0 and stats.tokens_per_expert_max == int(np.bincount(chosen.reshape(-1)).max())
    assert layer.expert_bias[0] == -np.float32(TINY.moe_bias_rate) and stats.bias_norm > 0
    assert layer.counts.forwards == 0  # reset for the next step


def test_sequence_aux_loss() -> None:
    """``E * sum_e f_e P_e`` per sequence: 1 at perfect balance with uniform probabilities,
    and numpy's value of the formula on uneven routing."""
    p = get_platform()
    uniform = p.from_numpy(np.full((8, 4), 0.25, np.float32))
    balanced = np.asarray([[0, 1], [2, 3], [0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3]], np.int64)
    np.testing.assert_allclose(float(p.to_numpy(sequence_aux_loss(p, uniform, balanced, 2))), 1.0, rtol=1e-6)
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(4), size=8).astype(np.float32)
    chosen = np.argsort(-probs, 1)[:, :2]
    expected = np.mean([4 * (np.bincount(chosen[b * 4:(b + 1) * 4].ravel(), minlength=4) / 8
                             * probs[b * 4:(b + 1) * 4].mean(0)).sum() for b in range(2)])
    np.testing.assert_allclose(float(p.to_numpy(sequence_aux_loss(p, p.from_numpy(probs), chosen, 2))), expected,
                               rtol=1e-6)


def test_resume_continues_bit_identically(tmp_path: Path) -> None:
    """moe-tiny (aux-free) for 4 steps, against 2 steps, a checkpoint, and a resume to 4:
    the resumed steps' losses and routing stats are the uninterrupted run's, bit for bit,
    because the balance biases are checkpointed beside the parameters."""
    whole = train(tiny_config(str(tmp_path / "whole"), model=TINY, model_name="moe-tiny", steps=4))
    first = tiny_config(str(tmp_path / "cut"), model=TINY, model_name="moe-tiny", steps=2)
    train(first)
    resumed = train(first.replace(steps=4, resume=True))
    np.testing.assert_array_equal(losses(resumed), losses(whole)[2:])
    assert [r["moe_bias_norm"] for r in resumed] == [r["moe_bias_norm"] for r in whole[2:]]
    assert [r["moe_tokens_per_expert_max"] for r in resumed] == [r["moe_tokens_per_expert_max"] for r in whole[2:]]


def test_activation_checkpointing_changes_nothing(tmp_path: Path) -> None:
    """moe-tiny (aux-free) with --activation-checkpointing equals the run without it, bit for
    bit: the recomputed MoE block routes the same tokens to the same experts, and its
    second forward is not counted in the routing statistics (nor the balance bias)."""
    plain = tiny_config(str(tmp_path / "plain"), model=TINY, model_name="moe-tiny", steps=3)
    rows = train(plain, write_outputs=False)
    checkpointed = train(plain.replace(activation_checkpointing=True), write_outputs=False)
    np.testing.assert_array_equal(losses(checkpointed), losses(rows))
    for field in ("moe_tokens_per_expert_max", "moe_tokens_per_expert_mean", "moe_bias_norm", "grad_norm"):
        assert [r[field] for r in checkpointed] == [r[field] for r in rows], field


def _args(*flags: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", "--nproc", "1", "--out", "/tmp/unused-moe-run",
                                                       *flags]))


@pytest.mark.parametrize("flags, message", [
    (["--moe-top-k", "3"], "--moe-top-k=3 configure mixture-of-experts blocks, but --moe-experts is 0"),
    (["--model", "moe-tiny", "--moe-top-k", "5"], "--moe-top-k=5 must be in [1, --moe-experts=4]"),
    (["--model", "moe-tiny", "--moe-every", "3"], "--moe-every=3 must be in [1, n_layers=2]"),
    (["--no-moe-norm-topk"], "--moe-norm-topk=False configure mixture-of-experts blocks, but --moe-experts is 0"),
    (["--model", "moe-tiny", "--moe-experts", "1"], "--moe-experts=1 must be 0 (dense) or at least 2"),
    (["--model", "moe-tiny", "--moe-bias-rate", "-1"], "--moe-bias-rate=-1.0 must be a finite number >= 0"),
    (["--model", "moe-tiny", "--cp", "2", "--nproc", "2", "--moe-balance", "aux-loss"],
     "--moe-balance aux-loss cannot be combined with --cp=2"),
    (["--model", "moe-tiny", "--activation-checkpointing", "--moe-balance", "aux-loss"],
     "--moe-balance aux-loss cannot be combined with --activation-checkpointing yet"),
    (["--ep", "2", "--dp-shard", "2", "--nproc", "2"], "--ep=2 shards the routed experts of a mixture-of-experts "
                                                       "model, but --model small is dense"),
    (["--model", "moe-tiny", "--ep", "3", "--dp-shard", "3", "--nproc", "3"], "--ep=3 must divide --moe-experts=4"),
    (["--model", "moe-tiny", "--ep", "4", "--dp-shard", "2", "--nproc", "2"], "--ep=4 must divide --dp-shard=2"),
    (["--model", "moe-tiny", "--ep", "0"], "--ep=0 must be a positive integer"),
    (["--model", "moe-tiny", "--moe-hidden-dim", "36", "--tp", "8", "--nproc", "8", "--n-heads", "8",
      "--n-kv-heads", "8"], "--tp=8 must divide the shared experts' width 36"),
])
def test_bad_flags_are_refused_before_any_rank(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        _args(*flags)
    assert message in str(err.value)


def test_flags_build_the_model() -> None:
    cfg = _args("--moe-experts", "8", "--moe-top-k", "1", "--moe-shared-experts", "2", "--moe-every", "2",
                "--moe-balance", "aux-loss", "--model", "tiny")
    m = cfg.model
    assert (m.moe_experts, m.moe_top_k, m.moe_shared_experts, m.moe_every, m.moe_balance) == (8, 1, 2, 2, "aux-loss")
    assert [m.is_moe_block(i) for i in range(m.n_layers)] == [False, True]
    assert m.moe_norm_topk and not _args("--model", "moe-tiny", "--no-moe-norm-topk").model.moe_norm_topk


def test_dense_checkpoint_record_is_unchanged() -> None:
    """A dense model's record has no MoE field (old dense checkpoints still resume); an
    MoE model's has them all, so a resume with other MoE settings is refused, except the
    fields added later (``LATER_DEFAULTS``), which a record has only away from their
    default (so the checkpoints written before them still resume)."""
    dense = TrainConfig(platform="torch", nproc=1, layout=Layout(), model=PRESETS["tiny"])
    assert not (set(MOE_DEFAULTS) | set(LATER_DEFAULTS)) & set(model_record(dense))
    moe = dense.replace(model=TINY)
    record = model_record(moe)
    assert not set(LATER_DEFAULTS) & set(record)
    assert {key: record.get(key, LATER_DEFAULTS.get(key)) for key in MOE_DEFAULTS} == \
        {key: getattr(TINY, key) for key in MOE_DEFAULTS}
    assert ModelConfig(**record) == TINY
    later = dataclasses.replace(TINY, moe_norm_topk=False, qk_norm=True, explicit_head_dim=8)
    record = model_record(moe.replace(model=later))
    assert (record["moe_norm_topk"], record["qk_norm"], record["explicit_head_dim"]) == (False, True, 8)
    assert ModelConfig(**record) == later


def test_moe_checkpoint_without_biases_and_hf_moe_config_refused(tmp_path: Path) -> None:
    manifest = {"model": dataclasses.asdict(TINY), "tensors": {}}
    # export, generate and eval read MoE checkpoints (test_moe_export.py), with their balance biases
    with pytest.raises(ValueError, match="holds a mixture-of-experts decoder without its balance biases"):
        moe_biases(tmp_path, manifest, TINY)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2, '
                      '"num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512, "num_experts": 8}')
    # refused where the sizes are derived (test_hf_moe.py: what maps to the job's decoder, what not)
    with pytest.raises(ValueError, match=r"a mixture-of-experts model of type 'qwen2_moe'.*sigmoid gate"):
        model_config(read_hf_config(str(config)), 64)
