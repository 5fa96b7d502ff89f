"""Selective activation checkpointing (``checkpoint_wrapper(policy_fn=)``): a policy
keeping the matrix products and attention of each block, on the train job's decoder,
against the same decoder unwrapped and fully recomputed.

Exact equality: a kept output is the forward's own tensor, a recomputed one the same
operation on the same values, so gradients match bit for bit. What is checked besides:
the policy saw the framework's operations with their outputs, and the backward ran
fewer operations than under full recomputation (the kept ones were not rerun), counted
by a dispatch mode of the framework's around the backward (torch ``TorchDispatchMode``,
MindSpore ``MsDispatchMode``; the recomputation's own mode is the inner one, so only the
operations it really runs reach the counter)."""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pytest

from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, SelectiveCheckpointContext, checkpoint,
                                                       checkpoint_wrapper)
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.platform import get_platform
from hyper_parallel.train.loop import _scalar
from hyper_parallel.train.model import build_model
from tests.activation_checkpoint.test_activation_checkpoint import assert_gradients_equal, decoder_gradients
from tests.train._ranks import tiny_config

#: substrings of the names of the operations the policy keeps (torch ``aten.mm.default``,
#: ``aten.addmm.default``, ``aten._scaled_dot_product_flash_attention_for_cpu.default``;
#: MindSpore ``MatMulExt``, ``Dense``, ``BatchMatMulExt``)
KEPT = ("aten.mm", "aten.addmm", "aten.bmm", "matmul", "dense", "attention")


def op_name(op) -> str:
    name = op.name
    return (name if isinstance(name, str) else str(op)).lower()


@contextlib.contextmanager
def count_ops():
    """Counts, per operation name, the operations run inside (see the module docstring)."""
    p = get_platform()
    counts: collections.Counter = collections.Counter()
    if p.framework == "torch":
        from torch.utils._python_dispatch import TorchDispatchMode

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[op_name(func)] += 1
                return func(*args, **(kwargs or {}))
    else:
        from mindspore.utils import MsDispatchMode

        class Count(MsDispatchMode):
            def __ms_dispatch__(self, func, args, kwargs=None):
                counts[op_name(func)] += 1
                return func(*args, **kwargs) if kwargs else func(*args)
    with Count():
        yield counts


def check_selective(sharded: bool) -> dict:
    """The decoder's blocks selectively checkpointed (``KEPT`` saved); with ``sharded``,
    MindFormers' order: the norms inside the blocks, the blocks and the root fully
    sharded after. Against the same model unwrapped and fully recomputed."""
    p = get_platform()
    cfg = tiny_config("/tmp/unused").model
    mesh = init_device_mesh(p.device_type, (p.world_size(),)) if sharded else None
    decisions: collections.Counter = collections.Counter()

    def policy(ctx, op, *args, **kwargs):
        assert isinstance(ctx, SelectiveCheckpointContext) and not ctx.is_recompute
        assert ctx.op_output is not None
        keep = any(word in op_name(op) for word in KEPT)
        decisions[keep] += 1
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def build(mode: str):
        model = build_model(p, cfg, 0)
        for block in model.layers:
            if mode != "plain":
                checkpoint_wrapper(block, policy_fn=policy if mode == "selective" else None)
            if sharded:
                fully_shard(block.attention_norm, mesh=mesh)
                fully_shard(block.ffn_norm, mesh=mesh)
                fully_shard(block, mesh=mesh)
        if sharded:
            fully_shard(model, mesh=mesh)
        return model

    backward_ops = {}
    grads = {}
    if sharded:
        # every op kept, fully_shard's included: its hooks gather on another path in the
        # recomputation than in the forward, and are not matched (a kept gather handed to
        # the recomputation's other path would shift every later match)
        policy_all = policy
        policy = lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_SAVE  # noqa: E731
        grads["keep-all"] = decoder_gradients(build("selective"), sharded=sharded)
        policy = policy_all
    for mode in ("plain", "full", "selective"):
        with count_ops() as counts:
            grads[mode] = decoder_gradients(build(mode), sharded=sharded)
        backward_ops[mode] = sum(n for name, n in counts.items() if any(word in name for word in KEPT))
    assert_gradients_equal(grads["selective"], grads["plain"], "selective against plain")
    assert_gradients_equal(grads["full"], grads["plain"], "full recomputation against plain")
    if sharded:
        assert_gradients_equal(grads["keep-all"], grads["plain"], "every op kept against plain")
    assert decisions[True] > 0 and decisions[False] > 0, decisions
    return {"ops": backward_ops, "kept": decisions[True]}


@pytest.mark.parametrize("world,sharded", [(1, False), (2, True)], ids=["one-rank", "fully-shard-2"])
def test_selective_checkpoint(run_on_ranks, world, sharded) -> None:
    for rank in run_on_ranks(check_selective, sharded, world_size=world, timeout_s=600):
        ops = rank["ops"]
        # operations of the kept kinds, forward and backward: each kept one ran once (in the
        # forward), as without checkpointing; fully recomputed, most ran twice (the
        # recomputation stops after the last saved tensor the backward needs)
        assert ops["selective"] == ops["plain"] < ops["full"] <= ops["plain"] + rank["kept"], rank


def check_refusals() -> None:
    """A policy answering ``MUST_SWAP`` or something else than a policy raises at the
    op, naming it; a policy that is not callable raises at wrap time."""
    p = get_platform()
    x = p.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    for answer, error, match in ((CheckpointPolicy.MUST_SWAP, ValueError, "answered MUST_SWAP .*swap_wrapper"),
                                 ("save", ValueError, "answered 'save'")):
        with pytest.raises(error, match=match):
            p.vjp(lambda t, a=answer: checkpoint(lambda u: (u * u).sum(), t, policy_fn=lambda *_, **__: a), [x])
    model = build_model(p, tiny_config("/tmp/unused").model, 0)
    with pytest.raises(TypeError, match="policy_fn='matmul' is not callable"):
        checkpoint_wrapper(model.layers[0], policy_fn="matmul")
    # a bool answer is read as torch reads it: True keeps the output
    _, backward = p.vjp(lambda t: checkpoint(lambda u: (u * u).sum(), t, policy_fn=lambda *_, **__: True), [x])
    (gx,), _ = backward([_scalar(p, 1.0)])
    np.testing.assert_array_equal(p.to_numpy(gx), 2 * p.to_numpy(x))


def test_refusals(run_on_ranks) -> None:
    if get_platform().framework == "mindspore":
        pytest.skip("an exception raised inside mindspore.value_and_grad's forward leaves the worker unable to "
                    "record again; the refusals are framework-independent (core's policy translation)")
    run_on_ranks(check_refusals, world_size=1)
