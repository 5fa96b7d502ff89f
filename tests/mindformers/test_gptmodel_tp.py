"""Tensor parallelism on the tiny MindFormers ``GPTModel`` of ``test_gptmodel`` through
MindFormers' own ``parallelize_gptmodel`` (``apply_non_moe_tp``): tensor_parallel=2 on 2
ranks, and tensor_parallel=2 x data_parallel=2 (FSDP) on 4, against the 1-rank run.

The model is wrapped as MindFormers' causal-LM classes wrap it (``self.model = GPTModel``):
``apply_non_moe_tp`` reads ``model.model.embedding`` etc. MindFormers' plan then shards
the embedding by vocabulary rows (``RowwiseParallel``, output sequence-sharded), keeps the
norms sequence-sharded (``SequenceParallel(0)``), gathers the sequence before attention
and the MLP (``PrepareModuleInput``), shards ``linear_proj`` / ``linear_fc2`` by rows
(reduce-scatter to the sequence) and ``linear_fc1`` / ``output_layer`` by columns, and
hands q/k/v to the test-local core attention as DTensors, heads sharded
(``PrepareModuleInput(desired_input_layouts=(Shard(2),) * 3)``). The loss's
``log_softmax`` / ``nll_loss`` get MindFormers' ``PrepareModuleInputOutput``.

Found on the way (MindFormers 2.0.0, MindSpore 2.10 CPU):

- ``apply_non_moe_tp`` plans multi-latent attention only (``_apply_layers_tp`` reads
  ``config.q_lora_rank``, ``self_attention.q_rank`` and plans ``linear_kvb`` /
  ``apply_rotary_emb_q``; parallelize.py:738, 789-806): the model here is the MLA variant
  of ``test_gptmodel``'s (``multi_latent_attention=True``, ``qk_layernorm=True``,
  ``q_lora_rank`` set), no RoPE as there.
- MindSpore 2.10 CPU differentiates ``mint.cat`` of ``mint.split`` views wrongly (MLA
  concatenates ``q_nope`` / ``q_pe``): ``MLASelfAttention.split`` is replaced on the
  instance by a split whose pieces pass through ``* 1.0``.
- MindFormers' ``PrepareModuleInput`` trusts its declared ``input_layouts`` for a DTensor
  input (style.py:655, no redistribute when declared == desired), so a DTensor that
  arrives Replicate is handed on Replicate.
- hyper_parallel fixes made for this path: a broadcast of a meta tensor (``distribute_tensor``
  under ``ms.DeviceCtx("meta")``), ``mint.reshape`` of a DTensor, and fully_shard handing
  a tensor-parallel parameter to a DTensor forward as a DTensor on the tp mesh.
- ``mint.split`` / ``mint.chunk`` of a DTensor (MLA's ``q_nope`` / ``q_pe``) now keep the
  head sharding (``platform/mindspore/dtensor.py`` ``_split``); the forward then reaches
  the loss.
- MindFormers' loss multiplies its replicated DTensor loss by a plain ``input_mask``: a
  framework tensor among DTensors that are all ``Replicate`` is taken as replicated
  (core's [Note: framework tensors among replicated DTensors]).
- Loss parallelism (``enable_loss_parallel``): the logits reach the loss vocabulary-sharded
  (the view primitives and the fully_shard unit's ``CellBackwardHook`` keep the shard);
  MindFormers' ``_VocabParallelCrossEntropy`` then needs kernels MindSpore 2.10 has on
  Ascend only (``test_loss_parallel_logits``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.mindformers.test_gptmodel import BATCH, batch, parallelize, pytestmark, rank_result, seed_weights  # noqa: F401


QK_HEAD, QK_POS, V_HEAD, Q_LORA, KV_LORA = 12, 4, 16, 32, 32


#: ``seq_length`` that ``use_attn_mask_compression`` needs (MindFormers' ``CausalMaskGenerate``)
COMPRESSED_MASK_SEQ = 2048


def build_mla_gpt(pipeline: bool = False, flash_attention: bool = False, core_attention=None):
    """``test_gptmodel``'s tiny ``GPTModel`` with MindFormers' multi-latent attention
    (``get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)``, the
    only attention ``apply_non_moe_tp`` plans), the same test-local CPU cells in the spec,
    wrapped as MindFormers' causal-LM classes hold it (``self.model = GPTModel``, which
    ``apply_non_moe_tp`` reads). Weights as ``build_gpt``'s: a seeded normal per name.
    ``pipeline``: the wrapper takes ``apply_pp``'s stage arguments and its stage interface
    (``test_gptmodel_pp.causal_lm_class``). ``flash_attention``: MindFormers' own
    ``FlashAttention`` as the core attention (``use_flash_attention=True`` with the
    compressed causal mask, ``sparse_mode=2``; its ``FlashAttentionScore`` call on the
    head-sharded DTensors computed per rank by this package), else ``TPCoreAttention``;
    ``core_attention``: another class for the spec's core attention."""
    from mindformers.parallel_core.transformer_config import MLATransformerConfig
    from mindformers.pynative.base_models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from mindformers.pynative.base_models.gpt.gpt_model import GPTModel
    from mindformers.pynative.transformers.transformer_block import TransformerBlockSubmodules
    from mindspore import mint, nn

    from tests.mindformers.test_gptmodel import FFN, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, _cpu_classes

    from hyper_parallel import DTensor

    cpu = _cpu_classes()

    class TPCoreAttention(cpu["attention"]):
        """``CPUCoreAttention`` on the DTensor q/k/v that MindFormers' ``PrepareModuleInput``
        hands in under tensor parallelism (heads sharded, ``Shard(2)`` of SBND): attention
        per head on this rank's heads, the SBH output ``Shard(2)`` (heads merged), for
        ``use_flash_attention=False``. With ``flash_attention`` MindFormers' own
        ``FlashAttention`` runs instead (``test_gptmodel_tp_flash_attention``)."""

        def construct(self, query, key, value, attention_mask=None, **kwargs):
            if not isinstance(query, DTensor):
                return super().construct(query, key, value, attention_mask, **kwargs)
            assert [str(pl) for pl in query.placements] == ["Shard(dim=2)"], query.placements
            out = super().construct(query.to_local(), key.to_local(), value.to_local(), attention_mask, **kwargs)
            return DTensor.from_local(out, query.device_mesh, query.placements)

    flash = {"use_flash_attention": True, "use_attn_mask_compression": True, "seq_length": COMPRESSED_MASK_SEQ,
             "max_position_embeddings": COMPRESSED_MASK_SEQ} if flash_attention else {
        "use_flash_attention": False, "seq_length": SEQ, "max_position_embeddings": SEQ}
    config = MLATransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        vocab_size=VOCAB, compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32", **flash,
        position_embedding_type="none", normalization="RMSNorm", gated_linear_unit=True, hidden_act="silu",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, multi_latent_attention=True,
        q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=QK_HEAD, qk_pos_emb_head_dim=QK_POS,
        v_head_dim=V_HEAD, qk_layernorm=True)
    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True, multi_latent_attention=True)
    attention = layer.submodules.self_attention
    if core_attention is None and flash_attention:
        from mindformers.pynative.layers.flash_attention import FlashAttention as core_attention
    elif core_attention is None:
        core_attention = TPCoreAttention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=core_attention, q_layernorm=cpu["norm"], k_layernorm=cpu["norm"]))
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=cpu["norm"], pre_mlp_layernorm=cpu["norm"], self_attention=attention))
    block = TransformerBlockSubmodules(layer_specs=[layer] * LAYERS, layer_norm=cpu["norm"])

    def split(tensor, sizes, dim=0):
        # MindSpore 2.10 CPU differentiates mint.cat / permute of mint.split views wrongly
        # (MLA concatenates its q_nope / q_pe split views): an arithmetic op on each piece
        return tuple(piece * 1.0 for piece in mint.split(tensor, sizes, dim=dim))

    class CausalLM(nn.Cell):
        def __init__(self, config=config, **stage):
            super().__init__(auto_prefix=False)
            config.num_hidden_layers = config.num_layers  # what apply_pp reads (see test_gptmodel_pp)
            self.config = config
            self.model = GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                                  position_embedding_type="none", **stage)
            self.model.loss = cpu["loss"]()
            for mla in self.model.decoder.layers:
                mla.self_attention.split = split  # on the instance (MLASelfAttention.split = mint.split)

        def construct(self, input_ids, labels=None, position_ids=None, **unset):
            # MindFormers' CP root hook passes every name it slices, None where not given
            assert all(value is None for value in unset.values()), sorted(unset)
            return self.model(input_ids, position_ids=position_ids, labels=labels)

    class StageCausalLM(CausalLM):
        def construct(self, decoder_input=None, input_ids=None, labels=None, position_ids=None):
            return self.model(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                              labels=labels)

    model = StageCausalLM() if pipeline else CausalLM()
    seed_weights(model)
    return model


