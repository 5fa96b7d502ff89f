"""A few training steps of the tiny MindFormers ``GPTModel`` (``test_gptmodel.py``) with
MindFormers' own ``AdamW`` (``pynative/optimizer/adamw.py``, which updates the local
pieces inside ``SkipDTensorDispatch``): one rank, and MindFormers' ``parallelize_gptmodel``
on 2 and 4 ranks with FSDP, tensor parallel 2 x FSDP 2 (the MLA model of
``test_gptmodel_tp``), context parallel 2 x FSDP 2 (the model of ``test_gptmodel_cp``)
and pipeline parallel 2 (x FSDP 2) through MindFormers' ``apply_pp`` (its
``ScaledLossPipelineStage`` on our ``PipelineStage``, our ``Schedule1F1B`` run as its
trainer's ``compute_pp_loss`` does: ``schedule.run(**batch)``, the loss ``output[0]``),
step by step as its trainer does (``pynative/trainer/trainer.py``): the loss
differentiated with a backward seed (the loss sense), the optimizer fed
``get_grad(param)`` (the float32 ``param.main_grad`` under FSDP), then ``m.zero_grad()``.
The losses of every step agree with one rank's within 1e-5, or within four times the
one-rank run's own spread under a 1-ulp change of its backward seed where that is larger
(AdamW amplifies rounding; see ``test_adamw_steps``).

The loss sense. MindFormers' ``get_loss_sense`` seeds the backward with
``1 / (dp * tp * cp)``: under upstream hyper-parallel the backward of the all-gather
that replicates the logits over tp sums the tp ranks' gradients (MindSpore's
``AllGather`` bprop, a reduce-scatter), and the ``1 / tp`` undoes that (see the docstring
of MindFormers' ``_vocab_parallel_ce_grad``). Here, as in torch's DTensor, a tensor
replicated over tp is one value, whose gradient is replicated too: the backward of that
all-gather takes this rank's slice, and the seed is ``1 / (dp * cp)``, one share per
data-parallel and context-parallel piece of the batch. With MindFormers' sense the
gradients would be ``1 / tp`` of the one-rank ones (``docs/mindformers.md``).

Not MindFormers' ``Trainer`` itself: it calls ``enable_mindspore_backward_compat`` and
``loss.backward`` (refused here, see ``docs/mindformers.md``), and its gradient-norm
clipping stacks per-tensor norms with ``mint.stack`` (no CPU kernel in MindSpore 2.10);
the test takes gradients with ``mindspore.value_and_grad`` and does not clip.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.mindformers.test_gptmodel import SEQ, batch, build_gpt, gpt_config, parallelize, pytestmark  # noqa: F401
from tests.mindformers.test_gptmodel_cp import _attention_classes, cp_config
from tests.mindformers.test_gptmodel_pp import MICROBATCHES, causal_lm_class
from tests.mindformers.test_gptmodel_tp import build_mla_gpt


STEPS, LR, ROWS = 3, 1e-2, 4


def _inputs(rows: slice = slice(None)) -> dict:
    """``rows`` of a batch of ``ROWS`` (four data-parallel ranks hold one each), with the
    ``position_ids`` the CP model's learned position embedding reads."""
    ids, labels = batch(ROWS)
    return {"input_ids": ids[rows], "labels": labels[rows],
            "position_ids": np.tile(np.arange(SEQ, dtype=np.int32), (len(range(ROWS)[rows]), 1))}


def _build(model: str, parallelism):
    """The tiny model of ``model`` ("gpt", "mla" or "cp") for ``parallelism`` (``None``:
    one rank)."""
    if model == "mla":
        return build_mla_gpt()
    if model == "cp":
        return build_gpt(cp_config(parallelism), *_attention_classes())
    if model == "pp":
        return causal_lm_class()(gpt_config())
    return build_gpt()


def _train(model, inputs: dict, sense: float, sharded: bool) -> list[float]:
    """``STEPS`` steps of MindFormers' AdamW on ``inputs`` (``model(**inputs)``, as the
    trainer calls it); this rank's losses."""
    import mindspore as ms
    from mindformers.pynative.optimizer.adamw import AdamW
    from mindformers.pynative.trainer.utils import get_grad

    from hyper_parallel import DTensor

    params = list(model.trainable_params())
    optimizer = AdamW(params, learning_rate=LR, weight_decay=0.1)
    names = sorted(inputs)

    def loss_fn(*values):
        loss = model(**dict(zip(names, values)))[0]
        if isinstance(loss, DTensor):  # replicated over tp (MindFormers' loss plan)
            loss = loss.to_local()
        return loss * sense, loss

    step = ms.value_and_grad(loss_fn, grad_position=None, weights=params, has_aux=True)
    losses = []
    for _ in range(STEPS):
        (_, loss), grads = step(*(ms.Tensor(inputs[n]) for n in names))
        losses.append(float(loss.asnumpy().reshape(-1)[0]))
        if sharded:
            # under fully_shard the reduced gradients are on param.main_grad (the
            # trainer's get_grad); value_and_grad's own are the unreduced pieces
            grads = tuple(get_grad(param) for param in params)
        optimizer(grads)
        if hasattr(model, "zero_grad"):  # an HSDPModule under FSDP; a Cell has none
            model.zero_grad()
    return losses


