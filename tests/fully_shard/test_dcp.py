"""``torch.distributed.checkpoint`` (DCP) on models whose parameters are this project's
DTensors: ``dcp.save`` of the model's and torch AdamW's state dicts (after one step, so
the moments exist) on one layout and world size, ``dcp.load`` + ``load_state_dict`` on
another (fully_shard over 4 ranks with uneven and empty chunks, HSDP 2 x 2, tp 2 x
fully_shard 2, fully_shard over 2, a plain model in one process): every parameter and
every moment comes back exactly. ``torch.save`` of a DTensor state dict raises with the
supported paths (it would pickle one rank's piece). torch only: DCP is torch's.
"""

from __future__ import annotations

import io
import os
from typing import Any

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
    """The MLP of ``values`` (fc1 ``[7, 6]``, fc2 ``[6, 7]`` and biases) under ``layout``:
    ``fsdp`` / ``hsdp`` (2 x n/2) / ``tp`` (fc1 colwise, fc2 rowwise over n) / ``tp_fsdp``
    (tp 2 x fully_shard n/2) / ``plain``."""
    p = get_platform()
    model = build(p, "mlp", values)
    n = p.world_size()
    if layout in ("fsdp", "hsdp"):
        mesh = init_device_mesh(p.device_type, (n,) if layout == "fsdp" else (2, n // 2))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh(p.device_type, (n,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    elif layout == "tp_fsdp":
        mesh = init_device_mesh(p.device_type, (2, n // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        assert layout == "plain", layout
    return model


def _step(model) -> Any:
    """torch's AdamW after one step on a fixed batch: its moments exist (DTensors like the
    parameters) and are not zero."""
    import torch

    p = get_platform()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = np.random.default_rng(7).standard_normal((4, 3, 6)).astype(np.float32)
    if p.world_size() > 1 and not isinstance(next(model.parameters()), DTensor):
        raise AssertionError("a plain model on several ranks")
    (model(p.from_numpy(x)) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    return opt


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _moments(model, opt) -> dict[str, np.ndarray]:
    p = get_platform()
    out = {}
    for name, param in p.named_parameters(model):
        for key in ("exp_avg", "exp_avg_sq"):
            value = opt.state[param][key]
            out[f"{key}/{name}"] = p.to_numpy(value.full_tensor() if isinstance(value, DTensor) else value)
    return out


def save(path: str, layout: str) -> dict[str, np.ndarray]:
    import torch
    import torch.distributed.checkpoint as dcp

    model = _model(layout, weights("mlp"))
    opt = _step(model)
    state = _state(model, opt)
    assert all(isinstance(v, DTensor) for v in state["model"].values()), {k: type(v) for k, v in state.items()}
    try:
        torch.save(state, io.BytesIO())
    except TypeError as err:
        assert "torch.distributed.checkpoint" in str(err) and "full_tensor" in str(err), str(err)
    else:
        raise AssertionError("torch.save of DTensors (one rank's pieces) was accepted")
    dcp.save(state, checkpoint_id=path)
    p = get_platform()
    values = {name: p.to_numpy(param.full_tensor()) for name, param in p.named_parameters(model)}
    return {**values, **_moments(model, opt)}


def load(path: str, layout: str, saved: dict[str, np.ndarray]) -> None:
    import torch.distributed.checkpoint as dcp

    p = get_platform()
    values = weights("mlp")
    model = _model(layout, {name: np.zeros_like(value) for name, value in values.items()})
    opt = _step(model)  # the moments to load into: other values, this layout's pieces
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    for name, param in p.named_parameters(model):
        got = param.full_tensor() if isinstance(param, DTensor) else param
        np.testing.assert_array_equal(p.to_numpy(got), saved[name], err_msg=f"{layout}: {name}")
    for key, got in _moments(model, opt).items():
        np.testing.assert_array_equal(got, saved[key], err_msg=f"{layout}: {key}")


@pytest.mark.parametrize("saved", ["fsdp", "hsdp", "tp_fsdp"])
def test_dcp_saves_and_reshards(run_on_ranks, tmp_path, saved: str) -> None:
    path = str(tmp_path / saved)
    values = run_on_ranks(save, path, saved, world_size=4)[0]
    for layout, world in [("fsdp", 4), ("tp_fsdp", 4), ("fsdp", 2), ("plain", 1)]:
        run_on_ranks(load, path, layout, values, world_size=world)
