"""fully_shard at FSDP2's cost: one all-gather and one reduce-scatter per unit and
gathering, whatever the number of parameters (``core/fully_shard/param_group.py``).

The collectives are counted on this process's platform object (its methods wrapped
for the duration of a step: ``tests/collective_counts.py``), so the
count is what core issued through the contract on either backend. The model of
``_models`` has 3 units (2 blocks, the root) and 12 sharded parameters of uneven rows
(7 and 5 over 2 and 4 ranks): per-parameter collectives would be 12 each way. The
values these collectives produce are checked by the parity suites
(``test_fully_shard.py``), which run the same path; here the gradients of the counted
step are checked against one process as well, so a count is never bought with a wrong
result.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.fully_shard import MixedPrecisionPolicy, fully_shard, hsdp_state
from hyper_parallel.platform import get_platform
from tests.collective_counts import count_collectives
from tests.fully_shard._models import Trainer, assert_shard_grads, build, weights

_COUNTED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
# float32 gradients of one step, summed over ranks in another order: a few ulps. The
# low-precision run computes in bfloat16 (torch) / float16 (MindSpore): a few eps of those.
TOL = dict(rtol=1e-4, atol=1e-5)
LOW = {"torch": ("bfloat16", dict(rtol=3e-2, atol=3e-2)), "mindspore": ("float16", dict(rtol=3e-3, atol=3e-3))}


def _batch(step: int) -> np.ndarray:
    return np.random.default_rng(300 + step).standard_normal((8, 5)).astype(np.float32)


def count_step(config: dict) -> dict:
    """Shard the model as ``config`` says, run three forward+backward steps (the first
    has no previous step to order the reduce-scatter waits by, so the second may hold
    more buffers at once); the last step's collective counts, the units and parameters."""
    p = get_platform()
    n, r = p.world_size(), p.rank()
    shape = config.get("mesh", (n,))
    mesh = init_device_mesh(p.device_type, shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    low = config.get("mp") == "low"
    policy = (MixedPrecisionPolicy(param_dtype=LOW[p.framework][0], reduce_dtype="float32")
              if low else MixedPrecisionPolicy())
    tol = LOW[p.framework][1] if low else TOL
    model = build(p, weights())
    reshard = config.get("reshard", True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    policy_root = (MixedPrecisionPolicy(param_dtype=LOW[p.framework][0], reduce_dtype="float32",
                                        output_dtype="float32") if low else policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy_root, ignored_params=[model.gain])
    units = [hsdp_state(m) for m in [*model.blocks, model]]
    trainer = Trainer(p, model)
    ref = build(p, weights())
    ref_trainer = Trainer(p, ref)
    replicas = shape[0] if len(shape) == 2 else 1
    per = 8 // (n // replicas * replicas)
    counts, buffers = None, None
    for step in range(3):
        _, counts = count_collectives(lambda: trainer.backward(_batch(step)[r * per:(r + 1) * per]),
                                      (*_COUNTED, "cat"))
        copies = counts.pop("cat")
        ref_trainer.backward(_batch(step))
        assert_shard_grads(trainer, ref_trainer, units, tol, f"{config}, step {step}")
        pool = units[-1].context.flat_buffers
        # the flat buffers of the second step serve the third: no new allocation
        assert step < 2 or [id(b) for b in pool.buffers] == buffers, f"{config}: buffers allocated again"
        assert pool.free_count() == len(pool.buffers), f"{config}: a flat buffer still held after the step"
        buffers = [id(b) for b in pool.buffers]
        trainer.step()
        ref_trainer.step()
    return {"counts": counts, "units": len(units), "params": sum(len(s.params) for s in units), "copies": copies}


def check_counts(configs: list[dict]) -> list[dict]:
    return [count_step(config) for config in configs]


# reshard_after_forward=True gathers each unit twice per step (forward, and again for
# its backward), as FSDP2 does; False once. Reduce-scatters: once per unit. HSDP: one
# all-reduce per unit over the replicate axis.
WORLD_2 = [{"reshard": False}, {"reshard": True, "mp": "low"}]
WORLD_4 = [{"mesh": (2, 2), "reshard": False}, {"reshard": 2}]


@pytest.mark.parametrize("world,configs", [(2, WORLD_2), (4, WORLD_4)], ids=["world2", "world4"])
def test_one_collective_per_unit(run_on_ranks, world, configs) -> None:
    results = run_on_ranks(check_counts, configs, world_size=world, timeout_s=600)
    framework = get_platform().framework
    for config, result in zip(configs, results[0]):
        units, counts = result["units"], result["counts"]
        assert result["params"] == 12 and units == 3, result
        gathers = units if config["reshard"] is False else 2 * units
        assert counts["all_gather_into_tensor"] == gathers, (config, counts)
        assert counts["reduce_scatter_tensor"] == units, (config, counts)
        # [Note: flat all-gather copy-in]: at most one copy of a parameter per gather (the
        # copy-out, FSDP2's one copy), made where it is read (GatherParam, a backward's
        # reload), not a copy-out and then a clone (36 here for reshard True before); an
        # int reshard also keeps a block of each parameter after the forward (FSDP2 too)
        bound = result["params"] * (gathers // units + (1 if config["reshard"] not in (True, False) else 0))
        assert result["copies"] <= bound, (config, result["copies"], bound)
        if "mesh" in config and framework == "torch":  # MindSpore CPU's reduce-scatter is an all-reduce inside
            assert counts["all_reduce"] == units, (config, counts)
    assert all(rank_results == results[0] for rank_results in results), results  # every rank issues the same


def test_a_shard_axis_of_one_rank_issues_nothing(run_on_ranks) -> None:
    """World 1 ([Note: a shard axis of one rank]): each rank holds its parameters whole,
    so a step issues no all-gather and no reduce-scatter (FSDP2 issues no collective at
    world 1 either), in full and in low precision; the gradients are still one process's
    (checked in ``count_step``)."""
    configs = [{"reshard": True}, {"reshard": False, "mp": "low"}]
    for config, result in zip(configs, run_on_ranks(check_counts, configs, world_size=1, timeout_s=600)[0]):
        assert result["params"] == 12 and result["units"] == 3, result
        assert result["counts"] == {name: 0 for name in _COUNTED}, (config, result["counts"])


def test_hsdp_with_a_shard_axis_of_one_rank(run_on_ranks) -> None:
    """HSDP on a ``(2, 1)`` mesh: no all-gather, no reduce-scatter; each parameter's
    gradient is all-reduced over the replicate axis (counted on torch: MindSpore CPU's
    collectives are built from all-reduce)."""
    results = run_on_ranks(check_counts, [{"mesh": (2, 1), "reshard": True}], world_size=2, timeout_s=600)
    counts = results[0][0]["counts"]
    assert counts["all_gather_into_tensor"] == 0 and counts["reduce_scatter_tensor"] == 0, counts
    if get_platform().framework == "torch":
        assert counts["all_reduce"] == 12, counts
