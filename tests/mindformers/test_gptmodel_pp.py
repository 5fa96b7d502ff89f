"""Pipeline parallelism of the tiny MindFormers ``GPTModel`` (``test_gptmodel.py``) through
MindFormers' own ``apply_pp`` (``pynative/base_models/gpt/parallelize.py``): its
``StageModelBuilder`` builds one stage model per pipeline stage under ``ms.DeviceCtx("meta")``
and wraps each in its ``ScaledLossPipelineStage`` (a subclass of our ``PipelineStage``,
built with ``stage_num=``, ``device=``, ``group=``, ``mesh=``), applies FSDP to each, sets
the stages' ``loss_scale`` (``1 / (dp * microbatches)``) and builds our ``Schedule1F1B`` /
``ScheduleInterleaved1F1B`` through its ``_create_schedule``; the step is its trainer's
``schedule.run(**batch)`` ([Note: the loss inside the last stage]).

One step against one rank on the whole batch, for pp 2, pp 2 x FSDP 2, pp 2 x 2 interleaved
chunks, pp 2 x colossal CP 2 (``test_gptmodel_cp``'s model; MindFormers' CP hooks slice
every stage's inputs) and pp 2 x TP 2 (``test_gptmodel_tp``'s MLA model; its sequence-parallel
hidden state crosses the stage boundary as a ``Shard(0)`` DTensor): the last stage's
microbatch losses average to the one-rank loss, and every rank's ``param.main_grad`` piece
(the FSDP-reduced gradient the trainer's optimizer reads) equals its piece of the one-rank
gradient. ``test_gptmodel_train`` runs three AdamW
steps of pp 2 and pp 2 x FSDP 2.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.mindformers.test_gptmodel import build_gpt, gpt_config, parallelize, pytestmark  # noqa: F401

MICROBATCHES = 2  # MindFormers' pipeline_parallel_microbatch_size (a count of microbatches)
ROWS = 4


def causal_lm_class(core_attention=None, self_attention=None):
    """A causal-LM wrapper with the interface MindFormers' ``apply_pp`` builds stages
    from, that of its pynative DeepSeek-V3 (``models/deepseek3/modeling_deepseek_v3_pynative.py``,
    MoE-only there): ``cls(config, layer_start=, layer_end=, pre_process=, post_process=,
    stage_idx=, vp_size=)`` and ``construct(decoder_input=None, input_ids=None, labels=None,
    ...)``, a stage after the first taking the previous one's hidden states as
    ``decoder_input``. Around the dense tiny ``GPTModel`` of ``build_gpt`` (CPU cells;
    ``core_attention`` / ``self_attention`` as there)."""
    from mindspore import nn

    class CausalLM(nn.Cell):
        def __init__(self, config, **stage):
            super().__init__()
            # a model's config in MindFormers is its Hugging Face-style config, which apply_pp
            # reads num_hidden_layers from (the wrapper converts it to a TransformerConfig)
            config.num_hidden_layers = config.num_layers
            self.config = config
            self.model = build_gpt(config, core_attention, self_attention, **stage)

        def construct(self, decoder_input=None, input_ids=None, labels=None, position_ids=None, **batch):
            return self.model(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                              labels=labels, **batch)

    return CausalLM


def _inputs(kind: str, rows: slice = slice(None)) -> dict:
    """``ROWS`` rows (``kind`` "gpt"), or ``test_gptmodel_cp``'s batch with its position ids ("cp")."""
    from tests.mindformers.test_gptmodel import batch
    from tests.mindformers.test_gptmodel_cp import cp_batch

    if kind == "cp":
        return cp_batch(rows)
    ids, labels = batch(ROWS)
    return {"input_ids": ids[rows], "labels": labels[rows]}


def _build(kind: str, layers: int, parallelism=None):
    """The tiny causal LM: ``build_gpt``'s ("gpt"), ``test_gptmodel_cp``'s CP model ("cp":
    its config, for ``parallelism`` or one rank), or ``test_gptmodel_tp``'s
    multi-latent-attention model, which MindFormers' TP plans ("mla", 2 layers). Under
    ``parallelism`` the last two run MindFormers' own ``FlashAttention`` (its
    ``FlashAttentionScore`` calls on the CP / TP DTensors computed by this package), on
    one rank the test-local CPU core attention."""
    from mindformers.pynative.layers.flash_attention import FlashAttention

    from tests.mindformers.test_gptmodel_cp import _attention_classes, cp_config
    from tests.mindformers.test_gptmodel_tp import build_mla_gpt

    if kind == "mla":
        return build_mla_gpt(pipeline=True, flash_attention=parallelism is not None)

    if kind == "cp":
        config = cp_config(parallelism)
        config.num_layers = layers
        cpu_attention, self_attention = _attention_classes()
        return causal_lm_class(cpu_attention if parallelism is None else FlashAttention, self_attention)(config)
    return causal_lm_class()(gpt_config(num_layers=layers))


