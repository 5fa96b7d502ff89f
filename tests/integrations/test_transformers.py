"""Hugging Face models, unmodified, under ``hyper_parallel.integrations.transformers``:
tiny random-init Llama, Qwen2 and Mistral (no downloads) trained with torch's AdamW
under fully_shard, TP x fully_shard, ring CP (load balanced, packed documents) x
fully_shard and Ulysses x TP, against the same model in one process.

Tolerance: HF's causal-LM loss casts the logits to float32 (``ForCausalLMLoss``), so
losses and gradients carry float32 rounding even in a float64 model: rtol 1e-5 on
losses and parameters, far below what a lost target, a wrong mask or a wrong normalization
gives (>= 1e-2 here).
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import numpy as np
import pytest

from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.platform import get_platform

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="transformers models are torch modules (the integration is torch-only)")
TOL = dict(rtol=1e-5, atol=1e-7)
VOCAB, SEQ, ROWS = 97, 16, 2  # ROWS per data-parallel rank
DOCS = [0, 5, 12, 16]  # packed documents of the context-parallel cases
#: name -> (mesh shape, axis names, cp_mode, load_balance, packed documents, activation checkpointing)
LAYOUTS = {
    "fsdp4": ((4,), ("dp_shard",), "ring", True, False, False),
    "tp2_fsdp2": ((2, 2), ("dp_shard", "tp"), "ring", True, False, False),
    "ring2_fsdp2": ((2, 2), ("dp_shard", "cp"), "ring", True, True, False),
    "ulysses2_tp2": ((2, 2), ("cp", "tp"), "ulysses", False, False, False),
}
EXTRA = {  # llama only: the other exchanges, HSDP and activation checkpointing
    "allgather4": ((4,), ("cp",), "allgather", True, True, False),
    "hsdp_ring2_ac": ((2, 1, 2), ("dp_replicate", "dp_shard", "cp"), "ring", True, False, True),
}


def _config(arch: str) -> Any:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig}[arch](**common)


def _model(arch: str, impl: str) -> Any:
    import torch
    import transformers

    from hyper_parallel.integrations.transformers import register_attention

    register_attention()
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}[arch]
    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(_config(arch)), attn_implementation=impl, dtype=torch.float64)


def _batch(step: int, rows: int, packed: bool) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(step)
    ids = torch.from_numpy(rng.integers(0, VOCAB, (rows, SEQ)))
    labels = ids.clone()
    labels[0, :3] = -100  # uneven target counts across the data-parallel ranks
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = torch.from_numpy(np.concatenate([np.arange(b - a) for a, b in zip(DOCS, DOCS[1:])])
                                                 ).unsqueeze(0)
    return batch


def check_layout(arch: str, layout: tuple) -> None:
    import torch

    from hyper_parallel.integrations.transformers import parallelize

    shape, names, cp_mode, load_balance, packed, ac = layout
    p = get_platform()
    mesh = init_device_mesh(p.device_type, shape, mesh_dim_names=names)
    sizes = dict(zip(names, shape))
    dp = sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)
    dp_index = ((mesh.get_local_rank("dp_replicate") if "dp_replicate" in names else 0) * sizes.get("dp_shard", 1)
                + (mesh.get_local_rank("dp_shard") if "dp_shard" in names else 0))
    ref = _model(arch, "hyper_parallel")  # one process, whole batch; the same fused kernel
    model = parallelize(_model(arch, "hyper_parallel"), mesh, cp_mode=cp_mode, load_balance=load_balance,
                        activation_checkpointing=ac)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(p, ref, ref_opt, model, opt, mesh, dp, dp_index, packed, load_balance, arch)
    # fully_shard's root unit returns a CausalLMOutputWithPast and takes token ids: no backward-hook warning
    hooks = [str(w.message) for w in caught if "hook" in str(w.message).lower()]
    assert not hooks, hooks
    for (name, param), (_, expected) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.to_numpy(param.full_tensor().detach()), p.to_numpy(expected.detach()), **TOL,
                                   err_msg=f"{arch}: {name} after 3 AdamW steps")


def _steps(p: Any, ref: Any, ref_opt: Any, model: Any, opt: Any, mesh: Any, dp: int, dp_index: int, packed: bool,
           load_balance: bool, arch: str) -> None:
    from hyper_parallel.integrations.transformers import shard_batch

    for step in range(3):
        full = _batch(step, ROWS * dp, packed)
        want = ref(**full).loss
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = {k: (v[dp_index * ROWS:(dp_index + 1) * ROWS] if k != "position_ids" else v) for k, v in full.items()}
        loss = model(**shard_batch(mine, mesh, load_balance=load_balance)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        # the mean of the ranks' losses is the global loss (see shard_batch)
        got = float(p.to_numpy(p.all_reduce(loss.detach().reshape(1), "sum").wait())[0]) / p.world_size()
        np.testing.assert_allclose(got, float(want), **TOL, err_msg=f"{arch}: loss at step {step}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_training_matches_one_process(run_on_ranks, arch: str, layout: str) -> None:
    pytest.importorskip("transformers")
    run_on_ranks(check_layout, arch, LAYOUTS[layout], world_size=4, timeout_s=300)


@pytest.mark.parametrize("layout", list(EXTRA))
def test_training_other_layouts(run_on_ranks, layout: str) -> None:
    pytest.importorskip("transformers")
    run_on_ranks(check_layout, "llama", EXTRA[layout], world_size=4, timeout_s=300)


# -- one process: the attention function against HF's own ------------------------------
def test_attention_matches_hf_sdpa_and_a_dense_document_mask() -> None:
    """Unpacked: the same logits as HF's ``sdpa`` (one fused kernel each). Packed
    documents from ``position_ids``: the logits of HF's ``eager`` attention given the
    block-diagonal causal mask as a 4-D tensor (HF 5.24's own ``sdpa`` ignores packing
    here). Tolerance 1e-6: ``eager`` takes its softmax in float32."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ours, sdpa, eager = (_model("llama", impl) for impl in ("hyper_parallel", "sdpa", "eager"))
    batch = _batch(0, 2, packed=False)
    np.testing.assert_allclose(ours(**batch).logits.detach().numpy(), sdpa(**batch).logits.detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    packed = _batch(0, 1, packed=True)
    doc = np.repeat(np.arange(len(DOCS) - 1), np.diff(DOCS))
    allowed = (doc[:, None] == doc[None, :]) & (np.arange(SEQ)[:, None] >= np.arange(SEQ)[None, :])
    mask = torch.zeros(1, 1, SEQ, SEQ, dtype=torch.float64).masked_fill(torch.from_numpy(~allowed), float("-inf"))
    want = eager(input_ids=packed["input_ids"], position_ids=packed["position_ids"], attention_mask=mask).logits
    got = ours(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-6, atol=1e-6)
    unpacked = ours(input_ids=packed["input_ids"]).logits
    assert np.abs((unpacked - got).detach().numpy()).max() > 1e-2  # the documents did change the result


def test_attention_refuses_what_its_kernels_cannot_do() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hyper_parallel.integrations.transformers import tensor_parallel_plan

    model = _model("llama", "hyper_parallel")
    ids = _batch(0, 2, packed=False)["input_ids"]
    padded = torch.ones_like(ids)
    padded[0, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask .* masks some tokens.*Pack the sequences"):
        model(input_ids=ids, attention_mask=padded)
    model(input_ids=ids, attention_mask=torch.ones_like(ids))  # all ones: nothing to mask
    with pytest.raises(ValueError, match="rows of position_ids pack different documents"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1] * 8, list(range(16))]))
    mistral = _model("mistral", "hyper_parallel")
    mistral.config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding_window=8 is shorter than the sequence"):
        mistral(input_ids=ids)
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.up_proj": "packed_colwise"}
    with pytest.raises(ValueError, match="'model.layers.*.mlp.up_proj': 'packed_colwise' has no hyper_parallel style"):
        tensor_parallel_plan(model)


