"""Activation checkpointing (``core/activation_checkpoint``) on the train job's Llama-style
decoder: a checkpointed model against the same model unwrapped, same seed, same data,
two AdamW steps, on one rank and composed with fully_shard, tensor parallelism and
context parallelism (swept inside one rank function: MindSpore pays seconds per call).

Exact equality: a checkpointed block runs the same operations on the same values
(recomputed, not approximated), the gradients flow through the first forward's graph,
and the collectives (all-reduce, all-to-all, all-gather, reduce-scatter) are the same
ones on the same inputs, so outputs and gradients match bit for bit. A recomputation
that read stale or ungathered parameters, or a gradient reduce-scattered twice, would
not."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from hyper_parallel.core.activation_checkpoint import (CheckpointPhase, CheckpointPolicy,
                                                       apply_activation_checkpointing, checkpoint, checkpoint_phase,
                                                       checkpoint_wrapper, is_checkpointed, remove_checkpoint_wrapper)
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.platform import Capability, get_platform
from hyper_parallel.train.config import Layout
from hyper_parallel.train.data import rank_batch
from hyper_parallel.train.loop import _batch_tensors, _scalar, setup
from hyper_parallel.train.model import build_model
from hyper_parallel.train.optim import local_tensor
from tests.train._ranks import tiny_config

STEPS = 2


def _observe(p, model) -> dict[str, list[str]]:
    """Forward pre-hooks that log the phase they run in: on a module inside block 0
    (runs again in the recomputation) and on block 0 itself (runs once)."""
    log: dict[str, list[str]] = {"inner": [], "block": []}
    p.register_forward_pre_hook(model.layers[0].feed_forward,
                                lambda m, a: log["inner"].append(str(getattr(checkpoint_phase(), "value", None))))
    p.register_forward_pre_hook(model.layers[0], lambda m, a: log["block"].append("call"))
    return log


def _train(run, checkpointed: bool) -> tuple[list[float], list[list[np.ndarray]], dict[str, list[str]]]:
    """``STEPS`` steps of the train job's loop body; the losses, gradients and hook log."""
    p, cfg = run.p, run.cfg
    log = _observe(p, run.model)
    losses, grads = [], []
    for step in range(STEPS):
        batch = rank_batch(run.corpus.train, cfg.seed, step, cfg.batch_size, cfg.seq_len, run.dp_rank, run.dp_size)
        loss, backward = p.vjp(run.model, _batch_tensors(run, batch), run.params)
        calls = len(log["inner"])
        _, step_grads = backward([_scalar(p, 1.0)])
        # one forward per step; the checkpointed block's inside runs again in the backward
        assert len(log["inner"]) == calls + (1 if checkpointed else 0), log
        losses.append(float(p.to_numpy(loss)))
        grads.append([p.to_numpy(local_tensor(g)) for g in step_grads])  # DTensor gradients on torch
        run.optimizer.step(step_grads, 1e-2)
    expected_inner = ["forward", "recompute"] * STEPS if checkpointed else ["None"] * STEPS
    assert log["inner"] == expected_inner, log
    assert log["block"] == ["call"] * STEPS, log  # the block's own hooks (fully_shard's) run once
    return losses, grads, log


def check_parity(layouts: list[dict]) -> list[str]:
    """For each layout: the train job's decoder with every block checkpointed (step 3 of
    the chain, between CP and fully_shard) against the same layout without, bit for bit."""
    p = get_platform()
    done = []
    for degrees in layouts:
        cfg = tiny_config("/tmp/unused", nproc=p.world_size(), layout=Layout(**degrees), steps=STEPS)
        plain_losses, plain_grads, _ = _train(setup(cfg), checkpointed=False)
        run = setup(cfg.replace(activation_checkpointing=True))
        assert all(is_checkpointed(block) for block in run.model.layers)
        losses, grads, _ = _train(run, checkpointed=True)
        np.testing.assert_array_equal(losses, plain_losses, err_msg=f"{degrees}: losses")
        names = [name for name, _ in p.named_parameters(run.model)]
        for step in range(STEPS):
            for name, got, want in zip(names, grads[step], plain_grads[step]):
                np.testing.assert_array_equal(got, want, err_msg=f"{degrees}: step {step} gradient of {name}")
        # fully_shard put the gathered parameters back for the recomputation and took them
        # away when their gradients were final: nothing is left in the modules' instance
        # dicts (both frameworks keep registered parameters elsewhere)
        for name, module in p.named_modules(run.model):
            assert "weight" not in vars(module), f"{degrees}: a gathered {name}.weight outlived the step"
        done.append(str(degrees))
    return done


def test_single_rank(run_on_ranks) -> None:
    assert run_on_ranks(check_parity, [{}], world_size=1) == [["{}"]]