def check_one_rank(kind: str, layers: int) -> dict:
    """The whole batch's mean loss and its gradients (``mindspore.value_and_grad``)."""
    import mindspore as ms

    model = _build(kind, layers)
    inputs = {name: ms.Tensor(value) for name, value in _inputs(kind).items()}
    named = list(model.parameters_and_names())
    loss, grads = ms.value_and_grad(lambda: model(**inputs)[0], grad_position=None,
                                    weights=[param for _, param in named])()
    return {"loss": float(loss.asnumpy().reshape(-1)[0]),
            "grads": {name: g.asnumpy() for (name, _), g in zip(named, grads)}}


def check_pipeline(kind: str, layers: int, pipeline_parallel: int, data_parallel: int, context_parallel: int,
                   tensor_parallel: int, interleave: int) -> dict:
    """MindFormers' ``parallelize_gptmodel`` with these degrees (the mesh ``(pp, fsdp, cp,
    tp)``: rank ``= ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index``), this
    rank's rows (MindFormers' CP hook takes the rank's sequence chunk), one
    ``schedule.run``: the last stage's losses, and per parameter this rank's area and
    ``main_grad`` piece."""
    import mindspore as ms

    from hyper_parallel import DTensor
    from hyper_parallel.core.dtensor.layout import Layout
    from hyper_parallel.core.pipeline_parallel import Schedule1F1B, ScheduleInterleaved1F1B
    from hyper_parallel.platform import get_platform

    p = get_platform()
    parts, schedule = parallelize(
        lambda parallelism: _build(kind, layers, parallelism), data_parallel=data_parallel,
        context_parallel=context_parallel, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        pipeline_parallel_interleave_num=interleave, pipeline_parallel_microbatch_size=MICROBATCHES,
        gradient_accumulation_steps=MICROBATCHES)
    assert type(schedule) is (ScheduleInterleaved1F1B if interleave > 1 else Schedule1F1B)
    assert [type(s).__name__ for s in schedule._stages.values()] == ["ScaledLossPipelineStage"] * interleave
    dp_index = p.rank() // (context_parallel * tensor_parallel) % data_parallel
    inputs = _inputs(kind)
    total = len(inputs["input_ids"])
    rows = slice(dp_index * total // data_parallel, (dp_index + 1) * total // data_parallel)
    outputs = schedule.run(**{name: ms.Tensor(value) for name, value in _inputs(kind, rows).items()})
    grads = {}
    for part in parts:
        for name, param in part.parameters_and_names():
            area = Layout.of(param.device_mesh, param.placements, param.shape).slice_area(p.rank())
            grads[name] = (area, param.main_grad.to_local().asnumpy())
    # under TP the loss is a DTensor replicated over tp
    losses = [out[0].to_local() if isinstance(out[0], DTensor) else out[0] for out in outputs]
    return {"losses": [float(loss.asnumpy().reshape(-1)[0]) for loss in losses], "grads": grads}


@pytest.mark.parametrize("kind,layers,pp,dp,cp,tp,interleave,world", [
    ("gpt", 2, 2, 1, 1, 1, 1, 2), ("gpt", 2, 2, 2, 1, 1, 1, 4), ("gpt", 4, 2, 1, 1, 1, 2, 2),
    ("cp", 2, 2, 1, 2, 1, 1, 4), ("mla", 2, 2, 1, 1, 2, 1, 4)],
    ids=["pp2", "pp2-fsdp2", "pp2-interleaved2", "pp2-cp2", "pp2-tp2"])
def test_pipeline_step(run_on_ranks, kind, layers, pp, dp, cp, tp, interleave, world) -> None:
    one = run_on_ranks(check_one_rank, kind, layers, world_size=1, timeout_s=300)[0]
    ranks = run_on_ranks(check_pipeline, kind, layers, pp, dp, cp, tp, interleave, world_size=world,
                         timeout_s=600)
    losses = [loss for r in ranks for loss in r["losses"]]
    # the last stage's ranks hold every row (dp) and sequence chunk (cp) once (tp ranks the
    # same), MICROBATCHES equal microbatches each, no token masked: the mean of their means
    # is the batch's
    assert len(losses) == dp * cp * tp * MICROBATCHES, losses
    # float32 forward, the same per-token terms averaged in another grouping: a few ulps
    np.testing.assert_allclose(np.mean(losses), one["loss"], rtol=1e-6)
    seen = set()
    for rank, r in enumerate(ranks):
        for name, (area, grad) in r["grads"].items():
            seen.add(name)
            want = one["grads"][name][tuple(slice(b, e) for b, e in area)]
            # float32 gradients summed over microbatches and ranks in another order
            np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6, err_msg=f"rank {rank}: {name}")
    assert seen == set(one["grads"]), set(one["grads"]) ^ seen  # every parameter on some stage
