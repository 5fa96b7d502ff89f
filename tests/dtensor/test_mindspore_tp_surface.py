"""Two MindSpore behaviours MindFormers' tensor parallelism relies on (MindSpore only):

- ``distribute_tensor`` of a meta tensor under ``mindspore.DeviceCtx("meta")``: MindFormers'
  ``apply_non_moe_tp`` runs its styles (``shard_module`` -> ``distribute_tensor``, which
  broadcasts from mesh coordinate 0) on a model built on the meta device. The broadcast
  of a meta tensor is a no-op giving a meta tensor of its shape, as torch's is
  (``MindSporeCollectives.broadcast``); MindSpore refuses a meta tensor as a kernel input.
- ``mint.reshape(dtensor, shape)``: the Reshape primitive takes the shape as one tuple;
  the local call passes the local shape the same way (``Tensor.reshape(*shape)`` spreads
  it). MindFormers' ``VocabEmbedding`` reshapes the ids that ``RowwiseParallel`` made a
  DTensor.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="mindspore.DeviceCtx and mint.reshape are MindSpore's")


def check_meta_distribute() -> list:
    import mindspore as ms
    from mindspore import mint

    from hyper_parallel.core.dtensor import init_device_mesh
    from hyper_parallel.core.dtensor.dtensor import distribute_tensor
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

    mesh = init_device_mesh("cpu", (2,))
    out = []
    with ms.DeviceCtx("meta"):
        t = mint.empty((4, 6), dtype=ms.float32)
        for placement in (Shard(0), Replicate(), Shard(1)):
            d = distribute_tensor(t, mesh, [placement])
            out.append((tuple(d.shape), tuple(d.to_local().shape), bool(d.to_local().is_meta)))
    # communication still works afterwards (nothing was issued for the meta tensors)
    real = distribute_tensor(ms.Tensor(np.arange(8, dtype=np.float32).reshape(4, 2)), mesh, [Shard(0)])
    out.append(real.to_local().asnumpy().tolist())
    return out


def test_distribute_tensor_of_meta(run_on_ranks) -> None:
    for me, got in enumerate(run_on_ranks(check_meta_distribute, world_size=2)):
        assert got[:3] == [((4, 6), (2, 6), True), ((4, 6), (4, 6), True), ((4, 6), (4, 3), True)]
        assert got[3] == np.arange(8).reshape(4, 2)[2 * me:2 * me + 2].tolist()


def check_reshape_forms() -> list:
    import mindspore as ms
    from mindspore import mint, ops

    from hyper_parallel.core.dtensor import DTensor, init_device_mesh
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

    mesh = init_device_mesh("cpu", (2,))
    out = []
    for placement in (Replicate(), Shard(0)):
        d = DTensor.from_local(ms.Tensor(np.arange(16, dtype=np.int32).reshape(2, 8)), mesh, (placement,))
        for r in (mint.reshape(d, (-1, 1)), ops.reshape(d, (-1, 1)), d.reshape(-1, 1), d.reshape((-1, 1)),
                  mint.reshape(d, (-1,))):
            out.append((str(placement), tuple(r.shape), r.to_local().asnumpy().reshape(-1).tolist()))
    return out


def test_mint_reshape_of_dtensor(run_on_ranks) -> None:
    for got in run_on_ranks(check_reshape_forms, world_size=2):
        local = list(range(16))
        for placement, shape, values in got:
            assert shape[0] == (16 if placement == "Replicate()" else 32), (placement, shape)
            assert values == local
