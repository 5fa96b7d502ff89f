"""fully_shard of parameters sharded on a dim other than 0 (``shard_placement_fn``), on the
flat collectives (``core/fully_shard/param_group.py``): a 2-D parameter on ``Shard(1)``
and 3-D parameters on ``Shard(1)`` and ``Shard(2)``, uneven over 2 and 4 ranks (7 -> 4+3
and 2+2+2+1; 5 -> 3+2 and 2+1+1+1). Each rank's gradients of three steps (AdamW between
them) equal the columns of one process's that it holds, with the unit resharded after
forward and not. Before the flat layout's shapes were read as ``tensor.transpose(0, dim)``
lays them out, a 3-D parameter on ``Shard(2)`` failed its first forward."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.dtensor import Shard, init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard, hsdp_state
from hyper_parallel.platform import get_platform
from tests.fully_shard._models import Trainer, assert_shard_grads

# float32 gradients summed over ranks in another order than one process's: a few ulps
TOL = dict(rtol=1e-4, atol=1e-5)
#: parameter -> (shape, the dim fully_shard shards)
PARAMS = {"w": ((3, 5, 7), 2), "u": ((4, 5, 7), 1), "v": ((7, 15), 1)}


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(17)
    return {name: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            for name, (shape, _) in PARAMS.items()}


def _build(p):
    Module = p.module_types().Module
    values = _values()

    class Model(Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = p.make_parameter(p.from_numpy(values["w"]))
            self.u = p.make_parameter(p.from_numpy(values["u"]))
            self.v = p.make_parameter(p.from_numpy(values["v"]))

        def forward(self, x):  # x [batch, 7] -> [batch, 7]
            h = x @ self.w.reshape(15, 7).transpose(0, 1)  # [batch, 15]
            return h @ self.v.transpose(0, 1) + x @ self.u.sum(0).transpose(0, 1).sum(1, keepdim=True)

    return Model()


def _batch(step: int) -> np.ndarray:
    return np.random.default_rng(50 + step).standard_normal((8, 7)).astype(np.float32)


def check_shard_dims(reshard: bool) -> int:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (n,))
    model = _build(p)
    by_shape = {shape: Shard(dim) for shape, dim in PARAMS.values()}
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard,
                shard_placement_fn=lambda param: by_shape[tuple(param.shape)])
    state = hsdp_state(model)
    assert sorted(hp.dim for hp in state.params) == sorted(dim for _, dim in PARAMS.values()), \
        [hp.dim for hp in state.params]
    trainer, ref = Trainer(p, model), Trainer(p, _build(p))
    per = 8 // n
    for step in range(3):
        trainer.backward(_batch(step)[r * per:(r + 1) * per])
        ref.backward(_batch(step))
        assert_shard_grads(trainer, ref, [state], TOL, f"step {step}")
        trainer.step()
        ref.step()
    return 1


@pytest.mark.parametrize("world", [2, 4])
def test_parameters_sharded_on_later_dims(run_on_ranks, world: int) -> None:
    for reshard in (True, False):
        assert run_on_ranks(check_shard_dims, reshard, world_size=world, timeout_s=300) == [1] * world
