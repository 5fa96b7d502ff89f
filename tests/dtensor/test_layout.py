"""``Layout`` (a DTensor's sharding in MindSpore's tensor-map terms), the slice areas
MindFormers computes from it, and ``get_global_layout``: each area is exactly the piece
``distribute_tensor`` gives that rank (uneven sizes included), on 1-D and 2-D meshes;
the names MindFormers imports that are not built refuse clearly."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.distributed_checkpoint import get_global_layout
from hyper_parallel.core.dtensor import Partial, Replicate, Shard, distribute_parameter, distribute_tensor
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.dtensor.layout import Layout, _infer_slice_area_by_rank
from hyper_parallel.platform import get_platform
from tests.platform_contract._models import build_mlp, mlp_weights

#: (mesh shape, placements, global shape): even, uneven, a dim split by two axes, replicas
CASES = [
    ((4,), [Shard(0)], (8, 3)),
    ((4,), [Shard(1)], (3, 7)),
    ((2, 2), [Shard(0), Shard(1)], (6, 5)),
    ((2, 2), [Shard(1), Shard(0)], (7, 9)),
    ((2, 2), [Shard(0), Shard(0)], (11, 2)),
    ((2, 2), [Replicate(), Shard(1)], (2, 3, 5)),
]


def check_areas() -> None:
    p = get_platform()
    me = p.rank()
    rng = np.random.default_rng(0)
    for mesh_shape, placements, shape in CASES:
        mesh = init_device_mesh(p.device_type, mesh_shape, mesh_dim_names=("dp", "tp")[:len(mesh_shape)])
        full = rng.standard_normal(shape).astype(np.float32)
        dt = distribute_tensor(p.from_numpy(full), mesh, placements)
        layout = Layout.of(mesh, placements, shape)
        if p.name.startswith("mindspore"):  # torch's own Tensor.layout (torch.strided) stays
            assert dt.layout == layout
        area = _infer_slice_area_by_rank(layout.mesh_shape, list(layout.tensor_map), layout.rank_list.index(me),
                                         shape)
        np.testing.assert_array_equal(full[tuple(slice(b, e) for b, e in area)], p.to_numpy(dt.to_local()),
                                      err_msg=f"{mesh_shape} {placements} {shape}")
        assert layout.slice_area(me) == area
        assert layout.get_global_shape(dt.local_shape) == shape
        split = {axis for axis, placement in enumerate(placements) if isinstance(placement, Shard)}
        assert layout.repeat_num() == int(np.prod([s for a, s in enumerate(mesh_shape) if a not in split]))


def test_slice_areas_are_distribute_tensor_pieces(run_on_ranks) -> None:
    run_on_ranks(check_areas, world_size=4)


def check_layout_forms() -> None:
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
    base = Layout.from_device_mesh(mesh)
    # MindSpore's numbering: tp (the last axis) is 0, dp is 1
    assert base("dp", "None").tensor_map == (1, -1)
    assert base("dp", "None").placements == (Shard(0), Replicate())
    assert base("None", "tp").placements == (Replicate(), Shard(1))
    assert base(("dp", "tp"), "None").tensor_map == ((1, 0), -1)
    assert base(("dp", "tp"), "None").alias_tensor_map == (("dp", "tp"), "None")
    assert base(Shard(1), Shard(0)).placement_to_tensor_map(2) == [0, 1]
    assert base.rank_list == (0, 1, 2, 3)
    assert base("dp", "tp").to_dict()["tensor_map"] == (1, 0)
    partial = Layout.of(mesh, [Partial(), Shard(0)], (4, 4))
    assert partial.is_partial() and partial.partial == ["sum", None]
    partial.reset_partial()
    assert partial.placements == (Replicate(), Shard(0)) and not partial.is_partial()
    with pytest.raises(ValueError, match="'sp' is not an axis of the mesh"):
        base("sp", "None")
    with pytest.raises(ValueError, match="mesh axis 'dp' splits two tensor dims"):
        base("dp", "dp")
    with pytest.raises(ValueError, match="inner axis first"):
        base(("tp", "dp"), "None")
    with pytest.raises(ValueError, match="2 dims; give one entry per dim"):
        _infer_slice_area_by_rank((2, 2), [0], 0, (4, 4))
    with pytest.raises(ValueError, match="rank index 4 is out of range"):
        _infer_slice_area_by_rank((2, 2), [0, -1], 4, (4, 4))


def test_layout_forms(run_on_ranks) -> None:
    run_on_ranks(check_layout_forms, world_size=4)


def check_global_layout() -> dict:
    """fc1's weight split over the world, the rest whole: every rank reports every
    rank's parameters."""
    p = get_platform()
    model = build_mlp(p, mlp_weights(4, 6, 3))
    mesh = init_device_mesh(p.device_type, (p.world_size(),), mesh_dim_names=("tp",))
    distribute_parameter(model.fc1, "weight", mesh, [Shard(0)])
    return get_global_layout(model)


def test_global_layout(run_on_ranks) -> None:
    results = run_on_ranks(check_global_layout, world_size=2)
    assert results[0] == results[1]
    layouts = results[0]
    assert sorted(int(rank) for rank in layouts) == [0, 1]
    fc1 = layouts[0]["fc1.weight"]
    assert fc1["device_matrix"] == [2] and fc1["tensor_map"] == [0, -1] and fc1["rank_list"] == [0, 1]
    assert fc1["alias_name"] == ["tp"] and fc1["full_shape"] == list(fc1["full_shape"])
    assert "device_matrix" not in layouts[1]["fc2.weight"] and layouts[1]["fc2.weight"]["type"] == "float32"


def test_ascend_kernels_refuse() -> None:
    from hyper_parallel.custom_ops import experimental

    for name in experimental.__all__:
        with pytest.raises(NotImplementedError, match=f"{name} is an Ascend custom kernel"):
            getattr(experimental, name)()
