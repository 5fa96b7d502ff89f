"""``hyper-parallel train --hf-config`` of a mixture-of-experts model (``train/hf_moe.py``): a
Mixtral ``config.json`` trains as the job's own MoE decoder on both frameworks (``--ep 2``
on 2 ranks against one process), and the configurations that decoder does not compute
exactly are refused by name, before any rank starts.

Tolerances: ``_moe_ranks``' (``LOSS_RTOL``, ``GRAD_*``), reasoned there: the layouts' float32
sums in other orders, and routing counts compared exactly.
"""

from __future__ import annotations

import json
import os
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


def write_config(folder: Path, base: dict[str, Any] | None = None, **changes: Any) -> str:
    """``folder/config.json`` of ``base`` (``TINY_MIXTRAL``) with ``changes``; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**(base or TINY_MIXTRAL), **changes}))
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
    # heads wider than hidden_size / num_attention_heads (4): the job's explicit_head_dim
    mod = tiny_config(str(tmp_path / "wide_run"), hf_config=write_config(tmp_path / "wide", head_dim=8)).model
    assert (mod.explicit_head_dim, mod.head_dim, mod.qk_norm) == (8, 8, False)


@pytest.mark.parametrize("changes, needles", [
    (dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64),
     ["type 'qwen2_moe'", "shared expert is scaled by a sigmoid gate"]),
    (dict(model_type="deepseek_v3", n_routed_experts=4), ["type 'deepseek_v3'", "latent attention"]),
    (dict(model_type="granitemoe"), ["type 'granitemoe'", "only Mixtral (model_type mixtral) and Qwen3-MoE"]),
    (dict(sliding_window=4096), ["sliding_window=4096", "full causal", "\"sliding_window\": null"]),
    (dict(num_experts_per_tok=1), ["num_experts_per_tok=1", "top-1 gate is renormalised to 1"]),
    (dict(output_router_logits=True), ["output_router_logits=true", "--moe-balance none"]),
    (dict(router_jitter_noise=0.1), ["router_jitter_noise=0.1", "set it to 0.0"]),
    (dict(attention_bias=True), ["attention_bias=true"]),
    (dict(head_dim=5), ["head_dim=5", "an even number of features", "give an even head_dim"]),
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


def test_moe_balance_flags_with_an_moe_hf_config(tmp_path: Path) -> None:
    """``--moe-balance``, ``--moe-aux-loss-coef`` and ``--moe-bias-rate`` set how an MoE
    ``--hf-config`` is balanced (``TrainConfig.hf_balance``); its shapes stay the
    configuration's, and a dense configuration refuses them."""
    from hyper_parallel.train.cli import build_parser, config_from_args

    path = write_config(tmp_path / "mixtral")

    def parse(*flags: str):
        return config_from_args(build_parser().parse_args(["train", "--platform", "mindspore", "--hf-config", path,
                                                           "--dp-shard", "2", "--out", str(tmp_path / "run"),
                                                           *flags]))

    mod = parse("--moe-balance", "aux-loss", "--moe-aux-loss-coef", "0.05").model
    assert (mod.moe_balance, mod.moe_aux_loss_coef, mod.moe_experts, mod.dim) == ("aux-loss", 0.05, 4, 32)
    mod = parse("--moe-balance", "aux-free", "--moe-bias-rate", "0.01").model
    assert (mod.moe_balance, mod.moe_bias_rate) == ("aux-free", 0.01)
    assert parse().model.moe_balance == "none"  # transformers' training: the cross-entropy alone
    with pytest.raises(ValueError, match="--moe-\\* sizes"):
        parse("--moe-experts", "8")
    dense = write_config(tmp_path / "llama", {k: v for k, v in TINY_MIXTRAL.items()
                                              if k not in ("num_local_experts", "num_experts_per_tok")},
                         model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="--moe-balance choose how a mixture of experts is balanced, but --hf-config "
                                         ".* is a dense llama model: drop --moe-balance"):
        tiny_config(str(tmp_path / "run"), hf_config=dense, hf_balance=(("moe_balance", "aux-loss"),))
    with pytest.raises(ValueError, match="without --hf-config set them on model"):
        tiny_config(str(tmp_path / "run"), hf_balance=(("moe_balance", "aux-loss"),))