def test_with_fully_shard_tensor_and_context_parallel(run_on_ranks) -> None:
    layouts = [{"dp_shard": 2}, {"tp": 2}, {"cp": 2, "cp_mode": "ulysses"}, {"cp": 2, "cp_mode": "ring"}]
    assert run_on_ranks(check_parity, layouts, world_size=2, timeout_s=600) == [[str(d) for d in layouts]] * 2


def check_api() -> None:
    """The functional form, removal, selection and the refusals, on one rank."""
    p = get_platform()
    cfg = tiny_config("/tmp/unused").model
    model = build_model(p, cfg, 0)
    x = p.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    phases = []

    def fn(t):
        phases.append(checkpoint_phase())
        return (t * t).sum()

    out, backward = p.vjp(lambda t: checkpoint(fn, t), [x])
    (gx,), _ = backward([_scalar(p, 1.0)])
    np.testing.assert_array_equal(p.to_numpy(gx), 2 * p.to_numpy(x))
    assert phases == [CheckpointPhase.FORWARD, CheckpointPhase.RECOMPUTE], phases
    assert checkpoint_phase() is None

    # check_fn selects modules; a module below a selected one is skipped
    names = apply_activation_checkpointing(model, check_fn=lambda m: m is model.layers or "Block" in type(m).__name__)
    assert names == ["layers"], names
    assert remove_checkpoint_wrapper(model.layers) is model.layers and not is_checkpointed(model.layers)
    assert apply_activation_checkpointing(model, fqns=["layers.1", "layers.0"]) == ["layers.0", "layers.1"]
    with pytest.raises(ValueError, match="layers.0 is already checkpointed"):
        apply_activation_checkpointing(model, fqns=["layers.0"])
    with pytest.raises(ValueError, match="no submodule 'layers.7' .* nearest"):
        apply_activation_checkpointing(model, fqns=["layers.7"])
    with pytest.raises(ValueError, match="exactly one of check_fn"):
        apply_activation_checkpointing(model)
    with pytest.raises(ValueError, match="is not checkpointed"):
        remove_checkpoint_wrapper(model.norm)

    # fully_shard first, then checkpointing: refused, before anything is wrapped
    other = build_model(p, cfg, 0)
    mesh = init_device_mesh(p.device_type, (1,))
    fully_shard(other.layers[1].feed_forward, mesh=mesh)
    with pytest.raises(ValueError, match="holds fully sharded modules .*apply activation checkpointing before "
                                         "fully_shard"):
        apply_activation_checkpointing(other, fqns=["layers.0", "layers.1"])
    assert not is_checkpointed(other.layers[0])


def test_api(run_on_ranks) -> None:
    run_on_ranks(check_api, world_size=1)


def check_context_fn_and_refusals() -> None:
    """``context_fn``: the forward runs in its first context, the recomputation in its
    second (torch's semantics, MindFormers' recompute marker); gradients unchanged."""
    p = get_platform()
    entered: list[str] = []

    @contextlib.contextmanager
    def mark(name):
        entered.append(name)
        yield

    def contexts():
        return mark("forward"), mark("recompute")

    x = p.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    _, backward = p.vjp(lambda t: checkpoint(lambda u: (u * u).sum(), t, context_fn=contexts), [x])
    (gx,), _ = backward([_scalar(p, 1.0)])
    np.testing.assert_array_equal(p.to_numpy(gx), 2 * p.to_numpy(x))
    assert entered == ["forward", "recompute"], entered

    cfg = tiny_config("/tmp/unused").model
    model = build_model(p, cfg, 0)
    entered.clear()
    checkpoint_wrapper(model.layers[0], context_fn=contexts)
    tokens = p.from_numpy(np.zeros((1, 4), np.int64))
    _, backward = p.vjp(model, [tokens, tokens, tokens], [param for _, param in p.named_parameters(model)])
    assert entered == ["forward"], entered
    backward([_scalar(p, 1.0)])
    assert entered == ["forward", "recompute"], entered
    with pytest.raises(TypeError, match="return a tuple of two context managers"):
        p.vjp(lambda t: checkpoint(lambda u: u.sum(), t, context_fn=lambda: None), [x])

    assert [policy.value for policy in CheckpointPolicy] == [0, 1, 2, 3, 4]  # torch's values, then MUST_SWAP


def test_context_fn_and_refusals(run_on_ranks) -> None:
    run_on_ranks(check_context_fn_and_refusals, world_size=1)


