"""Context parallelism on the tiny MindFormers 2.0.0 ``GPTModel`` (``test_gptmodel``) on
MindSpore CPU, through MindFormers' own ``parallelize_gptmodel``: ``context_parallel=2``
on 2 ranks and ``context_parallel=2 x data_parallel=2`` (FSDP over ``dp_shard * cp``) on 4,
loss and gradients against one rank.

What runs is MindFormers' default ("colossal") path, as its trainer sets it up:

- the config as ``trainer/utils._build_model`` makes it: ``attach_context_parallel_runtime_hints``
  (``context_parallel_size``, ``input_layout="BSH"``), and what ``TransformerConfig`` and
  ``apply_context_parallel_model_io`` require for CP: ``use_flash_attention=True`` and
  ``use_attn_mask_compression=True``, which in turn needs ``seq_length >= 2048``
  (``CausalMaskGenerate`` builds its 2048 x 2048 compressed mask). ``seq_length`` is only
  that bound here: the model sees 8 tokens (``max_sequence_length=8``);
- the inputs as its trainer passes them (``model(**batch)``, keywords: the root hook
  ``ContextParallelModelIOStyle`` maps positional arguments by its own
  ``_INPUT_NAMES``, whose first entry is ``decoder_input``, not ``GPTModel``'s
  ``input_ids``), with the ``position_ids`` that hook requires; learned absolute position
  embeddings (``position_embedding_type="learned_absolute"``) make the sliced
  ``position_ids`` count (no RoPE on MindSpore 2.10 CPU, see ``test_gptmodel``);
- ``parallelize_gptmodel``: ``apply_context_parallel_attention`` puts
  ``ContextParallelAttentionStyle("colossal", 2, 1, "BSH")`` on every layer's
  ``core_attention`` (its pre-hook turns SBND q/k/v into BSH ``(batch, seq/cp, heads*dim)``,
  then this package's ``ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1)``, whose
  frame makes ``scaled_dot_product_attention`` all-gather K/V with the causal offset of
  this rank's query chunk; its post-hook turns BSH back to SBH), ``fully_shard`` over the
  ``fsdp`` mesh (``dp_shard * cp`` ranks) and ``apply_context_parallel_model_io`` (the
  root pre-hook slicing ``input_ids`` / ``labels`` / ``position_ids`` to this rank's
  contiguous chunk).

The core attention is a test-local ``CPUFlashAttention`` in the layer spec (MindFormers'
``FlashAttention`` runs ``FlashAttentionScore``, Ascend-only): the same interface and
layout rules (``input_layout``, ``_mf_runtime_input_already_in_fa_layout``), causal
(``sparse_mode=2``: the compressed mask is the causal one), attention through
``hyper_parallel.scaled_dot_product_attention``. With ``use_flash_attention=True``
MindFormers' ``Attention`` casts float32 q/k/v to float16 before the core attention
(``transformers/attention.py``), as for the Ascend kernel, whose float16 inputs it
accumulates in float32; ``CPUFlashAttention`` computes in float32 from those float16
values. Gradients of q/k/v are therefore rounded to float16 on their way back, so
gradients are compared within 1e-4 of each parameter's largest gradient entry (measured:
at most 2e-5, in the first layer's ``linear_qkv``; the loss agrees to float32 rounding,
compared at 1e-5 relative); the gradient through a
permute of ``mint.split`` views that MindSpore 2.10 CPU gets wrong (``test_gptmodel``) does
not arise: the cast comes between the split and MindFormers' layout hooks.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from tests.mindformers.test_gptmodel import BATCH, HIDDEN, SEQ, batch, build_gpt, gpt_config

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mindformers") is None,
                       reason="MindFormers is not installed: the mindformers-cpu matrix entry "
                              "(platform/mindformers-cpu/README.md) installs it"),
    pytest.mark.skipif(not os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                       reason="MindFormers runs on MindSpore"),
]

#: ``seq_length`` that ``use_attn_mask_compression`` needs (``CausalMaskGenerate``).
COMPRESSED_MASK_SEQ = 2048


def _flash_attention_class():
    """``CPUFlashAttention`` (defined here so MindSpore is imported in the ranks only)."""
    import mindspore as ms
    from mindspore import mint, nn

    import hyper_parallel

    class CPUFlashAttention(nn.Cell):
        """MindFormers' ``FlashAttention`` interface and layouts over
        ``hyper_parallel.scaled_dot_product_attention``, causal.

        Without context parallelism it gets SBND q/k/v and returns SBH (``input_layout``
        ``"BNSD"``, as MindFormers'); under MindFormers' colossal CP hooks
        (``_mf_runtime_input_already_in_fa_layout`` with ``input_layout="BSH"``) it gets
        BSH ``(batch, seq / cp, heads * head_dim)`` and returns BSH. ``attention_mask`` is
        MindFormers' compressed causal mask (``sparse_mode=2``), expressed by
        ``is_causal``; the positions of this rank's chunk come from the CP frame."""

        def __init__(self, config, layer_number, softmax_scale=None):
            super().__init__()
            self.head_num = config.num_attention_heads
            self.input_layout = config.input_layout
            self.sparse_mode = config.sparse_mode
            head_dim = config.kv_channels
            self.scale = 1.0 / float(np.sqrt(head_dim)) if softmax_scale is None else softmax_scale

        def construct(self, query, key, value, attention_mask, alibi_mask=None, prefix=None, padding_mask=None,
                      actual_seq_qlen=None, actual_seq_kvlen=None):
            if self.sparse_mode != 2 or alibi_mask is not None or prefix is not None or padding_mask is not None \
                    or actual_seq_qlen is not None:
                raise NotImplementedError("CPUFlashAttention: the compressed causal mask (sparse_mode=2) only")
            self.seen = tuple(query.shape)  # what MindFormers' hooks delivered (checked by the test)
            if getattr(self, "_mf_runtime_input_already_in_fa_layout", False):
                if self.input_layout != "BSH":
                    raise NotImplementedError(f"CPUFlashAttention: input_layout {self.input_layout!r} under CP")
                batch, seq = query.shape[:2]
                q, k, v = (mint.reshape(t.astype(ms.float32), (batch, seq, self.head_num, -1))
                           for t in (query, key, value))
                out = hyper_parallel.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
                return mint.reshape(out, (batch, seq, -1))
            seq, batch = query.shape[:2]  # SBND
            q, k, v = (mint.permute(t.astype(ms.float32), (1, 0, 2, 3)) for t in (query, key, value))
            out = hyper_parallel.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return mint.reshape(mint.permute(out, (1, 0, 2, 3)), (seq, batch, -1))

    return CPUFlashAttention


def cp_config(parallelism=None):
    """The config MindFormers' trainer builds for CP (``parallelism`` given) or the same
    model without it (``None``)."""
    from mindformers.pynative.distributed.context_parallel import attach_context_parallel_runtime_hints

    config = gpt_config(use_flash_attention=True, use_attn_mask_compression=True, seq_length=COMPRESSED_MASK_SEQ,
                        max_position_embeddings=COMPRESSED_MASK_SEQ, position_embedding_type="learned_absolute")
    return attach_context_parallel_runtime_hints(config, parallelism)


def cp_batch() -> dict[str, np.ndarray]:
    """``input_ids`` / ``labels`` of ``test_gptmodel.batch()`` (no pad token) and the
    ``position_ids`` 0..SEQ-1 of every row."""
    ids, labels = batch()
    return {"input_ids": ids, "labels": labels,
            "position_ids": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1))}