@pytest.mark.parametrize("balance", ["none", "aux-free"])
def test_mixtral_trains_with_expert_parallelism(run_on_ranks, tmp_path: Path, balance: str) -> None:
    """``--hf-config`` Mixtral on dp-shard 2 x ep 2 against one process: first-step gradients,
    losses, gradient norms, routing counts and balance biases
    (``_moe_ranks.check_hf_moe_parity``); as mapped (``none``) and with ``--moe-balance
    aux-free``."""
    from tests.train._moe_ranks import check_hf_moe_parity

    hf_config = write_config(tmp_path / "mixtral")
    hf_balance = () if balance == "none" else (("moe_balance", balance),)
    curves = run_on_ranks(check_hf_moe_parity, str(tmp_path), hf_config, {"dp_shard": 2, "ep": 2}, hf_balance,
                          world_size=2, timeout_s=600)
    assert curves[0] == curves[1] and len(curves[0]) == 4


def write_weights(folder: Path, seed: int = 5) -> dict[str, Any]:
    """A Mixtral folder of ``TINY_MIXTRAL`` with random weights written by ``safetensors.numpy``
    (no torch), as ``export.moe_state`` names them, in two shards listed by
    ``model.safetensors.index.json``: the experts in bfloat16 (written as their 16 bits:
    numpy has no bfloat16), the rest in float32. Returns the job's whole parameters the
    files hold (``{name: float32}``; the experts rounded to bfloat16)."""
    import numpy as np
    from safetensors.numpy import save_file

    from hyper_parallel.train.export import moe_state
    from hyper_parallel.train.hf_moe import moe_model_config
    from hyper_parallel.train.model import parameter_shapes

    cfg = moe_model_config(TINY_MIXTRAL, folder / "config.json", 32)
    rng = np.random.default_rng(seed)
    # a trained model's scale (std 0.05, norms 1), so that a run from them is well conditioned
    params = {name: np.ones(shape, np.float32) if name.endswith("norm.weight")
              else (0.05 * rng.standard_normal(shape)).astype(np.float32)
              for name, shape in parameter_shapes(cfg).items()}
    for name in params:  # bfloat16 values: the float32 bits with the low half zero
        if ".experts." in name:
            params[name] = (params[name].view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    _, tensors = moe_state(folder, cfg, params, {f"layers.{i}.moe": np.zeros(4, np.float32) for i in range(2)})
    write_config(folder)
    experts = {k: v for k, v in tensors.items() if ".experts." in k}
    save_file({k: v for k, v in tensors.items() if k not in experts}, str(folder / "dense.safetensors"))
    header, data, offset = {}, [], 0
    for name, value in experts.items():
        bits = (np.ascontiguousarray(value).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [offset, offset + len(bits)]}
        data.append(bits)
        offset += len(bits)
    raw = json.dumps(header).encode()
    (folder / "experts.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(data))
    weight_map = {name: "experts.safetensors" if name in experts else "dense.safetensors" for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return params


def test_weights_are_each_ranks_pieces(run_on_ranks, tmp_path: Path) -> None:
    """A folder with weights: every rank's piece of every parameter is that box of the
    file's tensor (``hf_weights``: read box by box, the experts per expert), bit for bit, on
    dp-shard 2 with and without ep 2, built on the meta device and on the host."""
    from tests.train._moe_ranks import check_pretrained_pieces

    params = write_weights(tmp_path / "mixtral")
    counts = run_on_ranks(check_pretrained_pieces, str(tmp_path), str(tmp_path / "mixtral"), params,
                          [{"dp_shard": 2, "ep": 2}, {"dp_shard": 2}], world_size=2, timeout_s=600)
    assert min(counts) == 2 * 2 * len(params)


def test_weights_that_do_not_match_are_refused(tmp_path: Path) -> None:
    """Before any rank starts: a missing or reshaped tensor, one without a place, and a
    folder with torch pickles only, each named."""
    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path / "mixtral"
    write_weights(folder)
    dense = folder / "dense.safetensors"
    from safetensors.numpy import load_file

    tensors = load_file(str(dense))
    cases = [
        ({k: v for k, v in tensors.items() if k != "model.norm.weight"}, "model.norm.weight (32,) is missing"),
        ({**tensors, "model.norm.weight": np.ones(16, np.float32)}, "model.norm.weight has shape (16,)"),
        ({**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(4, np.float32)},
         "model.layers.0.self_attn.q_norm.weight has no place"),
    ]
    for changed, needle in cases:
        save_file(changed, str(dense))
        with pytest.raises(ValueError, match="the weights are not the Mixtral its config.json describes") as err:
            tiny_config(str(tmp_path / "run"), hf_config=str(folder), platform="mindspore")
        assert needle in str(err.value), (needle, str(err.value))
    pickles = tmp_path / "pickles"
    write_config(pickles)
    (pickles / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin, which the job's MoE decoder does not read"):
        tiny_config(str(tmp_path / "run"), hf_config=str(pickles), platform="mindspore")


def _job_logits_and_loss(folder: str, tokens: Any, without_qk_norm: bool = False) -> tuple[Any, float]:
    """The job's decoder loaded from ``folder`` through ``--hf-config`` (one process): its
    logits ``[batch, seq, vocab]`` of ``tokens`` at positions ``0 .. seq - 1`` and its loss
    with the next token as target (the last position's target: token 0). ``without_qk_norm``:
    a mutation, every block's attention skips its per-head query/key norms."""
    import numpy as np

    from hyper_parallel.platform import get_platform
    from hyper_parallel.train.loop import setup

    p = get_platform()
    run = setup(tiny_config(f"{folder}_run", hf_config=folder), reference=True)
    if without_qk_norm:
        for block in run.model.layers:
            block.attention.qk_norm = False
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).copy()
    targets = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], 1)
    with p.no_grad():
        logits = p.to_numpy(run.model.logits(p.from_numpy(tokens), p.from_numpy(positions)))
        loss = float(p.to_numpy(run.model(p.from_numpy(tokens), p.from_numpy(positions), p.from_numpy(targets))))
    return logits, loss


@pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                    reason="transformers' MixtralForCausalLM is a torch module")
def test_transformers_mixtral_loads_as_the_job_decoder(tmp_path: Path) -> None:
    """A ``MixtralForCausalLM`` saved by ``save_pretrained`` and loaded through ``--hf-config``:
    the job's decoder computes transformers' logits and loss on the same tokens. The same
    folder with each expert's ``w1`` and ``w3`` swapped does not: the comparison sees the
    gate/up order.

    Tolerance ``LOGITS_ATOL`` (1e-5, ``test_export.py``): the job's rotary tables are computed
    in float64 and rounded, transformers' in float32, a few ulps apart in angle; the experts'
    sums run in another order (one grouped GEMM per expert group against one matmul per
    expert)."""
    pytest.importorskip("transformers")
    import numpy as np
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    from tests.train.test_export import LOGITS_ATOL, sample_tokens

    values = {k: v for k, v in TINY_MIXTRAL.items() if k not in ("architectures", "model_type", "head_dim")}
    torch.manual_seed(7)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**values)).eval()
    with torch.no_grad():  # a router far from uniform, so that the top-k choice matters
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    folder = tmp_path / "mixtral"
    hf.save_pretrained(folder)
    tokens = sample_tokens()
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(tokens), labels=torch.from_numpy(tokens))
    logits, loss = _job_logits_and_loss(str(folder), tokens)
    np.testing.assert_allclose(logits, out.logits.numpy(), rtol=0, atol=LOGITS_ATOL)
    # transformers' loss shifts inside (the last position has no target): the same
    # cross-entropy as over the job's logits without their last position
    job = torch.nn.functional.cross_entropy(torch.from_numpy(logits[:, :-1]).flatten(0, 1),
                                            torch.from_numpy(tokens[:, 1:]).flatten())
    # 1e-5: the logits agree to LOGITS_ATOL, and a mean cross-entropy of such logits to that order
    assert float(job) == pytest.approx(float(out.loss), rel=1e-5)
    # the job's own loss (every position, the last one's target 0) against transformers' logits
    targets = torch.from_numpy(np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], 1))
    ref = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    assert loss == pytest.approx(float(ref), rel=1e-5)

    swapped = tmp_path / "swapped"
    swapped.mkdir()
    (swapped / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({name.replace(".w1.", ".w3.") if ".w1." in name else name.replace(".w3.", ".w1.") if ".w3." in name
               else name: value for name, value in tensors.items()}, str(swapped / "model.safetensors"))
    wrong, _ = _job_logits_and_loss(str(swapped), tokens)
    assert np.abs(wrong - out.logits.numpy()).max() > 100 * LOGITS_ATOL


@pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                    reason="transformers reads the export; MindSpore runs pipelines on CPU only through its launcher")
def test_pretrained_mixtral_pipelines_and_exports(run_on_ranks, tmp_path: Path) -> None:
    """A saved ``MixtralForCausalLM`` trained through ``--hf-config`` on pp 2 x dp-shard 2 x
    ep 2 with ``--ep-overlap`` against one process (``_moe_ranks.check_hf_moe_run``); its
    checkpoint (the job's decoder's record) exports as ``MixtralForCausalLM`` again, whose
    logits are the job's (``LOGITS_ATOL``, as ``test_moe_export.py``)."""
    pytest.importorskip("transformers")
    import numpy as np
    import torch
    import transformers

    from tests.train._moe_ranks import check_hf_moe_run
    from tests.train.test_export import LOGITS_ATOL, export_ok, hf_logits, sample_tokens
    from tests.train.test_moe_export import loaded_logits

    values = {k: v for k, v in TINY_MIXTRAL.items() if k not in ("architectures", "model_type", "head_dim")}
    torch.manual_seed(3)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**values)).save_pretrained(tmp_path / "mixtral")
    degrees = {"pp": 2, "dp_shard": 2, "ep": 2, "microbatches": 2, "ep_overlap": True}
    curves = run_on_ranks(check_hf_moe_run, str(tmp_path), str(tmp_path / "mixtral"), degrees, world_size=4,
                          timeout_s=600)
    assert all(curve == curves[0] for curve in curves)
    root = tmp_path / "hf_moe_run" / "checkpoints"
    export_ok(root, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["router_aux_loss_coef"]) == ("mixtral", 4, 0.02)
    tokens = sample_tokens()
    (logits, _), = run_on_ranks(loaded_logits, str(root), tokens, world_size=1)
    np.testing.assert_allclose(hf_logits(str(tmp_path / "export"), tokens), logits, rtol=0, atol=LOGITS_ATOL)