def check_mla_one_rank() -> dict:
    """Forward + loss + gradients of the whole batch on 1 rank."""
    import mindspore as ms

    model = build_mla_gpt()
    ids, labels = batch()
    named = list(model.parameters_and_names())

    def loss_fn(i, l):
        return model(i, labels=l)[0]

    loss, grads = ms.value_and_grad(loss_fn, grad_position=None, weights=[q for _, q in named])(
        ms.Tensor(ids), ms.Tensor(labels))
    return {"loss": float(loss.asnumpy().reshape(-1)[0]),
            "grads": {name: g.asnumpy() for (name, _), g in zip(named, grads)}}


def check_gpt_tp(data_parallel: int, tensor_parallel: int, loss_parallel: bool = False,
                 flash_attention: bool = False) -> dict:
    """MindFormers' ``ParallelDims.from_config`` + ``parallelize_gptmodel`` with the given
    degrees on the wrapped model built under meta; this rank's pieces of the 1-rank
    weights written in; loss and ``value_and_grad``. ``flash_attention``: see
    ``build_mla_gpt``."""
    import mindspore as ms

    from hyper_parallel import DTensor
    from hyper_parallel.platform import get_platform

    p = get_platform()
    world, me = p.world_size(), p.rank()
    assert world == data_parallel * tensor_parallel
    model = parallelize(lambda parallelism: build_mla_gpt(flash_attention=flash_attention), data_parallel=data_parallel,
                        tensor_parallel=tensor_parallel, enable_loss_parallel=loss_parallel)
    named = list(model.parameters_and_names())
    ids, labels = batch()
    dp = me // tensor_parallel  # dense mesh (pp, dp_replicate, fsdp, tp): tp innermost
    rows = slice(dp * BATCH // data_parallel, (dp + 1) * BATCH // data_parallel)

    def loss_fn(i, l):
        loss = model(i, labels=l)[0]
        return loss.to_local() if isinstance(loss, DTensor) else loss

    loss, grads = ms.value_and_grad(loss_fn, grad_position=None, weights=[q for _, q in named])(
        ms.Tensor(ids[rows]), ms.Tensor(labels[rows]))
    return rank_result(named, loss, grads)


def _compare(one: dict, ranks: list, data_parallel: int) -> None:
    # every data-parallel rank has BATCH * SEQ / dp unmasked tokens: the mean of their means
    np.testing.assert_allclose(np.mean([r["loss"] for r in ranks]), one["loss"], rtol=1e-5)
    for name, want in one["grads"].items():
        for me, r in enumerate(ranks):
            got = r["params"][name]
            piece = want[tuple(slice(b, e) for b, e in got["area"])]
            # fully_shard's reduce op "sum": the data-parallel ranks' gradients add up
            np.testing.assert_allclose(got["grad"] / data_parallel, piece, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name} rank {me} {got['placements']}")


def test_mla_gptmodel_one_rank(run_on_ranks) -> None:
    out = run_on_ranks(check_mla_one_rank, world_size=1, timeout_s=300)[0]
    assert np.isfinite(out["loss"]) and 3.0 < out["loss"] < 7.0, out["loss"]  # ~ln(128) at init
    assert all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in out["grads"].values()), \
        [n for n, g in out["grads"].items() if not np.abs(g).sum() > 0]