def check_one_rank() -> dict:
    """The whole batch on one rank, no CP: loss and gradients."""
    import mindspore as ms

    model = build_gpt(cp_config(), _flash_attention_class())
    named = list(model.parameters_and_names())
    inputs = {key: ms.Tensor(value) for key, value in cp_batch().items()}

    def loss_fn(input_ids, position_ids, labels):
        return model(input_ids=input_ids, position_ids=position_ids, labels=labels)[0]

    loss, grads = ms.value_and_grad(loss_fn, grad_position=None, weights=[q for _, q in named])(
        inputs["input_ids"], inputs["position_ids"], inputs["labels"])
    return {"loss": float(loss.asnumpy().reshape(-1)[0]),
            "grads": {name: g.asnumpy() for (name, _), g in zip(named, grads)}}


def check_cp(cp: int) -> dict:
    """MindFormers' ``ParallelDims.from_config`` + ``parallelize_gptmodel`` with
    ``context_parallel=cp`` and ``data_parallel = world / cp`` (FSDP), the model built under
    meta as the trainer does, this rank's batch rows (dataloading mesh ``(pp, batch, cp,
    tp)``: rank ``= batch_index * cp + cp_index``); the root hook cuts the sequence."""
    import mindspore as ms
    from mindformers.pynative.base_models.gpt.parallelize import parallelize_gptmodel
    from mindformers.pynative.config.config import (ParallelismConfig, RecomputeCommConfig, RecomputeConfig,
                                                    SwapConfig)
    from mindformers.pynative.distributed.parallel_dims import ParallelDims

    from hyper_parallel import DTensor
    from hyper_parallel.core.dtensor.layout import Layout
    from hyper_parallel.platform import get_platform

    p = get_platform()
    world, me = p.world_size(), p.rank()
    attention = _flash_attention_class()
    parallelism = ParallelismConfig()
    parallelism.context_parallel = cp
    parallelism.data_parallel = world // cp  # the trainer stores world // (tp * pp * cp) here
    full = {name: param.asnumpy() for name, param in build_gpt(cp_config(), attention).parameters_and_names()}
    with ms.DeviceCtx("meta"):
        model = build_gpt(cp_config(parallelism), attention)
    assert model.config.input_layout == "BSH" and model.config.context_parallel_size == cp
    dims = ParallelDims.from_config(parallelism, world)
    parts, *_ = parallelize_gptmodel(model, dims, parallelism, RecomputeConfig(), RecomputeCommConfig(),
                                     SwapConfig())
    model = parts[0]
    model.to_empty(device="CPU")  # as in test_gptmodel.check_gpt_fsdp
    for name, param in model.parameters_and_names():
        area = Layout.of(param.device_mesh, param.placements, param.shape).slice_area(me)
        param.to_local().copy_(ms.Tensor(full[name][tuple(slice(b, e) for b, e in area)]))
    dp_index, dp = me // cp, world // cp
    rows = slice(dp_index * BATCH // dp, (dp_index + 1) * BATCH // dp)
    inputs = {key: ms.Tensor(value[rows]) for key, value in cp_batch().items()}
    named = list(model.parameters_and_names())

    def loss_fn(input_ids, position_ids, labels):
        return model(input_ids=input_ids, position_ids=position_ids, labels=labels)[0]

    loss, grads = ms.value_and_grad(loss_fn, grad_position=None, weights=[q for _, q in named])(
        inputs["input_ids"], inputs["position_ids"], inputs["labels"])
    for layer in model.decoder.layers:  # BSH, this rank's rows and its 1/cp of the sequence
        assert layer.self_attention.core_attention.seen == (BATCH // dp, SEQ // cp, HIDDEN), \
            layer.self_attention.core_attention.seen
    out = {}
    for (name, param), grad in zip(named, grads):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        np.testing.assert_allclose(param.main_grad.to_local().asnumpy(), local.asnumpy(), rtol=1e-6, err_msg=name)
        area = Layout.of(param.device_mesh, param.placements, param.shape).slice_area(me)
        out[name] = {"placements": [str(pl) for pl in param.placements], "area": area, "grad": local.asnumpy()}
    return {"loss": float(loss.asnumpy().reshape(-1)[0]), "params": out}


def _compare(one: dict, ranks: list[dict]) -> None:
    world = len(ranks)
    # every rank holds BATCH * SEQ / world tokens, none masked: the ranks' mean is the whole batch's mean
    np.testing.assert_allclose(np.mean([r["loss"] for r in ranks]), one["loss"], rtol=1e-5)
    for name, want in one["grads"].items():
        got = np.zeros_like(want)
        seen = np.zeros(want.shape, bool)
        for r in ranks:
            entry = r["params"][name]
            index = tuple(slice(b, e) for b, e in entry["area"])
            # reduce op "sum" over the fsdp mesh (dp_shard * cp): each rank's mean loss, summed
            got[index] = entry["grad"] / world
            seen[index] = True
        assert seen.all(), name
        # q/k/v gradients pass through float16 (module docstring): within 1e-4 of the largest entry
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max(), err_msg=name)


def test_gptmodel_cp_two_ranks(run_on_ranks) -> None:
    one = run_on_ranks(check_one_rank, world_size=1, timeout_s=300)[0]
    two = run_on_ranks(check_cp, 2, world_size=2, timeout_s=300)
    assert all(r["params"]["decoder.layers.0.self_attention.linear_qkv.weight"]["placements"] == ["Shard(dim=0)"]
               for r in two)
    _compare(one, two)


def test_gptmodel_cp_dp_four_ranks(run_on_ranks) -> None:
    one = run_on_ranks(check_one_rank, world_size=1, timeout_s=300)[0]
    four = run_on_ranks(check_cp, 2, world_size=4, timeout_s=600)
    _compare(one, four)