def test_mixtral_through_the_command_line(run_on_ranks, tmp_path: Path) -> None:
    """The real entry point: ``hyper-parallel train --hf-config FOLDER --dp-shard 2 --ep 2``
    on the framework's launcher, from the folder's weights (``write_weights``: no torch in
    them), against the single process on the same config (losses and validation losses,
    2e-5 relative as ``test_train.test_command_line_run``); dropless routing."""
    import numpy as np

    from hyper_parallel.testing.rendezvous import selected_platform
    from hyper_parallel.train.cli import build_parser, config_from_args
    from tests.train._cli import run_cli
    from tests.train._ranks import TEST_DATA, reference_losses

    folder, out = tmp_path / "mixtral", tmp_path / "run"
    write_weights(folder)
    args = ["train", "--platform", selected_platform(), "--hf-config", str(folder), "--dp-shard", "2", "--ep", "2",
            "--steps", "3", "--seq-len", "32", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2",
            "--eval-every", "3", "--checkpoint-every", "3", "--out", str(out), "--no-progress", "--data", *TEST_DATA]
    done = run_cli(args, tmp_path)
    assert "done: step 3" in done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["moe_dropped_tokens"] for row in rows] == [0, 0, 0], rows
    cfg = config_from_args(build_parser().parse_args(args))
    ref = run_on_ranks(reference_losses, cfg.to_dict(), world_size=1, timeout_s=300)[0]
    # 2e-5: fully_shard's reduce-scatters and the experts' all-to-alls sum the gradients in
    # another float32 order than one process; over 3 steps at lr 1e-2 the losses move ~1e-6
    np.testing.assert_allclose([row["loss"] for row in rows], ref[0], rtol=2e-5, atol=0)
    np.testing.assert_allclose([row["val_loss"] for row in rows if "val_loss" in row], ref[1], rtol=2e-5, atol=0)


