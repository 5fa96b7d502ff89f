"""A tiny MindFormers 2.0.0 ``GPTModel`` on MindSpore CPU, built through MindFormers' own
layer specs, on 1 rank and under MindFormers' ``parallelize_gptmodel`` (FSDP only) on 2.

MindFormers' dense stack is Ascend-first. Its modules run on MindSpore CPU except for
these, which this module replaces with test-local CPU classes (never by patching
MindFormers or MindSpore; each goes in through the hook MindFormers offers, or on the
model instance where it offers none):

- core attention (``FlashAttentionScore``, Ascend-only): ``CPUCoreAttention`` in the layer
  spec's ``SelfAttentionSubmodules.core_attention``, with ``use_flash_attention=False`` in
  the config (MindFormers' unfused path hands it SBND q/k/v), calling
  ``hyper_parallel.scaled_dot_product_attention``;
- RMSNorm (``ops.rms_norm`` has no CPU kernel): ``CPURMSNorm`` in the layer spec's
  ``input_layernorm`` / ``pre_mlp_layernorm`` and the block spec's ``layer_norm``;
- the loss's log-softmax / NLL (their custom backward uses ``mint.zeros_like``, no CPU
  kernel; ``mint.nn.functional.log_softmax`` has none either): ``CPUCrossEntropyLoss``
  (MindFormers' ``CrossEntropyLoss`` with its two inner cells replaced) on
  ``model.loss`` (``GPTModel`` builds it itself, no spec).

No RoPE (``position_embedding_type="none"``): MindFormers' ``RotaryEmbedding`` table uses
``mint.arange`` / ``mint.outer`` (no CPU kernels; a subclass on ``model.rotary_pos_emb``
would do), but its ``ApplyRotaryPosEmb._rotate_half`` (``rope_utils.py``) feeds
``mint.split`` outputs into ``mint.cat``, whose gradient MindSpore 2.10 CPU gets wrong
(the interleaved variant needs ``StackExt``, no CPU kernel). The same MindSpore bug hits a
permute of the ``mint.split`` q/k/v views here (see ``CPUCoreAttention``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mindformers") is None,
                       reason="MindFormers is not installed: the mindformers-cpu matrix entry "
                              "(platform/mindformers-cpu/README.md) installs it"),
    pytest.mark.skipif(not os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                       reason="MindFormers runs on MindSpore"),
]

VOCAB, SEQ, HIDDEN, HEADS, FFN, LAYERS, BATCH = 128, 8, 64, 4, 128, 2, 2


def _cpu_classes() -> dict:
    """The test-local CPU cells (defined here so MindSpore is imported in the ranks only)."""
    import mindspore as ms
    from mindformers.pynative.loss.loss import CrossEntropyLoss
    from mindspore import mint, nn

    import hyper_parallel

    class CPURMSNorm(nn.Cell):
        """MindFormers' ``FusedRMSNorm`` interface (``dim, eps, compute_dtype``;
        ``weight``; ``reset_parameter``) in mint ops."""

        def __init__(self, dim, eps=1e-5, compute_dtype=ms.float32):
            super().__init__()
            self.eps = eps
            self.weight = ms.Parameter(mint.empty(dim, dtype=compute_dtype))

        def construct(self, x):
            dtype = x.dtype
            x = x.astype(ms.float32)
            y = x * mint.rsqrt(mint.mean(x * x, -1, keepdim=True) + self.eps)
            return (y * self.weight).astype(dtype)

        def reset_parameter(self):
            self.weight.fill_(1.0)

    class CPUCoreAttention(nn.Cell):
        """Core attention for ``use_flash_attention=False``: SBND q/k/v in, SBH out.
        Causal; MindFormers' mask adds the padding of ``pad_token_id``, which the test
        inputs do not contain."""

        def __init__(self, config, layer_number, softmax_scale=None):
            super().__init__()
            self.scale = softmax_scale

        def construct(self, query, key, value, attention_mask=None, **kwargs):
            # ``* 1.0``: value is a view of MindFormers' ``mint.split`` of the qkv projection, and
            # on MindSpore 2.10 CPU the gradient through a permute/transpose of a split output
            # is wrong (``.contiguous()`` does not help); an arithmetic op in between fixes it
            q, k, v = (mint.permute(t * 1.0, (1, 0, 2, 3)) for t in (query, key, value))  # BSND
            out = hyper_parallel.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            seq, batch = query.shape[:2]
            return mint.reshape(mint.permute(out, (1, 0, 2, 3)), (seq, batch, -1))

    class NegLogSoftmax(nn.Cell):
        """What MindFormers' ``_LogSoftmax`` returns: ``-log_softmax`` over the last dim."""

        def construct(self, logits):
            logits = logits.astype(ms.float32)
            shifted = logits - ms.ops.stop_gradient(mint.max(logits, -1, True)[0])
            return mint.log(mint.sum(mint.exp(shifted), -1, True)) - shifted

    class PickLabel(nn.Cell):
        """What MindFormers' ``_NLLLoss`` returns: the label's entry of each row."""

        def construct(self, neg_log_softmax, label):
            classes = ms.Tensor(np.arange(neg_log_softmax.shape[-1], dtype=np.int32))
            onehot = mint.eq(mint.reshape(label, (-1, 1)).astype(ms.int32), mint.reshape(classes, (1, -1)))
            return mint.sum(neg_log_softmax * onehot.astype(neg_log_softmax.dtype), -1)

    class CPUCrossEntropyLoss(CrossEntropyLoss):
        """MindFormers' masked token mean, its log-softmax / NLL in differentiable mint ops."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.log_softmax = NegLogSoftmax()
            self.nll_loss = PickLabel()

    return {"norm": CPURMSNorm, "attention": CPUCoreAttention, "loss": CPUCrossEntropyLoss}


def gpt_config(**overrides):
    """The tiny model's ``TransformerConfig`` (float32, no RoPE); ``overrides`` replace or
    add its fields (built in the ranks: it imports MindSpore)."""
    from mindformers.parallel_core.transformer_config import TransformerConfig

    fields = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=SEQ, compute_dtype="float32",
        params_dtype="float32", layernorm_compute_dtype="float32", use_flash_attention=False,
        position_embedding_type="none", normalization="RMSNorm", gated_linear_unit=True, hidden_act="silu",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt(config=None, core_attention=None, self_attention=None, **stage):
    """The tiny ``GPTModel`` from MindFormers' ``get_gpt_layer_local_spec`` with the CPU
    cells in its spec, float32, deterministic weights (a seeded normal per parameter
    name, norms at one). ``config`` defaults to ``gpt_config()``; ``core_attention``
    (a class for the spec's ``core_attention``) to ``CPUCoreAttention``; ``self_attention``
    (for the spec's ``self_attention`` module) to MindFormers' ``SelfAttention``;
    ``stage``: ``GPTModel``'s pipeline-stage arguments (``layer_start``, ``layer_end``,
    ``pre_process``, ``post_process``, ``stage_idx``, ``vp_size``)."""
    from mindformers.pynative.base_models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from mindformers.pynative.base_models.gpt.gpt_model import GPTModel
    from mindformers.pynative.transformers.transformer_block import TransformerBlockSubmodules

    cpu = _cpu_classes()
    config = gpt_config() if config is None else config
    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=False)
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(attention, module=self_attention or attention.module,
                                    submodules=dataclasses.replace(attention.submodules,
                                                                   core_attention=core_attention or cpu["attention"]))
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=cpu["norm"], pre_mlp_layernorm=cpu["norm"], self_attention=attention))
    block = TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=cpu["norm"])
    model = GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type=config.position_embedding_type, **stage)
    model.loss = cpu["loss"]()
    seed_weights(model)
    return model


def seed_weights(model) -> None:
    """Deterministic weights, the same on every rank and in every build: a seeded normal
    (scale 0.05) per parameter name, norms at one; the cell set to training."""
    import mindspore as ms

    for name, param in model.parameters_and_names():
        if name.endswith("norm.weight"):
            value = np.ones(param.shape, np.float32)
        else:
            seed = sum(ord(c) * (i + 1) for i, c in enumerate(name))
            value = (np.random.default_rng(seed).standard_normal(param.shape) * 0.05).astype(np.float32)
        param.set_data(ms.Tensor(value))
    model.set_train(True)


def load_pieces(model, full: dict, rank: int) -> None:
    """Write this rank's piece of each ``full[name]`` (numpy, the 1-rank values) into the
    local tensor of the materialised DTensor parameter: what MindFormers' ``init_states``
    would have filled, whose fills have no CPU kernels."""
    import mindspore as ms

    from hyper_parallel.core.dtensor.layout import Layout

    for name, param in model.parameters_and_names():
        area = Layout.of(param.device_mesh, param.placements, param.shape).slice_area(rank)
        param.to_local().copy_(ms.Tensor(full[name][tuple(slice(b, e) for b, e in area)]))


def batch(rows: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` and ``labels`` (the ids shifted by one) of ``rows`` rows of ``SEQ``."""
    ids = np.random.default_rng(1).integers(1, VOCAB, (rows, SEQ)).astype(np.int32)  # no pad token 0
    return ids, np.roll(ids, -1, 1)


def check_gpt_one_rank() -> dict:
    """Forward + loss + gradients (``mindspore.value_and_grad``) of the whole batch."""
    import mindspore as ms

    model = build_gpt()
    ids, labels = batch()
    params = [param for _, param in model.parameters_and_names()]

    def loss_fn(i, l):
        return model(i, labels=l)[0]

    loss, grads = ms.value_and_grad(loss_fn, grad_position=None, weights=params)(ms.Tensor(ids), ms.Tensor(labels))
    return {"loss": float(loss.asnumpy().reshape(-1)[0]),
            "grads": {name: g.asnumpy() for (name, _), g in zip(model.parameters_and_names(), grads)}}


def test_gptmodel_one_rank(run_on_ranks) -> None:
    out = run_on_ranks(check_gpt_one_rank, world_size=1, timeout_s=300)[0]
    assert np.isfinite(out["loss"]) and 3.0 < out["loss"] < 7.0, out["loss"]  # ~ln(128) at init
    assert all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in out["grads"].values())