def _train_pipeline(parts: list, schedule, inputs: dict) -> list[float] | None:
    """``STEPS`` steps as MindFormers' trainer runs a pipeline (``compute_pp_loss``):
    ``schedule.run(**batch)`` does this rank's forwards and backwards (seeded by its stages'
    ``loss_scale``), the loss is the mean of the last stage's ``output[0]``; then the optimizer
    on ``get_grad(param)`` and ``zero_grad``. The losses on the last stage's ranks, else ``None``."""
    import mindspore as ms
    from mindformers.pynative.optimizer.adamw import AdamW
    from mindformers.pynative.trainer.utils import get_grad

    params = [param for part in parts for param in part.trainable_params()]
    optimizer = AdamW(params, learning_rate=LR, weight_decay=0.1)
    losses = []
    for _ in range(STEPS):
        outputs = schedule.run(**{name: ms.Tensor(value) for name, value in inputs.items()})
        if outputs:
            losses.append(float(np.mean([out[0].asnumpy() for out in outputs])))
        optimizer(tuple(get_grad(param) for param in params))
        for part in parts:
            part.zero_grad()
    return losses or None


def check_train_one_rank(model: str, sense: float = 1.0) -> list[float]:
    return _train(_build(model, None), _inputs(), sense, False)


def check_train_parallel(model: str, data_parallel: int, tensor_parallel: int = 1, context_parallel: int = 1,
                         pipeline_parallel: int = 1) -> list[float] | None:
    """MindFormers' ``parallelize_gptmodel`` with these degrees (``test_gptmodel.parallelize``),
    this rank's rows of the batch (rank ``= ((pp_index * dp + dp_index) * cp + cp_index) * tp
    + tp_index``: the dense mesh ``(pp, dp_replicate, fsdp, cp, tp)``), the seed
    ``1 / (dp * cp)``; under pipeline parallelism the stages' own seed (MindFormers'
    ``loss_scale``, ``1 / (dp * microbatches)`` with ``gradient_accumulation_steps``
    = microbatches, as its trainer sets them)."""
    from hyper_parallel.platform import get_platform

    p = get_platform()
    inner = data_parallel * tensor_parallel * context_parallel
    assert p.world_size() == inner * pipeline_parallel
    degrees = {"data_parallel": data_parallel, "tensor_parallel": tensor_parallel,
               "context_parallel": context_parallel}
    if pipeline_parallel > 1:
        degrees.update(pipeline_parallel=pipeline_parallel, pipeline_parallel_microbatch_size=MICROBATCHES,
                       gradient_accumulation_steps=MICROBATCHES)
    parallel = parallelize(lambda parallelism: _build(model, parallelism), **degrees)
    dp_index = p.rank() % inner // (tensor_parallel * context_parallel)
    rows = slice(dp_index * ROWS // data_parallel, (dp_index + 1) * ROWS // data_parallel)
    if pipeline_parallel > 1:
        return _train_pipeline(*parallel, _inputs(rows))
    return _train(parallel, _inputs(rows), 1.0 / (data_parallel * context_parallel), True)


@pytest.mark.parametrize("model,degrees,world", [
    ("gpt", (2,), 2), ("gpt", (4,), 4), ("mla", (2, 2), 4), ("cp", (2, 1, 2), 4), ("pp", (1, 1, 1, 2), 2),
    ("pp", (2, 1, 1, 2), 4)],
    ids=["fsdp2", "fsdp4", "tp2-fsdp2", "cp2-fsdp2", "pp2", "pp2-fsdp2"])
def test_adamw_steps(run_on_ranks, model, degrees, world) -> None:
    one = run_on_ranks(check_train_one_rank, model, world_size=1, timeout_s=300)[0]
    ranks = [losses for losses in run_on_ranks(check_train_parallel, model, *degrees, world_size=world,
                                               timeout_s=600) if losses is not None]  # pp: the last stage's
    assert len(ranks) == world // (degrees[3] if len(degrees) > 3 else 1), ranks
    assert one[-1] < one[0], one  # it trains
    # One rank's own reproducibility: AdamW's first steps are close to sign descent at this
    # learning rate, so a gradient component that is a sum cancelling to rounding level
    # moves its weight by +-LR whichever way rounding tips it. A 1-ulp change of the seed
    # moves the one-rank losses of later steps by more than 1e-5 (measured on the CP model:
    # 4.2e-5 relative at step 3, LR 1e-2, eps 1e-8 or 1e-6); the sharded sums differ from one
    # rank's in order by the same few ulps. So each step is held to 1e-5, or to four times
    # the one-rank run's own spread under such seeds where that is larger; a wrong
    # gradient moves the losses by far more (one rank's share weighted 2% too much fails
    # every case here).
    spread = np.zeros(STEPS)
    for sense in (1.0 + 2.0**-20, 1.0 - 2.0**-21):
        other = run_on_ranks(check_train_one_rank, model, sense, world_size=1, timeout_s=300)[0]
        spread = np.maximum(spread, np.abs(np.asarray(other) / one - 1.0))
    # every rank holds the same number of tokens of its data-parallel and context-parallel
    # share, none masked (tp ranks hold the same): the mean of the ranks' mean losses is
    # the batch's
    error = np.abs(np.mean(ranks, axis=0) / one - 1.0)
    tolerance = np.maximum(1e-5, 4.0 * spread)
    assert error[0] <= 1e-5 and np.all(error <= tolerance), (error, tolerance, spread)