# Qwen3-MoE ([Note: Qwen3-MoE as the job's MoE decoder] in hf_moe.py)

#: A tiny Qwen3-MoE as ``transformers.Qwen3MoeConfig(...).save_pretrained`` writes it (experts
#: as ``num_local_experts``): heads 16 wide where hidden_size / heads is 8 (``head_dim``), a
#: dense block 0 (48 wide) and an MoE block 1 (``decoder_sparse_step`` 2, experts 24 wide), the
#: gates not renormalised (``norm_topk_prob`` false, transformers' default).
TINY_QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 32,
    "intermediate_size": 48, "moe_intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
    "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "use_sliding_window": False, "sliding_window": None, "output_router_logits": False, "router_aux_loss_coef": 0.02,
    "hidden_act": "silu", "attention_dropout": 0.0, "attention_bias": False, "tie_word_embeddings": False,
    "initializer_range": 0.02,
}


def test_qwen3_moe_maps_to_the_job_moe_decoder(tmp_path: Path) -> None:
    """The job's MoE decoder of Qwen3-MoE's sizes, on either framework, with ``--ep``: per-head
    query/key norms, the explicit head width, the dense and MoE blocks' widths, the gates
    as ``norm_topk_prob`` says; ``mlp_only_layers`` naming only blocks the step leaves dense."""
    for platform in ("torch", "mindspore"):
        cfg = tiny_config(str(tmp_path / platform), nproc=2, layout=Layout(dp_shard=2, ep=2), platform=platform,
                          hf_config=write_config(tmp_path / "qwen3", TINY_QWEN3_MOE))
        mod = cfg.model
        assert (mod.dim, mod.n_heads, mod.n_kv_heads, mod.head_dim, mod.explicit_head_dim, mod.qk_norm) == \
            (32, 4, 2, 16, 16, True)
        assert (mod.hidden_dim, mod.expert_hidden_dim, mod.moe_experts, mod.moe_top_k, mod.moe_norm_topk,
                mod.moe_every, mod.moe_shared_experts, mod.moe_balance, mod.norm_eps) == \
            (48, 24, 4, 2, False, 2, 0, "none", 1e-6)
        assert [mod.is_moe_block(i) for i in range(2)] == [False, True]
        assert not cfg.hf_module and cfg.model_name == "hf:qwen3_moe"
    # the hub's spelling (num_experts), renormalised gates, every block MoE, a redundant mlp_only_layers
    hub = {k: v for k, v in TINY_QWEN3_MOE.items() if k != "num_local_experts"}
    mod = tiny_config(str(tmp_path / "hub_run"), hf_config=write_config(
        tmp_path / "hub", hub, num_experts=4, norm_topk_prob=True, decoder_sparse_step=1, head_dim=8)).model
    assert (mod.moe_experts, mod.moe_norm_topk, mod.moe_every, mod.explicit_head_dim, mod.head_dim) == \
        (4, True, 1, 0, 8)
    mod = tiny_config(str(tmp_path / "step_run"), hf_config=write_config(
        tmp_path / "step", TINY_QWEN3_MOE, mlp_only_layers=[0])).model
    assert mod.moe_every == 2
    # top-1 without renormalisation is the job's top-1 (the gate is the probability)
    mod = tiny_config(str(tmp_path / "top1_run"), hf_config=write_config(
        tmp_path / "top1", TINY_QWEN3_MOE, num_experts_per_tok=1)).model
    assert (mod.moe_top_k, mod.moe_norm_topk) == (1, False)


