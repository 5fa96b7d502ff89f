"""MindSpore's own checkpoint functions on a Cell under fully_shard (4 ranks, uneven
chunks) and tensor parallelism (ColwiseParallel / RowwiseParallel over 4), see [Note:
MindSpore checkpoints of DTensor parameters]: ``mindspore.save_checkpoint`` of the Cell,
of ``parameters_dict()`` and of a list of its parameters raises naming the supported
paths (it would write this rank's piece under the parameter's name); the supported one,
``mindspore.save_checkpoint(full_state_dict(cell), path)`` on rank 0, writes the full
values exactly, and they load back through ``load_full_state_dict``;
``load_param_into_net`` of that full checkpoint into the sharded Cell is refused by
MindSpore (shape check) and changes nothing; ``asnumpy()`` of a sharded parameter refuses
(a replicated one gives its value). MindSpore only.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.core.fully_shard.state_dict import full_state_dict, load_full_state_dict
from hyper_parallel.core.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hyper_parallel.platform import get_platform
from tests.tensor_parallel._models import build, weights
from hyper_parallel.core.process_groups import barrier

pytestmark = pytest.mark.skipif(not os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="mindspore.save_checkpoint is MindSpore's")


def _cell(layout: str, values: dict):
    p = get_platform()
    cell = build(p, "mlp", values)
    mesh = init_device_mesh(p.device_type, (p.world_size(),))
    if layout == "fsdp":
        fully_shard(cell.fc1, mesh=mesh)
        fully_shard(cell, mesh=mesh)
    else:
        parallelize_module(cell, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return cell


def check(path: str, layout: str) -> None:
    import mindspore as ms

    p = get_platform()
    values = weights("mlp")
    cell = _cell(layout, values)
    params = cell.parameters_dict()
    assert all(isinstance(v, DTensor) for v in params.values()), {k: type(v) for k, v in params.items()}
    assert {k: tuple(v.shape) for k, v in params.items()} == {k: v.shape for k, v in values.items()}
    target = os.path.join(path, f"rank{p.rank()}.ckpt")
    for obj in (cell, params, list(cell.get_parameters())):
        with pytest.raises(TypeError, match="save_sharded_state_dict.*full_state_dict"):
            ms.save_checkpoint(obj, target)
    assert not os.path.exists(target)
    # reading a parameter as numpy: the value where this rank holds all of it, else refused
    for name, param in params.items():
        if all(pl.is_replicate() for pl in param.placements):
            np.testing.assert_array_equal(param.asnumpy(), values[name], err_msg=name)
        else:
            with pytest.raises(TypeError, match="this rank holds one piece.*full_tensor"):
                param.asnumpy()
    assert any(not all(pl.is_replicate() for pl in v.placements) for v in params.values())

    full = full_state_dict(cell)  # collective; rank 0 holds the arrays
    if p.rank() == 0:
        ms.save_checkpoint(full, os.path.join(path, "full.ckpt"))
    barrier()  # the file is written before the others read it
    loaded = {k: v.asnumpy() for k, v in ms.load_checkpoint(os.path.join(path, "full.ckpt")).items()}
    for name, value in values.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)

    fresh = _cell(layout, {name: np.zeros_like(v) for name, v in values.items()})
    sharded = [name for name, param in fresh.parameters_dict().items() if param._local.shape != param.shape]
    assert sharded, "every parameter is replicated: nothing checked"
    with pytest.raises(RuntimeError, match="should have the same shape"):
        ms.load_param_into_net(fresh, ms.load_checkpoint(os.path.join(path, "full.ckpt")))
    for name, value in full_state_dict(fresh).items():
        np.testing.assert_array_equal(value, np.zeros_like(values[name]), err_msg=f"changed: {name}")
    load_full_state_dict(fresh, loaded, broadcast_from_rank0=False)
    for name, value in full_state_dict(fresh).items():
        np.testing.assert_array_equal(value, values[name], err_msg=name)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_mindspore_checkpoint_functions(run_on_ranks, tmp_path, layout: str) -> None:
    run_on_ranks(check, str(tmp_path), layout, world_size=4)