def check_bad_batches() -> list[str]:
    import torch

    from hyper_parallel.integrations.transformers import parallelize, shard_batch

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (p.world_size(),), mesh_dim_names=("cp",))
    model = parallelize(_model("llama", "hyper_parallel"), mesh, cp_mode="ring", load_balance=True)
    batch = _batch(0, 2, packed=False)
    errors = []
    for call in (lambda: model(**shard_batch(batch, mesh, load_balance=False)),  # not the attention's layout
                 lambda: model(input_ids=shard_batch(batch, mesh)["input_ids"]),  # no position_ids
                 lambda: shard_batch({**batch, "labels": torch.full_like(batch["labels"], -100)}, mesh),
                 lambda: shard_batch({"input_ids": batch["input_ids"][:, :6]}, mesh)):
        with pytest.raises(ValueError) as caught:
            call()
        errors.append(str(caught.value))
    return errors


def test_bad_batches_raise_on_every_rank(run_on_ranks) -> None:
    pytest.importorskip("transformers")
    for errors in run_on_ranks(check_bad_batches, world_size=2):
        assert "not the positions" in errors[0] and "shard_batch(batch, mesh, load_balance=True)" in errors[0]
        assert "needs position_ids" in errors[1]
        assert "no label differs from ignore_index" in errors[2]
        assert "sequence length 6 does not split into 2 * cp = 4 chunks" in errors[3]