@pytest.mark.parametrize("changes, needles", [
    (dict(num_experts_per_tok=1, norm_topk_prob=True), ["num_experts_per_tok=1", "norm_topk_prob=true",
                                                         "renormalised to 1"]),
    (dict(mlp_only_layers=[1]), ["mlp_only_layers=[1]", "blocks [1] dense", "decoder_sparse_step=2",
                                 "\"mlp_only_layers\": []"]),
    (dict(decoder_sparse_step=3), ["decoder_sparse_step=3", "num_hidden_layers=2", "model_type qwen3"]),
    (dict(use_sliding_window=True, sliding_window=16), ["use_sliding_window=true with sliding_window=16",
                                                        "\"use_sliding_window\": false"]),
    (dict(output_router_logits=True), ["output_router_logits=true", "--moe-balance none"]),
    (dict(attention_bias=True), ["attention_bias=true"]),
    (dict(head_dim=7), ["head_dim=7", "even"]),
])
def test_qwen3_moe_configs_that_do_not_map_are_refused(tmp_path: Path, changes: dict, needles: list[str]) -> None:
    """What in a Qwen3-MoE the job's decoder does not compute: named with its value, the rule
    and the fix, in the launching process, on either framework."""
    path = write_config(tmp_path / "qwen3", TINY_QWEN3_MOE, **changes)
    for platform in ("torch", "mindspore"):
        with pytest.raises(ValueError, match="this Qwen3-MoE configuration is not one") as err:
            tiny_config(str(tmp_path / "run"), hf_config=path, platform=platform)
        for needle in needles:
            assert needle in str(err.value), (needle, str(err.value))