def check_output_recompute() -> str:
    """``output_recompute=True`` (MindSpore's merging of adjacent recomputed blocks): the
    decoder's two blocks chained so, gradients bit-identical to the plain model, and the
    backward, reaching block 1 first, recomputes block 0 before it (block 1's input is
    recovered by recomputing block 0, not kept); plainly checkpointed, block 1 recomputes
    first. An operator is wrapped as a function. Refused, before anything is wrapped,
    where the platform lacks it (torch)."""
    p = get_platform()
    cfg = tiny_config("/tmp/unused").model
    if Capability.OUTPUT_RECOMPUTE not in p.capabilities():
        model = build_model(p, cfg, 0)
        with pytest.raises(NotImplementedError, match="output_recompute=True is MindSpore's"):
            checkpoint_wrapper(model.layers[0], output_recompute=True)
        assert not is_checkpointed(model.layers[0])
        return "refused"
    plain = decoder_gradients(build_model(p, cfg, 0), sharded=False)
    orders = {}
    for merged in (True, False):
        model = build_model(p, cfg, 0)
        order: list[tuple[int, str]] = []
        for index, block in enumerate(model.layers):
            p.register_forward_pre_hook(block.feed_forward, lambda m, a, i=index: order.append(
                (i, checkpoint_phase().value)))
            checkpoint_wrapper(block, output_recompute=merged)
        assert_gradients_equal(decoder_gradients(model, sharded=False), plain, f"output_recompute={merged}")
        orders[merged] = order[:4]  # the first step
    assert orders[True] == [(0, "forward"), (1, "forward"), (0, "recompute"), (1, "recompute")], orders
    assert orders[False] == [(0, "forward"), (1, "forward"), (1, "recompute"), (0, "recompute")], orders

    square = checkpoint_wrapper(lambda t: t * t, output_recompute=True)
    x = p.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    _, backward = p.vjp(lambda t: square(t).sum(), [x])
    (gx,), _ = backward([_scalar(p, 1.0)])
    np.testing.assert_array_equal(p.to_numpy(gx), 2 * p.to_numpy(x))
    return "merged"


def test_output_recompute(run_on_ranks) -> None:
    want = "merged" if Capability.OUTPUT_RECOMPUTE in get_platform().capabilities() else "refused"
    assert run_on_ranks(check_output_recompute, world_size=1) == [want]


def check_units_around_checkpointed_blocks(units: str) -> None:
    """Every block checkpointed, then sharded against the same sharding without
    checkpointing, bit for bit (the same operations on the same values, see the module
    docstring), over two steps of gradients. ``units``: ``"inside"``, MindFormers' order
    (fully_shard on the norms inside each block, units inside a checkpointed forward, then
    on each block and the root); ``"root"``, one unit over the checkpointed blocks (the
    checkpointed forwards begin inside its forward, so it hooks the modules holding its
    parameters for their recomputation: [Note: recomputation and gathered parameters] in
    core/fully_shard/hsdp_state)."""
    p = get_platform()
    cfg = tiny_config("/tmp/unused").model
    mesh = init_device_mesh(p.device_type, (p.world_size(),))

    def run(checkpointed: bool) -> list[list[np.ndarray]]:
        model = build_model(p, cfg, 0)
        if checkpointed:
            for block in model.layers:
                checkpoint_wrapper(block)
        if units == "inside":
            for block in model.layers:
                fully_shard(block.attention_norm, mesh=mesh)
                fully_shard(block.ffn_norm, mesh=mesh)
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return decoder_gradients(model, sharded=True)

    assert_gradients_equal(run(checkpointed=True), run(checkpointed=False), "checkpointed")


def decoder_gradients(model, sharded: bool) -> list[list[np.ndarray]]:
    """``STEPS`` backwards of the train decoder ``model`` on fixed batches of 2 rows per
    rank: this rank's rows when ``sharded``, else the first rank's; the gradients."""
    p = get_platform()
    cfg = tiny_config("/tmp/unused").model
    r = p.rank() if sharded else 0
    rng = np.random.default_rng(7)
    batches = [rng.integers(0, cfg.vocab_size, size=(2 * p.world_size(), 9)) for _ in range(STEPS)]
    params = [param for _, param in p.named_parameters(model)]
    out = []
    for tokens in batches:
        rows = tokens[r * 2:(r + 1) * 2]
        positions = np.broadcast_to(np.arange(rows.shape[1] - 1), (rows.shape[0], rows.shape[1] - 1)).copy()
        inputs = [p.from_numpy(rows[:, :-1]), p.from_numpy(positions), p.from_numpy(rows[:, 1:])]
        _, backward = p.vjp(model, inputs, params)
        _, grads = backward([_scalar(p, 1.0)])
        out.append([p.to_numpy(local_tensor(g)) for g in grads])
        if p.framework == "torch":
            for param in params:
                param.grad = None
    return out


def assert_gradients_equal(got: list[list[np.ndarray]], want: list[list[np.ndarray]], what: str) -> None:
    assert len(got[0]) == len(want[0]) > 0
    for step in range(STEPS):
        for index, (g, w) in enumerate(zip(got[step], want[step])):
            np.testing.assert_array_equal(g, w, err_msg=f"{what}: step {step}, gradient {index}")


@pytest.mark.parametrize("units", ["inside", "root"])
def test_units_around_checkpointed_blocks(run_on_ranks, units: str) -> None:
    run_on_ranks(check_units_around_checkpointed_blocks, units, world_size=2, timeout_s=600)
