"""Activation swap (``core/activation_checkpoint/swap``) on the train job's Llama-style
decoder: swapped blocks against the same model unswapped, same seed, same data, two
steps of gradients, on one rank and under fully_shard (MindFormers' order: blocks
swapped, then fully_shard on the norms inside them, on the blocks and on the root).

Exact equality: swapping stores the saved tensors elsewhere and hands the same values
back, so every gradient matches bit for bit. On CPU backends host memory is device
memory (``platform.to_device`` returns the tensor itself), so what is checked here is
which tensors are taken, that each comes back where it was saved, and when the groups
move (the counts of ``swap_stats``); the copies and the memory they free run on
accelerators.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.activation_checkpoint import (CheckpointPolicy, SwapManager, checkpoint_wrapper, swap_stats,
                                                       swap_wrapper)
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.platform import get_platform
from hyper_parallel.train.model import build_model
from hyper_parallel.train.optim import local_tensor
from tests.activation_checkpoint.test_activation_checkpoint import STEPS
from tests.activation_checkpoint.test_activation_checkpoint import assert_gradients_equal as _assert_equal
from tests.activation_checkpoint.test_activation_checkpoint import decoder_gradients as _gradients
from tests.train._ranks import tiny_config


def _recorder(offered: list[np.ndarray]):
    """A policy swapping everything and keeping the values it was offered."""
    p = get_platform()

    def record(tensor):
        offered.append(p.to_numpy(tensor))
        return CheckpointPolicy.MUST_SWAP

    return record


def _params_offered(offered: list[np.ndarray]) -> list[str]:
    """The decoder's parameters (fresh, same seed) whose values, or transpose, a policy
    was offered: none should be (parameters are not swapped, gathered ones are
    fully_shard's)."""
    p = get_platform()
    model = build_model(p, tiny_config("/tmp/unused").model, 0)
    found = []
    for name, param in p.named_parameters(model):
        value = p.to_numpy(local_tensor(param))
        if any(a.shape == v.shape and np.array_equal(a, v) for a in offered for v in (value, value.T)):
            found.append(name)
    return found


def _swap_blocks(model, chain: bool, policy_fn=None) -> None:
    for block in model.layers:
        swap_wrapper(block, policy_fn=policy_fn)
    if chain:
        for first, second in zip(model.layers[:-1], model.layers[1:]):
            SwapManager().set_forward_prefetch_layer(first, second)
            SwapManager().set_forward_prefetch_layer(first, second)  # again: nothing changes


def check_single_rank() -> dict[str, list[tuple[int, ...]]]:
    """Chained, unchained, with a policy, an operator, and next to a checkpointed block."""
    p = get_platform()
    cfg = tiny_config("/tmp/unused").model
    plain = _gradients(build_model(p, cfg, 0), sharded=False)
    counts: dict[str, list[tuple[int, ...]]] = {}

    def stats(model) -> list[tuple[int, ...]]:
        return [(s.tensors_swapped, s.tensors_kept, s.offloads, s.prefetches, s.loads_on_use)
                for s in map(swap_stats, model.layers)]

    # a chain: block 0 copied to host after its forward, back when the backward reaches
    # block 1; block 1, the chain's last, is not swapped
    model = build_model(p, cfg, 0)
    offered: list[np.ndarray] = []
    _swap_blocks(model, chain=True, policy_fn=_recorder(offered))
    _assert_equal(_gradients(model, sharded=False), plain, "chained")
    assert offered and not _params_offered(offered), _params_offered(offered)
    counts["chained"] = stats(model)
    first = swap_stats(model.layers[0])
    assert first.tensors_swapped > 0 and first.bytes_swapped > 0, first
    assert (first.offloads, first.prefetches, first.loads_on_use) == (STEPS, STEPS, 0), first
    assert stats(model)[1] == (0, 0, 0, 0, 0), stats(model)

    # block 0 swapped and linked to block 1, which is not swapped (MindFormers links the
    # last swapped layer to the next one): block 1 marks when block 0's copies run
    model = build_model(p, cfg, 0)
    swap_wrapper(model.layers[0])
    SwapManager().set_forward_prefetch_layer(model.layers[0], model.layers[1])
    _assert_equal(_gradients(model, sharded=False), plain, "followed by an unswapped block")
    alone = swap_stats(model.layers[0])
    assert (alone.tensors_swapped, alone.offloads, alone.prefetches, alone.loads_on_use) == (
        first.tensors_swapped, STEPS, STEPS, 0), alone
    with pytest.raises(ValueError, match="is linked by SwapManager already"):
        swap_wrapper(model.layers[1])

    # unchained: each block copies out at its forward's end, back at its first use
    model = build_model(p, cfg, 0)
    _swap_blocks(model, chain=False)
    _assert_equal(_gradients(model, sharded=False), plain, "unchained")
    counts["unchained"] = stats(model)
    for swapped, kept, offloads, prefetches, on_use in stats(model):
        assert swapped == first.tensors_swapped and kept == 0, stats(model)
        assert (offloads, prefetches, on_use) == (STEPS, 0, STEPS), stats(model)

    # a policy keeping the 4-D saved tensors (the attention's) on the device, as
    # MindFormers keeps its masks
    seen: list[int] = []

    def keep_4d(tensor):
        seen.append(len(tensor.shape))
        return CheckpointPolicy.MUST_SAVE if len(tensor.shape) == 4 else CheckpointPolicy.MUST_SWAP

    model = build_model(p, cfg, 0)
    _swap_blocks(model, chain=False, policy_fn=keep_4d)
    _assert_equal(_gradients(model, sharded=False), plain, "policy")
    kept = swap_stats(model.layers[0])
    assert kept.tensors_kept == seen.count(4) // len(model.layers) > 0, (kept, seen)
    assert kept.tensors_swapped + kept.tensors_kept == first.tensors_swapped, (kept, first)

    # an operator (a callable, not a module) held by a block: its calls are swapped
    model = build_model(p, cfg, 0)
    block = model.layers[0]
    swapped = swap_wrapper(block.feed_forward.forward if p.framework == "torch" else block.feed_forward.construct)
    with pytest.raises(ValueError, match="is a wrapped callable"):
        SwapManager().set_forward_prefetch_layer(swapped, block)
    object.__setattr__(block.feed_forward, "forward" if p.framework == "torch" else "construct", swapped)
    _assert_equal(_gradients(model, sharded=False), plain, "operator")
    assert swap_stats(swapped).tensors_swapped > 0 and swap_stats(swapped).loads_on_use == STEPS

    # a checkpointed block before a swapped one: the checkpoint keeps nothing to swap,
    # the swapped block is unchained
    model = build_model(p, cfg, 0)
    checkpoint_wrapper(model.layers[0])
    swap_wrapper(model.layers[1])
    _assert_equal(_gradients(model, sharded=False), plain, "checkpointed then swapped")
    assert swap_stats(model.layers[1]).tensors_swapped == first.tensors_swapped

    # refusals
    with pytest.raises(ValueError, match="is already swapped"):
        swap_wrapper(model.layers[1])
    with pytest.raises(ValueError, match="is not swapped; call swap_wrapper"):
        swap_stats(model.layers[0])
    with pytest.raises(ValueError, match="is not swapped; call swap_wrapper"):
        SwapManager().set_forward_prefetch_layer(model.layers[0], model.layers[1])
    with pytest.raises(ValueError, match="each module has one neighbour on each side"):
        SwapManager().set_forward_prefetch_layer(model.layers[1], model.norm)
        SwapManager().set_forward_prefetch_layer(model.layers[1], model.layers[0])
    with pytest.raises(ValueError, match="are the same module"):
        SwapManager().set_forward_prefetch_layer(model.layers[1], model.layers[1])
    with pytest.raises(TypeError, match="is not callable"):
        swap_wrapper(3)
    return counts


def test_single_rank(run_on_ranks) -> None:
    (counts,) = run_on_ranks(check_single_rank, world_size=1)
    assert set(counts) == {"chained", "unchained"}


def check_fully_shard() -> list[int]:
    """Swapped blocks holding fully sharded norms, then fully sharded themselves, against
    the same sharding unswapped, bit for bit; the gathered parameters are fully_shard's
    (released and gathered again), not swapped: the blocks swap exactly what they swap
    on one rank without fully_shard."""
    p = get_platform()
    cfg = tiny_config("/tmp/unused").model
    mesh = init_device_mesh(p.device_type, (p.world_size(),))

    offered: list[np.ndarray] = []

    def build(swap: bool):
        model = build_model(p, cfg, 0)
        if swap:
            _swap_blocks(model, chain=True, policy_fn=_recorder(offered))
        for block in model.layers:
            fully_shard(block.attention_norm, mesh=mesh)
            fully_shard(block.ffn_norm, mesh=mesh)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    plain = _gradients(build(swap=False), sharded=True)
    model = build(swap=True)
    _assert_equal(_gradients(model, sharded=True), plain, "fully_shard")
    assert offered and not _params_offered(offered), _params_offered(offered)
    alone = build_model(p, cfg, 0)
    _swap_blocks(alone, chain=True)
    _gradients(alone, sharded=True)
    got, want = swap_stats(model.layers[0]), swap_stats(alone.layers[0])
    assert (got.tensors_swapped, got.bytes_swapped) == (want.tensors_swapped, want.bytes_swapped) != (0, 0), (got, want)
    assert (got.offloads, got.prefetches, got.loads_on_use) == (STEPS, STEPS, 0), got
    return [got.tensors_swapped]


def test_fully_shard(run_on_ranks) -> None:
    counts = run_on_ranks(check_fully_shard, world_size=2, timeout_s=600)
    assert counts[0] == counts[1], counts


def check_policy_refusal() -> None:
    p = get_platform()
    model = build_model(p, tiny_config("/tmp/unused").model, 0)
    swap_wrapper(model.layers[0], policy_fn=lambda tensor: CheckpointPolicy.MUST_RECOMPUTE)
    with pytest.raises(ValueError, match=r"policy_fn returned <CheckpointPolicy.MUST_RECOMPUTE: 2> .* return "
                                         "CheckpointPolicy.MUST_SWAP"):
        _gradients(model, sharded=False)


def test_policy_refusal(run_on_ranks) -> None:
    if get_platform().framework == "mindspore":
        pytest.skip("the refusal is raised inside mindspore.value_and_grad (MindSpore records saved tensors only "
                    "there), which leaves the worker's MindSpore unable to record again for later tests")
    run_on_ranks(check_policy_refusal, world_size=1)
