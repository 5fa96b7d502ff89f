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
- the view primitives (``mint.permute`` -> ``TransposeView``, ``Tensor.view`` -> ``View``,
  ``mint.unsqueeze`` -> ``ExpandDimsView``) keep a shard as their copying forms do:
  MindFormers' ``GPTModel`` permutes and reshapes the vocabulary-sharded logits of its loss
  parallelism.
- ``CellBackwardHook``, which MindSpore puts on the outputs of a Cell with a backward
  (pre) hook (fully_shard's pre-backward on every unit), keeps each output's placements.
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


def check_split(mesh_shape: tuple[int, ...]) -> list:
    """``mint.split`` (sizes and one size), ``mint.chunk`` and ``Tensor.split`` of a
    ``[5, 6]`` DTensor (5 rows: uneven over 2 and 4) along each dim, on each placement:
    the pieces' values, their placements, and the input's gradient through
    ``value_and_grad`` (the pieces weighted differently)."""
    import mindspore as ms
    from mindspore import mint

    from hyper_parallel.core.dtensor import DTensor, init_device_mesh
    from hyper_parallel.core.dtensor.dtensor import distribute_tensor
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.core.dtensor.dispatch import _has_empty_piece
    from tests.dtensor._reference import expected_local

    mesh = init_device_mesh("cpu", mesh_shape)
    full = np.arange(30, dtype=np.float32).reshape(5, 6)
    splits = {"sizes": (lambda t, d: mint.split(t, [2, t.shape[d] - 2], d), lambda a, d: [2]),
              "size": (lambda t, d: mint.split(t, 3, d), lambda a, d: list(range(3, a.shape[d], 3))),
              "chunk": (lambda t, d: mint.chunk(t, 2, d), lambda a, d: [-(-a.shape[d] // 2)]),
              "method": (lambda t, d: t.split(2, d), lambda a, d: list(range(2, a.shape[d], 2)))}
    out = []
    layouts = [(Shard(0),), (Shard(1),), (Replicate(),)] if len(mesh_shape) == 1 else [(Shard(0), Shard(1))]
    for placements in layouts:
        x = distribute_tensor(ms.Tensor(full), mesh, placements)
        for name, (split, cuts) in splits.items():
            for dim in (0, 1):
                pieces = split(x, dim)
                want = np.split(full, cuts(full, dim), dim)
                values_ok = len(pieces) == len(want) and all(
                    np.array_equal(piece.full_tensor().asnumpy(), w) for piece, w in zip(pieces, want))
                # the split dim gathered; a sharding that leaves a rank an empty piece (5 rows
                # or 6 columns over 4), which MindSpore's CPU kernels cannot take: replicated
                gathered = [Replicate() if isinstance(pl, Shard) and pl.dim == dim else pl for pl in placements]
                empty = _has_empty_piece(full.shape, gathered, mesh.shape)
                kept = [pl for pl in gathered if not pl.is_replicate() and not empty]
                placements_ok = all(
                    [pl for pl in piece.placements if not pl.is_replicate()] == kept for piece in pieces)

                def weighted(t, split=split, dim=dim):
                    return sum((k + 1.0) * p.sum() for k, p in enumerate(split(t, dim)))

                grad = ms.grad(weighted)(x)
                grad = grad.to_local() if isinstance(grad, DTensor) else grad
                want_grad = np.concatenate([np.full(w.shape, k + 1.0, np.float32) for k, w in enumerate(want)], dim)
                want_grad = expected_local(want_grad, placements, mesh.shape, mesh.get_coordinate())
                out.append((str(placements), name, dim, values_ok, placements_ok, grad.asnumpy(), want_grad))
    return out


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_split(run_on_ranks, mesh_shape) -> None:
    """No warning is asserted by the values: a split that took the fallback would come
    back Replicate, which ``placements_ok`` rejects where the input was sharded."""
    for got in run_on_ranks(check_split, mesh_shape, world_size=int(np.prod(mesh_shape)), timeout_s=300):
        for placements, name, dim, values_ok, placements_ok, grad, want_grad in got:
            what = f"{name} along {dim} of {placements}"
            assert values_ok, what
            assert placements_ok, what
            np.testing.assert_array_equal(grad, want_grad, err_msg=what)


def check_view_primitives() -> list:
    """The logits path of ``GPTModel`` under loss parallelism: ``[seq, batch, vocab]``
    ``Shard(2)``, ``mint.permute(x, (1, 0, 2))``, ``Tensor.view(-1, vocab)``,
    ``mint.unsqueeze``: placements, shapes and values, and the gradient of the chain."""
    import mindspore as ms
    from mindspore import mint

    from hyper_parallel.core.dtensor import DTensor, init_device_mesh
    from hyper_parallel.core.dtensor.placement_types import Shard

    mesh = init_device_mesh("cpu", (2,))
    me = mesh.get_coordinate()[0]
    full = np.arange(4 * 3 * 6, dtype=np.float32).reshape(4, 3, 6)
    local = ms.Tensor(full[:, :, 3 * me:3 * me + 3])

    def chain(t):
        x = DTensor.from_local(t, mesh, [Shard(2)])
        y = mint.permute(x, (1, 0, 2))
        z = y.view(-1, y.shape[-1])
        u = mint.unsqueeze(z, 0)
        return y, z, u, (u * u).to_local().sum()

    y, z, u, _ = chain(local)
    grad = ms.grad(lambda t: chain(t)[3])(local)
    return [(str(t.placements), tuple(t.shape), t.to_local().asnumpy().tolist()) for t in (y, z, u)] + [
        grad.asnumpy().tolist()]


def test_view_primitives_keep_the_shard(run_on_ranks) -> None:
    full = np.arange(4 * 3 * 6, dtype=np.float32).reshape(4, 3, 6)
    for me, got in enumerate(run_on_ranks(check_view_primitives, world_size=2)):
        piece = full.transpose(1, 0, 2)[:, :, 3 * me:3 * me + 3]
        assert got[0] == ("(Shard(dim=2),)", (3, 4, 6), piece.tolist())
        assert got[1] == ("(Shard(dim=1),)", (12, 6), piece.reshape(12, 3).tolist())
        assert got[2] == ("(Shard(dim=2),)", (1, 12, 6), piece.reshape(1, 12, 3).tolist())
        np.testing.assert_allclose(got[3], 2 * full[:, :, 3 * me:3 * me + 3])


def check_cell_backward_hook() -> list:
    """A Cell with a backward pre hook (as fully_shard registers on each unit) returning
    two ``Shard(0)`` DTensors: they stay ``Shard(0)``; the hook runs once in the backward
    with this rank's gradient pieces; the input's gradient is right."""
    import mindspore as ms
    from mindspore import nn

    from hyper_parallel.core.dtensor import DTensor, init_device_mesh
    from hyper_parallel.core.dtensor.placement_types import Shard

    mesh = init_device_mesh("cpu", (2,))
    heard = []

    class Unit(nn.Cell):
        def construct(self, x):
            return x * 2.0, x + 1.0

    unit = Unit()
    unit.register_backward_pre_hook(lambda cell, grads: heard.append([tuple(g.shape) for g in grads]))
    local = ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))

    def loss(t):
        a, b = unit(DTensor.from_local(t, mesh, [Shard(0)]))
        assert [str(a.placements), str(b.placements)] == ["(Shard(dim=0),)"] * 2, (a.placements, b.placements)
        return (a * b).to_local().sum()

    grad = ms.grad(loss)(local)
    return [heard, grad.asnumpy().tolist()]


def test_cell_backward_hook_keeps_placements(run_on_ranks) -> None:
    for heard, grad in run_on_ranks(check_cell_backward_hook, world_size=2):
        assert heard == [[(2, 3), (2, 3)]], heard
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        np.testing.assert_allclose(grad, 2 * (x + 1) + 2 * x)  # d/dx (2x * (x + 1))