def test_qwen3_moe_trains_with_expert_and_tensor_parallelism(run_on_ranks, tmp_path: Path) -> None:
    """``--hf-config`` Qwen3-MoE against one process: dp-shard 2 x ep 2, tp 2 (each rank
    norms its own heads with the replicated q_norm/k_norm, whose gradients are all-reduced
    over tp: [Note: per-head query/key norms]) and cp 2 (ring attention: the norms per token);
    first-step gradients of every piece (the norms' included), losses, gradient norms and
    routing counts (``check_hf_moe_parity``)."""
    from tests.train._moe_ranks import check_hf_moe_parity

    hf_config = write_config(tmp_path / "qwen3", TINY_QWEN3_MOE)
    for degrees in ({"dp_shard": 2, "ep": 2}, {"tp": 2}, {"cp": 2, "cp_mode": "ring"}):
        tag = "_".join(f"{k}{v}" for k, v in degrees.items())
        curves = run_on_ranks(check_hf_moe_parity, str(tmp_path / tag), hf_config, degrees, world_size=2,
                              timeout_s=600)
        assert curves[0] == curves[1] and len(curves[0]) == 4


def _saved_qwen3_moe(folder: Path, seed: int, **changes: Any) -> Any:
    """A ``Qwen3MoeForCausalLM`` of ``TINY_QWEN3_MOE`` with ``changes``, saved to ``folder``
    by ``save_pretrained``, its norms (the per-head ones included) away from 1 and its
    routers far from uniform, so that each one's place and the top-k choice matter."""
    import torch
    import transformers

    values = {k: v for k, v in {**TINY_QWEN3_MOE, **changes}.items() if k not in ("architectures", "model_type")}
    values["num_experts"] = values.pop("num_local_experts")
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**values)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    hf.save_pretrained(folder)
    return hf


@pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                    reason="transformers' Qwen3MoeForCausalLM is a torch module")
@pytest.mark.parametrize("changes", [{}, dict(norm_topk_prob=True, decoder_sparse_step=1)])
def test_transformers_qwen3_moe_loads_as_the_job_decoder(tmp_path: Path, changes: dict) -> None:
    """A ``Qwen3MoeForCausalLM`` saved by ``save_pretrained`` and loaded through ``--hf-config``
    (gates as they are with a dense block, and renormalised with every block MoE): the job's
    decoder computes transformers' logits and loss. Mutations it must see: the job's
    decoder without its per-head norms (``qk_norm`` off), the files' ``q_norm`` and ``k_norm``
    swapped, and the other ``norm_topk_prob``.

    Tolerance ``LOGITS_ATOL`` (1e-5), as the Mixtral test: float64-computed rotary tables
    against transformers' float32 ones, and the experts' sums in another order."""
    pytest.importorskip("transformers")
    import numpy as np
    import torch
    from safetensors.numpy import load_file, save_file

    from tests.train.test_export import LOGITS_ATOL, sample_tokens

    folder = tmp_path / "qwen3"
    hf = _saved_qwen3_moe(folder, 7, **changes)
    tokens = sample_tokens()
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(tokens), labels=torch.from_numpy(tokens))
    expected = out.logits.numpy()
    logits, _ = _job_logits_and_loss(str(folder), tokens)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGITS_ATOL)
    job = torch.nn.functional.cross_entropy(torch.from_numpy(logits[:, :-1]).flatten(0, 1),
                                            torch.from_numpy(tokens[:, 1:]).flatten())
    # 1e-5: the logits agree to LOGITS_ATOL, and a mean cross-entropy of such logits to that order
    assert float(job) == pytest.approx(float(out.loss), rel=1e-5)

    def far(got: Any) -> bool:
        return float(np.abs(got - expected).max()) > 100 * LOGITS_ATOL

    no_norms, _ = _job_logits_and_loss(str(folder), tokens, without_qk_norm=True)
    assert far(no_norms), "the comparison does not see the per-head query/key norms"
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    (swapped / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({name.replace("q_norm", "k_norm") if "q_norm" in name else name.replace("k_norm", "q_norm")
               if "k_norm" in name else name: value for name, value in tensors.items()},
              str(swapped / "model.safetensors"))
    assert far(_job_logits_and_loss(str(swapped), tokens)[0]), "the comparison does not see q_norm against k_norm"
    flipped = tmp_path / "flipped"
    flipped.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (flipped / "config.json").write_text(json.dumps({**config, "norm_topk_prob": not config["norm_topk_prob"]}))
    (flipped / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    assert far(_job_logits_and_loss(str(flipped), tokens)[0]), "the comparison does not see norm_topk_prob"


@pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                    reason="transformers reads the export; MindSpore runs pipelines on CPU only through its launcher")
def test_pretrained_qwen3_moe_pipelines_and_exports(run_on_ranks, tmp_path: Path) -> None:
    """A saved ``Qwen3MoeForCausalLM`` trained through ``--hf-config`` on pp 2 (its dense and
    its MoE block on different stages) and on tp 2 x fully_shard, each against one process
    (``check_hf_moe_run``); the tp run's checkpoint (the replicated per-head norms among
    tp-sharded projections) exports as ``Qwen3MoeForCausalLM`` again (``export.moe_state``),
    whose logits are the job's (``LOGITS_ATOL``)."""
    pytest.importorskip("transformers")
    import numpy as np

    from tests.train._moe_ranks import check_hf_moe_run
    from tests.train.test_export import LOGITS_ATOL, export_ok, hf_logits, sample_tokens
    from tests.train.test_moe_export import loaded_logits

    _saved_qwen3_moe(tmp_path / "qwen3", 3)
    for tag, degrees, world in (("pp", {"pp": 2, "microbatches": 2}, 2), ("tp", {"tp": 2, "dp_shard": 2}, 4)):
        curves = run_on_ranks(check_hf_moe_run, str(tmp_path / tag), str(tmp_path / "qwen3"), degrees,
                              world_size=world, timeout_s=600)
        assert all(curve == curves[0] for curve in curves)
    root = tmp_path / "tp" / "hf_moe_run" / "checkpoints"
    export_ok(root, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["head_dim"], config["norm_topk_prob"],
            config["decoder_sparse_step"], config["moe_intermediate_size"], config["intermediate_size"]) == \
        ("qwen3_moe", 4, 16, False, 2, 24, 48)
    tokens = sample_tokens()
    (logits, _), = run_on_ranks(loaded_logits, str(root), tokens, world_size=1)
    np.testing.assert_allclose(hf_logits(str(tmp_path / "export"), tokens), logits, rtol=0, atol=LOGITS_ATOL)