def parallelize(build, gradient_accumulation_steps: int = 1, swap: dict | None = None, recompute: dict | None = None,
                **degrees):
    """MindFormers' trainer's flow (``trainer.py`` ``_create_model``) on this rank: the model
    built by ``build(parallelism)`` under ``ms.DeviceCtx("meta")``, MindFormers'
    ``ParallelDims.from_config`` and ``parallelize_gptmodel`` with ``degrees`` (fields of its
    ``ParallelismConfig``: ``data_parallel``, ``tensor_parallel``, ``context_parallel``, ...),
    materialised by ``to_empty``, this rank's pieces of ``build(None)``'s values written in.
    ``swap``: fields of its ``SwapConfig`` (activation swap, ``enable`` set); ``recompute``:
    fields of its ``RecomputeConfig`` (activation checkpointing).
    Returns ``parallelize_gptmodel``'s model; under pipeline parallelism
    (``pipeline_parallel`` in ``degrees``) its ``(model_parts, schedule)``."""
    import mindspore as ms
    from mindformers.pynative.base_models.gpt.parallelize import parallelize_gptmodel
    from mindformers.pynative.config.config import (ParallelismConfig, RecomputeCommConfig, RecomputeConfig,
                                                    SwapConfig)
    from mindformers.pynative.distributed.parallel_dims import ParallelDims

    from hyper_parallel import DTensor
    from hyper_parallel.platform import get_platform

    p = get_platform()
    parallelism = ParallelismConfig()
    for field, degree in degrees.items():
        setattr(parallelism, field, degree)  # data_parallel: the trainer stores world // (tp * pp * cp)
    full = {name: param.asnumpy() for name, param in build(None).parameters_and_names()}
    with ms.DeviceCtx("meta"):
        model = build(parallelism)
    dims = ParallelDims.from_config(parallelism, p.world_size())
    # fully_shard runs under ms.DeviceCtx("meta") there too (parallelize.py apply_fsdp): the
    # shards are meta tensors, materialised as MindFormers' trainer does, by to_empty
    parts, schedule, *_ = parallelize_gptmodel(model, dims, parallelism, RecomputeConfig(**(recompute or {})),
                                               RecomputeCommConfig(),
                                               SwapConfig(enable=swap is not None, **(swap or {})),
                                               gradient_accumulation_steps)
    for model in parts:
        assert all(param.is_meta for _, param in model.parameters_and_names())
        # the trainer calls m.to_empty(), whose device=None keeps a meta tensor meta on MindSpore
        # 2.10 CPU; then m.init_states(), whose reset_parameter fills (fill_, zero_, normal_)
        # have no CPU kernels: this rank's pieces of the same values as one rank instead
        model.to_empty(device="CPU")
        for name, param in model.parameters_and_names():
            assert isinstance(param, DTensor) and not param.is_meta, name
        load_pieces(model, full, p.rank())
        model.set_train(True)  # the trainer's train loop sets every model part to training
    return (parts, schedule) if schedule is not None else parts[0]


