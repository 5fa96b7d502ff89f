"""``torch.distributed.checkpoint`` (DCP) on models whose parameters are this project's
DTensors: ``dcp.save(model.state_dict())`` on one layout and world size,
``dcp.load`` + ``load_state_dict`` on another (fully_shard over 4 ranks with uneven and
empty chunks, HSDP 2 x 2, tp 2 x fully_shard 2, fully_shard over 2, a plain model in one
process): every value comes back exactly. ``torch.save`` of a DTensor state dict raises
with the supported paths (it would pickle one rank's piece). torch only: DCP is torch's.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.core.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hyper_parallel.platform import get_platform
from tests.tensor_parallel._models import build, weights

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="torch.distributed.checkpoint is torch's")


def _model(layout: str, values: dict):
    """The MLP of ``values`` (fc1 ``[7, 6]``, fc2 ``[6, 7]`` and biases) under ``layout``."""
    p = get_platform()
    model = build(p, "mlp", values)
    n = p.world_size()
    if layout in ("fsdp", "hsdp"):
        mesh = init_device_mesh(p.device_type, (n,) if layout == "fsdp" else (2, n // 2))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp_fsdp":
        mesh = init_device_mesh(p.device_type, (2, n // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        assert layout == "plain", layout
    return model


def save(path: str, layout: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    model = _model(layout, weights("mlp"))
    state = model.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values()), {k: type(v) for k, v in state.items()}
    try:
        torch.save(state, io.BytesIO())
    except TypeError as err:
        assert "torch.distributed.checkpoint" in str(err) and "full_tensor" in str(err), str(err)
    else:
        raise AssertionError("torch.save of DTensors (one rank's pieces) was accepted")
    dcp.save(state, checkpoint_id=path)


def load(path: str, layout: str) -> None:
    import torch.distributed.checkpoint as dcp

    p = get_platform()
    values = weights("mlp")
    model = _model(layout, {name: np.zeros_like(value) for name, value in values.items()})
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    for name, param in p.named_parameters(model):
        got = param.full_tensor() if isinstance(param, DTensor) else param
        np.testing.assert_array_equal(p.to_numpy(got), values[name], err_msg=f"{layout}: {name}")


@pytest.mark.parametrize("saved", ["fsdp", "hsdp", "tp_fsdp"])
def test_dcp_saves_and_reshards(run_on_ranks, tmp_path, saved: str) -> None:
    path = str(tmp_path / saved)
    run_on_ranks(save, path, saved, world_size=4)
    for layout, world in [("fsdp", 4), ("tp_fsdp", 4), ("fsdp", 2), ("plain", 1)]:
        run_on_ranks(load, path, layout, world_size=world)