def test_gptmodel_tp_two_ranks(run_on_ranks) -> None:
    one = run_on_ranks(check_mla_one_rank, world_size=1, timeout_s=300)[0]
    two = run_on_ranks(check_gpt_tp, 1, 2, world_size=2, timeout_s=600)
    _compare(one, two, 1)


def test_gptmodel_tp_fsdp_four_ranks(run_on_ranks) -> None:
    one = run_on_ranks(check_mla_one_rank, world_size=1, timeout_s=300)[0]
    four = run_on_ranks(check_gpt_tp, 2, 2, world_size=4, timeout_s=600)
    _compare(one, four, 2)


@pytest.mark.parametrize("data_parallel,tensor_parallel", [(1, 2), (2, 2)], ids=["tp2", "tp2-dp2"])
def test_gptmodel_tp_flash_attention(run_on_ranks, data_parallel, tensor_parallel) -> None:
    """MindFormers' own ``FlashAttention`` cell as the core attention under its tensor
    parallelism: ``FlashAttentionScore`` (BNSD, causal) on q/k/v with the heads sharded
    over tp is computed by each rank on its own heads (``attention_on_local_shards``; the
    primitive has no CPU kernel, so nothing else could have run it), against one rank of
    ``CPUCoreAttention``."""
    one = run_on_ranks(check_mla_one_rank, world_size=1, timeout_s=300)[0]
    ranks = run_on_ranks(check_gpt_tp, data_parallel, tensor_parallel, False, True,
                         world_size=data_parallel * tensor_parallel, timeout_s=600)
    _compare(one, ranks, data_parallel)


