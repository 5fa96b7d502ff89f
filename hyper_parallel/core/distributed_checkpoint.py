"""``get_global_layout``: every rank's parameter layouts, for tools that write or read
MindSpore's distributed checkpoints (MindFormers' checkpoint code calls it).

Each rank knows the layouts of its own parameters (pipeline stages hold different
ones), so the ranks exchange them: one **all-gather** of their sizes and one of the
padded JSON bytes, over the world.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.layout import Layout
from hyper_parallel.platform import get_platform
from hyper_parallel.core.tensor_ops import dtype_name


def local_layout(module: Any) -> dict[str, dict[str, Any]]:
    """This rank's parameters of ``module`` (torch ``nn.Module`` / MindSpore ``Cell``):
    name -> ``{"type", "full_shape"}``, plus for DTensor parameters ``{"device_matrix",
    "alias_name", "rank_list", "tensor_map"}`` (see [Note: tensor maps] in
    ``core/dtensor/layout.py``). A plain parameter is whole on this rank."""
    p = get_platform()
    out: dict[str, dict[str, Any]] = {}
    for name, param in p.named_parameters(module):
        info: dict[str, Any] = {"type": dtype_name(param.dtype), "full_shape": [int(s) for s in param.shape]}
        if isinstance(param, DTensor):
            layout = Layout.of(param.device_mesh, param.placements, param.shape)
            names = layout.alias_name or tuple(f"axis_{a}" for a in range(len(layout.mesh_shape)))
            info.update(device_matrix=list(layout.mesh_shape), alias_name=list(names),
                        rank_list=list(layout.rank_list),
                        tensor_map=[list(e) if isinstance(e, tuple) else e for e in layout.tensor_map or ()])
        out[name] = info
    return out


def get_global_layout(module: Any) -> dict[int, dict[str, dict[str, Any]]]:
    """Every rank's ``local_layout(module)``: global rank -> parameter name -> layout
    information, the same on every rank. Collective over the world (two **all-gathers**)
    when it has more than one rank; every rank must call it.

    Tensor maps are lists (a dim split by several axes: a list of axes), as JSON keeps them.
    """
    p = get_platform()
    mine = local_layout(module)
    world = p.world_size()
    if world == 1:
        return {p.rank(): mine}
    payload = np.frombuffer(json.dumps(mine, sort_keys=True).encode(), dtype=np.uint8).astype(np.float64)
    # float64 holds every byte exactly and every backend's all-gather takes it
    sizes = p.to_numpy(p.all_gather_into_tensor(p.from_numpy(np.array([payload.size], np.float64))).wait())
    longest = int(sizes.max())
    padded = np.zeros(longest, np.float64)
    padded[:payload.size] = payload
    gathered = p.to_numpy(p.all_gather_into_tensor(p.from_numpy(padded)).wait()).reshape(world, longest)
    out = {}
    for rank in range(world):
        text = gathered[rank, :int(sizes[rank])].astype(np.uint8).tobytes().decode()
        out[rank] = json.loads(text)
    return out
