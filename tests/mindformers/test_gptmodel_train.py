"""A few training steps of the tiny MindFormers ``GPTModel`` (``test_gptmodel.py``) with
MindFormers' own ``AdamW`` (``pynative/optimizer/adamw.py``, which updates the local
pieces inside ``SkipDTensorDispatch``): one rank, and FSDP on two ranks through
MindFormers' ``parallelize_gptmodel``, step by step as its trainer does
(``pynative/trainer/trainer.py``): the loss differentiated with the backward seed
``get_loss_sense`` gives (``1 / world``), the optimizer fed ``get_grad(param)`` (the
float32 ``param.main_grad`` under FSDP), then ``m.zero_grad()``. The losses of every step
agree with one rank's within 1e-5 (float32; the sharded sums differ in order).

Not MindFormers' ``Trainer`` itself: it calls ``enable_mindspore_backward_compat`` and
``loss.backward`` (refused here, see ``docs/mindformers.md``), and its gradient-norm
clipping stacks per-tensor norms with ``mint.stack`` (no CPU kernel in MindSpore 2.10);
the test takes gradients with ``mindspore.value_and_grad`` and does not clip.
"""

from __future__ import annotations

import numpy as np

from tests.mindformers.test_gptmodel import BATCH, batch, build_gpt, load_pieces, pytestmark  # noqa: F401


STEPS, LR = 3, 1e-2


def _train(model, rows: slice, world: int) -> list[float]:
    """``STEPS`` steps of MindFormers' AdamW on ``rows`` of the batch; this rank's losses."""
    import mindspore as ms
    from mindformers.pynative.optimizer.adamw import AdamW
    from mindformers.pynative.trainer.utils import get_grad

    params = list(model.trainable_params())
    optimizer = AdamW(params, learning_rate=LR, weight_decay=0.1)
    ids, labels = batch()
    ids, labels = ms.Tensor(ids[rows]), ms.Tensor(labels[rows])
    sense = 1.0 / world  # get_loss_sense without pipeline stages

    def loss_fn(i, l):
        loss = model(i, labels=l)[0]
        return loss * sense, loss

    step = ms.value_and_grad(loss_fn, grad_position=None, weights=params, has_aux=True)
    losses = []
    for _ in range(STEPS):
        (_, loss), grads = step(ids, labels)
        losses.append(float(loss.asnumpy().reshape(-1)[0]))
        if world > 1:
            # under fully_shard the reduced gradients are on param.main_grad (the
            # trainer's get_grad); value_and_grad's own are the unreduced pieces
            grads = tuple(get_grad(param) for param in params)
        optimizer(grads)
        if hasattr(model, "zero_grad"):  # an HSDPModule under FSDP; a Cell has none
            model.zero_grad()
    return losses


def check_train_one_rank() -> list[float]:
    model = build_gpt()
    return _train(model, slice(0, BATCH), 1)


def check_train_fsdp() -> list[float]:
    """MindFormers' FSDP (``parallelize_gptmodel`` with data_parallel = world size) on
    a model built under ``ms.DeviceCtx("meta")``, materialised by ``to_empty`` with this
    rank's pieces of the one-rank values (as ``check_gpt_fsdp`` does)."""
    import mindspore as ms
    from mindformers.pynative.base_models.gpt.parallelize import parallelize_gptmodel
    from mindformers.pynative.config.config import (ParallelismConfig, RecomputeCommConfig, RecomputeConfig,
                                                    SwapConfig)
    from mindformers.pynative.distributed.parallel_dims import ParallelDims

    from hyper_parallel.platform import get_platform

    p = get_platform()
    world, me = p.world_size(), p.rank()
    full = {name: param.asnumpy() for name, param in build_gpt().parameters_and_names()}
    with ms.DeviceCtx("meta"):
        model = build_gpt()
    parallelism = ParallelismConfig()
    parallelism.data_parallel = world
    dims = ParallelDims.from_config(parallelism, world)
    parts, *_ = parallelize_gptmodel(model, dims, parallelism, RecomputeConfig(), RecomputeCommConfig(),
                                     SwapConfig())
    model = parts[0]
    model.to_empty(device="CPU")
    load_pieces(model, full, me)
    return _train(model, slice(me * BATCH // world, (me + 1) * BATCH // world), world)


def test_adamw_steps_fsdp_two_ranks(run_on_ranks) -> None:
    one = run_on_ranks(check_train_one_rank, world_size=1, timeout_s=300)[0]
    two = run_on_ranks(check_train_fsdp, world_size=2, timeout_s=300)
    assert one[-1] < one[0], one  # it trains
    # each rank holds half the tokens: the mean of the ranks' mean losses is the batch's
    np.testing.assert_allclose(np.mean(two, axis=0), one, rtol=1e-5)
