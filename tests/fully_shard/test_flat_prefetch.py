"""Prefetch on the flat path (issue 37 item 3): a unit's one flat all-gather is issued
ahead of its use, explicitly (``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``) or implicitly (the backward gathers the unit the
forward ran before, as FSDP2's ``_backward_prefetch``), and ``reshard_after_forward`` as an
int prefetches the kept blocks' gather the same way.

Each block gets a forward pre-hook and a backward pre-hook registered *before*
fully_shard, so they run before the unit's own: they record whether the unit's gather
is already in flight there (every parameter's ``pending`` set: issued by another unit's
prefetch, not yet waited for). A prefetched unit must not be gathered a second time
(the all-gathers per step are counted through the platform), and the gradients are
checked against one process, so a prefetch is never bought with a wrong result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard, hsdp_state
from hyper_parallel.platform import get_platform
from tests.collective_counts import count_collectives
from tests.fully_shard._models import N_BLOCKS, Trainer, assert_shard_grads, build, weights

# float32 gradients of one step, summed over ranks in another order: a few ulps
TOL = dict(rtol=1e-4, atol=1e-5)


def _batch(step: int) -> np.ndarray:
    return np.random.default_rng(700 + step).standard_normal((8, 5)).astype(np.float32)


def trace_prefetch(config: dict) -> dict:
    """Shard the blocks and the root with ``config["prefetch"]`` (``"none"``: implicit
    backward prefetch switched off; ``"implicit"``; ``"explicit"``: the root gathers
    block 0 and each block the next in the forward, the reverse in the backward) and
    ``config.get("reshard", True)``; run two steps. The second step's hook records
    ``(phase, block, in_flight)`` and its all-gather count."""
    p = get_platform()
    n, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (n,), mesh_dim_names=("shard",))
    model = build(p, weights())
    blocks = list(model.blocks)
    events: list[tuple[str, int, bool]] = []

    def in_flight(i: int) -> bool:
        return all(hp.pending is not None for hp in hsdp_state(blocks[i]).params)

    def recorder(phase: str, i: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            events.append((phase, i, in_flight(i)))
        return hook

    for i, block in enumerate(blocks):  # before fully_shard: these run before the unit's hooks
        p.register_forward_pre_hook(block, recorder("forward", i))
        p.register_full_backward_pre_hook(block, recorder("backward", i))
    reshard = config.get("reshard", True)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, ignored_params=[model.gain])
    states = [hsdp_state(b) for b in blocks]
    root = hsdp_state(model)
    if config["prefetch"] == "none":
        for state in [*states, root]:
            state.set_modules_to_backward_prefetch([])
    elif config["prefetch"] == "explicit":
        root.set_modules_to_forward_prefetch([blocks[0]])
        root.set_modules_to_backward_prefetch([blocks[-1]])
        for before, after in zip(blocks, blocks[1:]):
            hsdp_state(before).set_modules_to_forward_prefetch([after])
            hsdp_state(after).set_modules_to_backward_prefetch([before])
    trainer, ref_trainer = Trainer(p, model), Trainer(p, build(p, weights()))
    per = 8 // n
    counts: dict[str, int] = {}
    for step in range(2):
        events.clear()
        _, counts = count_collectives(lambda: trainer.backward(_batch(step)[r * per:(r + 1) * per]),
                                      ("all_gather_into_tensor",))
        ref_trainer.backward(_batch(step))
        assert_shard_grads(trainer, ref_trainer, [*states, root], TOL, f"{config}, step {step}")
        trainer.step()
        ref_trainer.step()
    return {"events": events, "all_gathers": counts["all_gather_into_tensor"]}


def _expected(prefetch: str) -> list[tuple[str, int, bool]]:
    forward = [("forward", i, prefetch == "explicit") for i in range(N_BLOCKS)]
    backward = [("backward", i, prefetch != "none") for i in reversed(range(N_BLOCKS))]
    return forward + backward


CONFIGS = [(2, {"prefetch": "none"}), (2, {"prefetch": "implicit"}), (2, {"prefetch": "explicit"}),
           (4, {"prefetch": "implicit", "reshard": 2}), (4, {"prefetch": "explicit", "reshard": 2})]


@pytest.mark.parametrize("world,config", CONFIGS, ids=[f"world{w}-{c['prefetch']}-reshard{c.get('reshard', True)}"
                                                       for w, c in CONFIGS])
def test_prefetch_issues_the_flat_gather_ahead(run_on_ranks, world, config) -> None:
    """The gather of each block is in flight when its forward starts (explicit forward
    prefetch only: FSDP2 has no implicit one) and when its backward starts (implicit or
    explicit backward prefetch; ``"none"`` shows the hook would see it missing), and
    no unit is gathered twice: ``reshard_after_forward=True`` gathers each of the 3 units
    twice per step (forward, backward); ``2`` also gathers each twice (the backward's over
    the kept blocks)."""
    results = run_on_ranks(trace_prefetch, config, world_size=world, timeout_s=300)
    for rank, result in enumerate(results):
        assert result["events"] == _expected(config["prefetch"]), (rank, config, result["events"])
        assert result["all_gathers"] == 2 * (N_BLOCKS + 1), (rank, config, result["all_gathers"])