class _Stop(Exception):
    """Raised by the hook that reads the loss's input, to stop the forward there."""


def check_loss_parallel_logits() -> list:
    """tensor_parallel=2 with ``enable_loss_parallel``: the output layer
    (``ColwiseParallel(output_layouts=Shard(-1))``) and ``GPTModel``'s ``mint.permute`` /
    reshape to ``[batch * seq, vocab]`` (and the fully_shard unit's backward hook on its
    output) hand MindFormers' loss vocabulary-sharded logits, so its
    ``vocab_parallel_shard_dim`` picks ``_VocabParallelCrossEntropy``. The forward stops
    there: that function reduces with ``comm_func.all_reduce`` (``InnerCommAllReduce``, no
    CPU kernel in MindSpore 2.10) and its backward scatters with ``mint.scatter_add`` (none
    either), so MindFormers' loss parallelism is Ascend-only."""
    import mindspore as ms

    from hyper_parallel import DTensor

    model = parallelize(lambda parallelism: build_mla_gpt(), data_parallel=1, tensor_parallel=2,
                        enable_loss_parallel=True)
    seen = []

    def read(cell, inputs):
        logits = inputs[0]
        seen.append([str(pl) for pl in logits.placements] if isinstance(logits, DTensor) else type(logits).__name__)
        seen.append(tuple(logits.shape))
        raise _Stop

    model.model.loss.register_forward_pre_hook(read)
    ids, labels = batch()
    try:
        model(ms.Tensor(ids), labels=ms.Tensor(labels))
    except _Stop:
        pass
    return seen


def test_loss_parallel_logits(run_on_ranks) -> None:
    from tests.mindformers.test_gptmodel import SEQ, VOCAB

    for placements, shape in run_on_ranks(check_loss_parallel_logits, world_size=2, timeout_s=300):
        assert placements == ["Shard(dim=1)"] and shape == (BATCH * SEQ, VOCAB), (placements, shape)