def rank_result(named, loss, grads, main_grad: bool = False) -> dict:
    """This rank's loss and, per parameter of ``named`` (``(name, param)`` pairs), its
    placements, the area of the global tensor it holds and its gradient piece; with
    ``main_grad``, each piece is also checked against ``param.main_grad`` (1e-6: the same
    float32 values, copied)."""
    from hyper_parallel import DTensor
    from hyper_parallel.core.dtensor.layout import Layout
    from hyper_parallel.platform import get_platform

    me = get_platform().rank()
    out = {}
    for (name, param), grad in zip(named, grads):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if main_grad:
            np.testing.assert_allclose(param.main_grad.to_local().asnumpy(), local.asnumpy(), rtol=1e-6, err_msg=name)
        area = Layout.of(param.device_mesh, param.placements, param.shape).slice_area(me)
        out[name] = {"placements": [str(pl) for pl in param.placements], "area": area, "grad": local.asnumpy()}
    return {"loss": float(loss.asnumpy().reshape(-1)[0]), "params": out}


def check_gpt_fsdp(swap: dict | None = None, recompute: dict | None = None) -> dict:
    """Each rank its row of the batch; MindFormers' ``parallelize_gptmodel`` with
    data_parallel = world size (FSDP only), its ``swap_config`` fields ``swap`` and
    ``recompute_config`` fields ``recompute``, then ``value_and_grad`` on the sharded
    parameters; the matrix products run (forward, recomputation and backward) counted by
    ``count_ops`` (a ``MsDispatchMode``) around it."""
    import mindspore as ms

    from hyper_parallel import DTensor
    from hyper_parallel.core.activation_checkpoint import is_checkpointed, swap_stats
    from tests.activation_checkpoint.test_selective_checkpoint import count_ops
    from hyper_parallel.platform import get_platform

    p = get_platform()
    world, me = p.world_size(), p.rank()
    model = parallelize(lambda parallelism: build_gpt(), data_parallel=world, swap=swap, recompute=recompute)
    ids, labels = batch()
    rows = slice(me * BATCH // world, (me + 1) * BATCH // world)
    named = list(model.parameters_and_names())

    def loss_fn(i, l):
        return model(i, labels=l)[0]

    with count_ops() as counts:
        loss, grads = ms.value_and_grad(loss_fn, grad_position=None, weights=[q for _, q in named])(
            ms.Tensor(ids[rows]), ms.Tensor(labels[rows]))
    out = {}
    for (name, param), grad in zip(named, grads):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        # MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True): the same reduced gradient
        # on param.main_grad, what MindFormers' optimizer step reads
        np.testing.assert_allclose(param.main_grad.to_local().asnumpy(), local.asnumpy(), rtol=1e-6, err_msg=name)
        out[name] = {"placements": [str(pl) for pl in param.placements] if isinstance(param, DTensor) else None,
                     "grad": local.asnumpy()}
    stats = [swap_stats(model.decoder.layers[0])] if swap else [None]
    matmuls = sum(n for name, n in counts.items() if "matmul" in name.lower())
    mlp = model.decoder.layers[0].mlp
    # select recompute: the activation cell checkpointed in place, the gate's operator wrapped
    wrapped = [is_checkpointed(mlp.activation_func), hasattr(mlp.mul, "__wrapped__")]
    return {"loss": float(loss.asnumpy().reshape(-1)[0]), "params": out, "swap": stats, "matmuls": matmuls,
            "wrapped": wrapped}


#: MindFormers' full recompute of both layers, keeping matmul outputs (``exclude_op``: its
#: selective policy, ``checkpoint_wrapper(layer, policy_fn=, context_fn=)``)
RECOMPUTE = {"mode": "full", "full_recompute_layer": ["0-1"], "exclude_op": ["matmul"]}
#: MindFormers' ``select`` recompute: a cell (the activation) and an operator (the gate's
#: ``mint.mul``, which it wraps with ``checkpoint_wrapper(op, output_recompute=True)``)
SELECT = {"mode": "select", "select_module": {"mlp.activation_func": ["0-1"], "mlp.mul": ["0-1"]}}


@pytest.mark.parametrize("swap,recompute", [(None, None), ({"layer_swap": [{"layers": ["0"]}]}, None),
                                            (None, RECOMPUTE), (None, SELECT)],
                         ids=["plain", "layer_swap", "recompute_exclude_op", "recompute_select"])
def test_gptmodel_fsdp_two_ranks(run_on_ranks, swap, recompute) -> None:
    """With ``swap``, MindFormers' ``apply_swap`` (``swap_config.layer_swap``) swaps layer 0
    (its policy keeps uint8 masks) and links it to layer 1 with ``SwapManager``: the
    gradients are those of one rank unswapped, and layer 0's saved activations were copied
    out after its forward and back when the backward reached layer 1. With ``recompute``
    (layers checkpointed, then their norms fully sharded inside them), the gradients are
    one rank's too, and the kept matrix products ran once: as many as without
    checkpointing, fewer than with the same layers fully recomputed."""
    one = run_on_ranks(check_gpt_one_rank, world_size=1, timeout_s=300)[0]
    two = run_on_ranks(check_gpt_fsdp, swap, recompute, world_size=2, timeout_s=300)
    for rank in two:
        assert rank["wrapped"] == ([True, True] if recompute == SELECT else [False, False]), rank["wrapped"]
    if recompute == RECOMPUTE:
        plain = run_on_ranks(check_gpt_fsdp, world_size=2, timeout_s=300)
        full = run_on_ranks(check_gpt_fsdp, None, {**recompute, "exclude_op": None}, world_size=2, timeout_s=300)
        for rank, (sel, without, whole) in enumerate(zip(two, plain, full)):
            assert sel["matmuls"] == without["matmuls"] < whole["matmuls"], (rank, sel["matmuls"], without["matmuls"],
                                                                             whole["matmuls"])
            np.testing.assert_array_equal(sel["loss"], whole["loss"])
    if swap:
        for rank in two:
            (stats,) = rank["swap"]
            assert stats.tensors_swapped > 0 and (stats.offloads, stats.prefetches, stats.loads_on_use) == (1, 1, 0), \
                stats
    # every rank has BATCH * SEQ / 2 unmasked tokens: the mean of the ranks' means is the whole batch's
    np.testing.assert_allclose(np.mean([r["loss"] for r in two]), one["loss"], rtol=1e-5)
    for name, want in one["grads"].items():
        got = [r["params"][name] for r in two]
        assert got[0]["placements"] == ["Shard(dim=0)"], (name, got[0]["placements"])
        # reduce op "sum" (set_reduce_op_type): the ranks' gradients add up, each of its mean loss;
        # rtol 1e-4: float32 gradients summed in another order over two half batches
        np.testing.assert_allclose(np.concatenate([g["grad"] for g in got]) / 2, want, rtol=1e-4, atol=1e-6,
                                   err_msg=name)
