"""distribute_module / distribute_parameter: partition_fn sees every submodule, parameters
take rank 0's values (broadcast) and this rank's piece, input_fn/output_fn wrap forward."""

from __future__ import annotations

import numpy as np

from hyper_parallel.core.dtensor import (DTensor, Replicate, Shard, distribute_module, distribute_parameter,
                                         init_device_mesh)
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import chunk
from tests.platform_contract._models import build_mlp, mlp_numpy, mlp_weights


def check_distribute_module() -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (n,))
    rank0 = mlp_weights(4, 5, 3)
    mine = {name: value + r for name, value in rank0.items()}  # ranks disagree; rank 0 wins
    model = build_mlp(p, mine)
    seen: list[str] = []

    def partition(fqn, submodule, device_mesh):
        seen.append(fqn)
        for name, _ in list(p.named_parameters(submodule)):
            if "." not in name:
                distribute_parameter(submodule, name, device_mesh, [Replicate()])

    # as with torch's distribute_module, the module computes on DTensors: input_fn wraps
    # the input, the parameters are replicated DTensors, output_fn takes the local result
    distribute_module(model, mesh, partition,
                      input_fn=lambda mod, args, m: (DTensor.from_local(args[0] * 2.0, m, [Replicate()]),),
                      output_fn=lambda mod, out, m: out.to_local() + 1.0)
    assert seen == ["", "fc1", "fc2"], seen
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    # float32 framework GEMMs against numpy's: summation order differs by a few ulps.
    np.testing.assert_allclose(p.to_numpy(model(p.from_numpy(x))), mlp_numpy(rank0, 2 * x) + 1, rtol=1e-5, atol=1e-5)

    sharded = build_mlp(p, mine)
    param = distribute_parameter(sharded.fc1, "weight", mesh, [Shard(0)])
    start, length = chunk(5, n, r)
    assert tuple(param.shape) == (5, 4) and list(param.placements) == [Shard(0)], (param.shape, param.placements)
    np.testing.assert_array_equal(p.to_numpy(param.to_local()), rank0["fc1.weight"][start:start + length])
    assert dict(p.named_parameters(sharded))["fc1.weight"] is param
    try:
        distribute_parameter(sharded.fc1, "gamma", mesh, [Replicate()])
    except KeyError as err:
        assert "'gamma'" in str(err) and "weight" in str(err)
    else:
        raise AssertionError("a missing parameter name was accepted")


def test_distribute_module(run_on_ranks) -> None:
    run_on_ranks(check_distribute_module, world_size=4)
