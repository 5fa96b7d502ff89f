"""shard_module / ShardingPlan: parity of a sharded MLP with one process; redistribution
at module edges; errors raised on every rank before any collective."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel import Replicate, Shard, ShardingPlan
from tests.shard._ranks import (check_callable, check_dfunction, check_errors, check_mlp_parity,
                               check_submodule_output)

# (batch, d_in, hidden, d_out): hidden 7 and d_out 5 shard unevenly over 2 and 4 ranks,
# batch 5 over dp 2
UNEVEN = (5, 6, 7, 5)
EVEN = (4, 6, 8, 4)
MESHES = [((1,), UNEVEN, "tp1"), ((2,), UNEVEN, "tp2"), ((4,), UNEVEN, "tp4"), ((2, 2), UNEVEN, "dp2xtp2"),
          ((2, 2), EVEN, "dp2xtp2-even")]
# ``nested`` shards one dim over both axes of a 2-D mesh
CASES = [pytest.param(mesh, sizes, form, id=f"{name}-{form}") for mesh, sizes, name in MESHES
         for form in ("placements", "alias", "nested") if form != "nested" or len(mesh) == 2]


@pytest.mark.parametrize("mesh_shape,sizes,form", CASES)
def test_mlp_parity(run_on_ranks, mesh_shape, sizes, form: str) -> None:
    world = int(np.prod(mesh_shape))
    assert run_on_ranks(check_mlp_parity, mesh_shape, form, sizes, world_size=world, timeout_s=300) == [1] * world


@pytest.mark.parametrize("world_size", [2, 4])
def test_callable_and_submodule_output(run_on_ranks, world_size: int) -> None:
    assert run_on_ranks(check_callable, world_size, world_size=world_size) == [1] * world_size
    assert run_on_ranks(check_submodule_output, world_size, world_size=world_size) == [1] * world_size


def test_errors_on_every_rank(run_on_ranks) -> None:
    assert run_on_ranks(check_errors, world_size=4, timeout_s=300) == [1] * 4


def test_dfunction(run_on_ranks) -> None:
    assert run_on_ranks(check_dfunction, world_size=2) == [1] * 2


@pytest.mark.parametrize("kwargs,error,needles", [
    (dict(plan={"w": Shard(0)}), TypeError, ["plan['w']", "single Placement", "(Shard(dim=0),)"]),
    (dict(plan={"w": (Shard(0), "tp")}), TypeError, ["mixes Placements"]),
    (dict(plan={"w": (("tp", "None"),)}), TypeError, ["mixes 'None' with axis names"]),
    (dict(plan={"w": 0}), TypeError, ["is a int", "tuple of Placements"]),
    (dict(plan=[("w", (Shard(0),))]), TypeError, ["plan is a list", "give a dict"]),
    (dict(input_plan={"fc1": (Shard(0),)}), ValueError, ["input_plan key 'fc1'", "'<submodule path>.input'"]),
    (dict(input_plan={"fc1.output": (Shard(0),)}), ValueError, ["input_plan key 'fc1.output'"]),
    (dict(output_plan={"a..output": (Shard(0),)}), ValueError, ["empty path component"]),
    (dict(output_plan={"output": [(Shard(0),), Shard(1)]}), TypeError,
     ["output_plan['output'][1]", "single Placement"]),
    (dict(return_local_tensor="fc1"), TypeError, ["must be a list of submodule paths"]),
], ids=["bare-placement", "mixed", "none-in-group", "not-a-spec", "plan-not-dict", "input-key", "output-in-input",
        "empty-path", "bare-in-list", "return-local-str"])
def test_sharding_plan_checks(kwargs, error, needles) -> None:
    """Checked at construction: no mesh, module or ranks needed."""
    with pytest.raises(error) as err:
        ShardingPlan(**kwargs)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_sharding_plan_is_data() -> None:
    """Plan fields keep what the caller wrote (MindFormers reads them back), copied."""
    params = {"weight": (Shard(0),), "bias": ("tp",)}
    plan = ShardingPlan(plan=params, input_plan={"input": ("dp", "None")}, return_local_tensor=("fc1",))
    params["extra"] = (Replicate(),)
    assert plan.plan == {"weight": (Shard(0),), "bias": ("tp",)} and plan.plan["weight"][0] == Shard(0)
    assert plan.return_local_tensor == ["fc1"] and plan.output_plan is None
    with pytest.raises(AttributeError):
        plan.plan = {}  # frozen
