"""DeviceMesh: shapes, names, submeshes, flatten, per-axis groups; bad input raises on
every rank before any group is created."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DeviceMesh, DTensor, Replicate, Shard, init_device_mesh
from hyper_parallel.platform import get_platform


def check_mesh_2x2() -> dict:
    p = get_platform()
    r = p.rank()
    mesh = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh.shape == (2, 2) and mesh.ndim == 2 and mesh.size() == 4 and mesh.size("tp") == 2
    assert mesh.mesh_dim_names == ("dp", "tp")
    coordinate = (r // 2, r % 2)
    assert mesh.get_coordinate() == coordinate
    assert mesh.get_local_rank("dp") == coordinate[0] and mesh.get_local_rank(1) == coordinate[1]
    assert p.group_ranks(mesh.get_group("tp")) == [2 * coordinate[0], 2 * coordinate[0] + 1]
    assert p.group_ranks(mesh.get_group("dp")) == [coordinate[1], coordinate[1] + 2]
    tp = mesh["tp"]
    assert tp.ndim == 1 and tp.mesh.tolist() == [2 * coordinate[0], 2 * coordinate[0] + 1]
    assert tp.get_group() is mesh.get_group("tp") and tp.mesh_dim_names == ("tp",)
    swapped = mesh["tp", "dp"]
    assert swapped.mesh.tolist() == [[0, 2], [1, 3]] and swapped.get_coordinate() == (coordinate[1], coordinate[0])
    assert mesh["dp", "tp"] is mesh
    flat = mesh.flatten("world")
    assert flat.mesh.tolist() == [0, 1, 2, 3] and flat.mesh_dim_names == ("world",)
    assert p.group_ranks(flat.get_group()) == [0, 1, 2, 3]
    flat_dp = mesh["dp"].flatten("dp_flat")
    assert p.group_ranks(flat_dp.get_group()) == [coordinate[1], coordinate[1] + 2]
    total = p.all_reduce(p.from_numpy(np.array([1.0], np.float32)), group=mesh.get_group("tp")).wait()
    assert float(p.to_numpy(total)[0]) == 2.0
    assert mesh == init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
    return {"coordinate": coordinate}


def test_mesh_2x2(run_on_ranks) -> None:
    results = run_on_ranks(check_mesh_2x2, world_size=4)
    assert [res["coordinate"] for res in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def check_mesh_1d_and_explicit() -> None:
    p = get_platform()
    n = p.world_size()
    mesh = DeviceMesh(p.device_type, list(reversed(range(n))))
    assert mesh.get_local_rank() == n - 1 - p.rank()
    assert p.group_ranks(mesh.get_group()) == list(range(n))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mesh_1d(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_mesh_1d_and_explicit, world_size=world_size)


def _expect(call, *needles: str) -> str:
    try:
        call()
    except (ValueError, TypeError) as err:
        message = str(err)
        missing = [needle for needle in needles if needle not in message]
        assert not missing, f"message {message!r} lacks {missing}"
        return message
    raise AssertionError(f"no error raised; expected one mentioning {needles}")


def check_bad_input() -> None:
    p = get_platform()
    dev = p.device_type
    _expect(lambda: init_device_mesh(dev, (3, 2)), "mesh_shape=(3, 2)", "6 ranks", "world has 4")
    _expect(lambda: DeviceMesh(dev, [0, 1, 2, 2]), "exactly once")
    _expect(lambda: init_device_mesh(dev, (2, 2), mesh_dim_names=("dp", "dp")), "mesh_dim_names", "distinct")
    _expect(lambda: init_device_mesh("tpu", (4,)), "device_type='tpu'", repr(dev))
    mesh = init_device_mesh(dev, (2, 2), mesh_dim_names=("dp", "tp"))
    _expect(lambda: mesh["pp"], "no axis named 'pp'", "('dp', 'tp')")
    _expect(lambda: mesh.get_group(), "ambiguous")
    local = p.from_numpy(np.zeros((2, 3)))
    _expect(lambda: DTensor.from_local(local, mesh, [Shard(2), Replicate()]), "Shard(dim=2)", "2-D tensor")
    _expect(lambda: DTensor.from_local(local, mesh, [Shard(0)]), "1 entries", "2 axes")
    _expect(lambda: DTensor.from_local(local, mesh, [Shard(0), "replicate"]), "is not a Placement")
    _expect(lambda: DTensor.from_local(local, mesh, [Shard(0), Replicate()], shape=(9, 3)),
            "local has shape (2, 3)", "gives this rank")
    _expect(lambda: DTensor.from_local(local, mesh, [Replicate(), Replicate()], stride=(1, 2)), "stride=(1, 2)")
    dt = DTensor.from_local(local, mesh, [Shard(0), Replicate()])
    other = mesh.flatten("all")
    _expect(lambda: dt.redistribute(other, [Replicate()]), "not this DTensor's mesh")
    _expect(lambda: dt.redistribute(mesh, [Shard(-3), Replicate()]), "Shard(dim=-3)")
    # Every rank is still in step: none of the calls above communicated.
    total = p.all_reduce(p.from_numpy(np.ones(1, np.float32))).wait()
    assert float(p.to_numpy(total)[0]) == 4.0


def test_bad_input_raises_before_any_collective(run_on_ranks) -> None:
    run_on_ranks(check_bad_input, world_size=4)


def check_unflatten_and_flatten() -> dict:
    """MindFormers' mesh building (``ParallelDims.build_mesh``): the world mesh split by
    ``_unflatten`` into (pp, batch, cp, tp) = (1, 2, 1, 2), a submesh flattened with
    ``_flatten`` and found again by name on the root, and the MindSpore-style queries."""
    p = get_platform()
    world = init_device_mesh(p.device_type, (4,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (1, 2, 1, 2), ("pp", "batch", "cp", "tp"), backend_override={"pp": "fake", "cp": "fake"})
    assert mesh.shape == mesh.mesh_shape == (1, 2, 1, 2) and mesh.rank_list == (0, 1, 2, 3)
    assert mesh.root_mesh is world and mesh["tp"].root_mesh is world
    me = p.rank()
    assert p.group_ranks(mesh.get_group("tp")) == [me - me % 2, me - me % 2 + 1]
    assert mesh.get_rank_list_along_axis("batch") == [me % 2, me % 2 + 2]
    loss = mesh["batch", "cp"]._flatten("loss_mesh")
    assert loss.mesh_dim_names == ("loss_mesh",) and loss.rank_list == (me % 2, me % 2 + 2)
    assert p.group_ranks(world.get_group("loss_mesh")) == [me % 2, me % 2 + 2]  # looked up on the root
    assert _expect(lambda: mesh["cp", "tp"]._flatten("loss_mesh"), "'loss_mesh' already names", "another name")
    total = p.all_reduce(p.from_numpy(np.ones(1, np.float32)), "sum", group=world.get_group("loss_mesh")).wait()
    assert float(p.to_numpy(total)[0]) == 2.0
    assert _expect(lambda: world._unflatten(0, (3, 2), ("a", "b")), "multiply to 6", "has 4 ranks")
    assert _expect(lambda: world._unflatten(0, (2, 2), ("a",)), "1 names", "one name per size")
    assert _expect(lambda: world._unflatten(0, (2, 2), ("a", "b"), backend_override={"c": "fake"}), "['c']",
                   "not among the new axes")
    assert _expect(lambda: mesh["tp"]._unflatten(0, (2, 1), ("x", "y")), "not the whole world")
    # "npu", MindFormers' spelling of Ascend: the backend's device on MindSpore, refused on torch-cpu
    if p.framework == "mindspore":
        with pytest.warns(RuntimeWarning, match="taken as") if p.device_type == "cpu" else contextlib.nullcontext():
            npu = init_device_mesh("npu", (4,), mesh_dim_names=("world",))
        assert npu.device_type == p.device_type and npu == world
    elif p.device_type != "npu":
        assert _expect(lambda: init_device_mesh("npu", (4,)), "device_type='npu'")
    return {"loss": loss.rank_list}


def test_unflatten_and_flatten(run_on_ranks) -> None:
    results = run_on_ranks(check_unflatten_and_flatten, world_size=4)
    assert [r["loss"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
