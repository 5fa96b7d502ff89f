"""torch's own functions on DTensors that reach fused aten kernels or need a reduction
across ranks rather than a gather (``platform/torch/fused_ops.py`` over
``core/dtensor/fused_dispatch.py``): ``F.scaled_dot_product_attention`` (the CPU flash
kernel, forward and backward, several outputs) with batch or heads sharded, with and
without a mask; ``softmax`` / ``log_softmax`` over a class-sharded dim and
``F.nll_loss`` on it (vocabulary parallel, an ``ignore_index`` inside the class range);
the function ``torch.matmul`` with sharded heads. Each against one process on the same
data (float64: the kernels are exact to ~1e-15, the tolerance 1e-12 absorbs the sharded
sums), with the collectives counted (torch's ``CommDebugMode``).

torch only: these are aten-level paths; MindSpore's ops reach core above autograd
(``__fallback__``), where ``dtensor_functional`` covers them (``test_framework_ops.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from hyper_parallel.platform import get_platform
from tests.collective_counts import count_collectives

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="torch's aten-level kernels (MindSpore intercepts above autograd)")

TOL = {"rtol": 1e-12, "atol": 1e-12}


def _mesh(mesh_shape: tuple[int, ...]):
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    return init_device_mesh(get_platform().device_type, mesh_shape, mesh_dim_names=names)


def _collectives(fn):
    """``fn()``'s result and the number of the platform's collectives it issued."""
    out, calls = count_collectives(fn)
    return out, sum(calls.values())


def _sharded_leaf(full, mesh, placements):
    return distribute_tensor(full.detach(), mesh, placements).requires_grad_(True)


def check_attention(mesh_shape: tuple[int, ...], causal: bool, masked: bool, kv_heads: int = 4) -> None:
    import torch
    import torch.nn.functional as F

    mesh = _mesh(mesh_shape)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.randn(2, 4, 6, 6, dtype=torch.float64) if masked else None
    grad = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    gqa = {"enable_gqa": True} if kv_heads != 4 else {}
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **gqa)
    ref.backward(grad)
    placements = [Shard(1)] if len(mesh_shape) == 1 else [Shard(0), Shard(1)]
    qd, kd, vd = (_sharded_leaf(t, mesh, placements) for t in (q, k, v))
    maskd = None if mask is None else distribute_tensor(mask, mesh, placements)
    out, count = _collectives(lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=maskd, is_causal=causal,
                                                                     **gqa))
    assert count == 0, f"the forward issued {count} collectives"
    assert isinstance(out, DTensor) and tuple(out.placements) == tuple(placements), out
    np.testing.assert_allclose(out.full_tensor().detach().numpy(), ref.detach().numpy(), **TOL)
    grad_d = distribute_tensor(grad, mesh, placements)
    _, count = _collectives(lambda: out.backward(grad_d))
    assert count == 0, f"the backward issued {count} collectives"
    for name, got, want in (("dq", qd, q), ("dk", kd, k), ("dv", vd, v)):
        assert tuple(got.grad.placements) == tuple(placements), (name, got.grad)
        np.testing.assert_allclose(got.grad.full_tensor().numpy(), want.grad.numpy(), **TOL, err_msg=name)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_scaled_dot_product_attention(run_on_ranks, mesh_shape, causal, masked) -> None:
    if causal and masked:
        pytest.skip("torch's SDPA takes a mask or is_causal, not both")
    run_on_ranks(check_attention, mesh_shape, causal, masked, world_size=int(np.prod(mesh_shape)), timeout_s=300)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_grouped_query_attention(run_on_ranks, mesh_shape) -> None:
    """4 query heads over 2 key/value heads, the heads split in two: each rank's query
    head group stays with its key/value head."""
    run_on_ranks(check_attention, mesh_shape, True, False, 2, world_size=int(np.prod(mesh_shape)), timeout_s=300)


def check_softmax_over_sharded_dim(mesh_shape: tuple[int, ...], dtype_name: str) -> None:
    import torch

    dtype = getattr(torch, dtype_name)
    mesh = _mesh(mesh_shape)
    n = mesh.shape[-1]
    torch.manual_seed(0)
    x = torch.randn(6, 11, dtype=torch.float64)
    grad = torch.randn(6, 11, dtype=torch.float64)
    placements = [Shard(1)] if len(mesh_shape) == 1 else [Shard(0), Shard(1)]
    # bfloat16: the reference is torch's own bfloat16 kernels on whole tensors; both
    # keep their statistics in float32 and round the result to bfloat16, so they differ
    # by a rounding of the output (2^-8 relative) and, in the backward, of the products
    tol = TOL if dtype == torch.float64 else {"rtol": 2 ** -7, "atol": 2 ** -7}
    for fn in (torch.softmax, torch.log_softmax):
        ref_in = x.to(dtype).clone().requires_grad_(True)
        ref = fn(ref_in, -1)
        ref.backward(grad.to(dtype))
        xd = _sharded_leaf(x.to(dtype), mesh, placements)
        out, count = _collectives(lambda: fn(xd, -1))
        # max and sum of exponentials, each an all-reduce over the class axis (n > 1)
        assert count == (2 if n > 1 else 0), f"{fn.__name__}: {count} collectives"
        assert tuple(out.placements) == tuple(placements) and out.dtype == dtype, out
        np.testing.assert_allclose(out.full_tensor().detach().double().numpy(), ref.detach().double().numpy(), **tol)
        grad_d = distribute_tensor(grad.to(dtype), mesh, placements)
        _, count = _collectives(lambda: out.backward(grad_d))
        assert count == (1 if n > 1 else 0), f"{fn.__name__} backward: {count} collectives"
        np.testing.assert_allclose(xd.grad.full_tensor().double().numpy(), ref_in.grad.double().numpy(), **tol)


@pytest.mark.parametrize("dtype_name", ["float64", "bfloat16"])
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_softmax_over_sharded_dim(run_on_ranks, mesh_shape, dtype_name) -> None:
    run_on_ranks(check_softmax_over_sharded_dim, mesh_shape, dtype_name, world_size=int(np.prod(mesh_shape)),
                 timeout_s=300)


def check_nll_loss(mesh_shape: tuple[int, ...]) -> None:
    import torch
    import torch.nn.functional as F

    mesh = _mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(6, 11, dtype=torch.float64)
    target = torch.tensor([3, 0, 10, 3, 7, 5])
    placements = [Shard(1)] if len(mesh_shape) == 1 else [Shard(0), Shard(1)]
    rows = [Replicate()] if len(mesh_shape) == 1 else [Shard(0), Replicate()]
    for reduction in ("none", "sum", "mean"):
        ref_in = x.clone().requires_grad_(True)
        # ignore_index 3 is a class some rank holds: those rows count nowhere
        ref = F.nll_loss(F.log_softmax(ref_in, 1), target, ignore_index=3, reduction=reduction)
        seed = torch.randn(ref.shape, dtype=torch.float64)
        ref.backward(seed)
        xd = _sharded_leaf(x, mesh, placements)
        td = distribute_tensor(target, mesh, rows)
        out = F.nll_loss(F.log_softmax(xd, 1), td, ignore_index=3, reduction=reduction)
        np.testing.assert_allclose(out.full_tensor().detach().numpy(), ref.detach().numpy(), **TOL, err_msg=reduction)
        seed_d = distribute_tensor(seed, mesh, list(out.placements))
        out.backward(seed_d)
        np.testing.assert_allclose(xd.grad.full_tensor().numpy(), ref_in.grad.numpy(), **TOL, err_msg=reduction)
        assert tuple(xd.grad.placements) == tuple(placements), xd.grad


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_nll_loss_over_sharded_classes(run_on_ranks, mesh_shape) -> None:
    run_on_ranks(check_nll_loss, mesh_shape, world_size=int(np.prod(mesh_shape)), timeout_s=300)


def check_torch_matmul_function(world: int) -> None:
    """``torch.matmul`` (the function) decomposes below autograd: heads sharded with a
    batch of two are redistributed on the way (correct); ``@`` keeps the heads."""
    import torch

    mesh = _mesh((world,))
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, dtype=torch.float64), torch.randn(2, 4, 5, 8, dtype=torch.float64)
    qd, kd = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k))
    ref = torch.matmul(q, k.transpose(2, 3))
    got = torch.matmul(qd, kd.transpose(2, 3))
    np.testing.assert_allclose(got.full_tensor().numpy(), ref.numpy(), **TOL)
    kept, count = _collectives(lambda: qd @ kd.transpose(2, 3))
    assert count == 0 and tuple(kept.placements) == (Shard(1),), kept
    np.testing.assert_allclose(kept.full_tensor().numpy(), ref.numpy(), **TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_torch_matmul_function(run_on_ranks, world) -> None:
    run_on_ranks(check_torch_matmul_function, world, world_size=world, timeout_s=300)


def check_torch_split(mesh_shape: tuple[int, ...]) -> list:
    """``torch.split`` (sizes and one size), ``Tensor.chunk`` and ``Tensor.split`` of a
    ``[5, 6]`` DTensor (5 rows: uneven over 2 and 4) along each dim, on each placement: the
    pieces' values, their placements (core's ``dispatch_split``, the rule MindSpore's
    ``mint.split`` reaches too: ``test_mindspore_tp_surface.test_split``), and the input's
    gradient (the pieces weighted differently)."""
    import torch

    from hyper_parallel.core.dtensor.dispatch import _has_empty_piece

    mesh = _mesh(mesh_shape)
    full = np.arange(30, dtype=np.float64).reshape(5, 6)
    splits = {"sizes": (lambda t, d: torch.split(t, [2, t.shape[d] - 2], d), lambda a, d: [2]),
              "size": (lambda t, d: torch.split(t, 3, d), lambda a, d: list(range(3, a.shape[d], 3))),
              "chunk": (lambda t, d: t.chunk(2, d), lambda a, d: [-(-a.shape[d] // 2)]),
              "method": (lambda t, d: t.split(2, d), lambda a, d: list(range(2, a.shape[d], 2)))}
    out = []
    layouts = [(Shard(0),), (Shard(1),), (Replicate(),)] if len(mesh_shape) == 1 else [(Shard(0), Shard(1))]
    for placements in layouts:
        for name, (split, cuts) in splits.items():
            for dim in (0, 1):
                x = distribute_tensor(torch.tensor(full), mesh, placements).requires_grad_(True)
                pieces = split(x, dim)
                want = np.split(full, cuts(full, dim), dim)
                values_ok = len(pieces) == len(want) and all(
                    np.array_equal(piece.full_tensor().detach().numpy(), w) for piece, w in zip(pieces, want))
                gathered = [Replicate() if isinstance(pl, Shard) and pl.dim == dim else pl for pl in placements]
                empty = _has_empty_piece(full.shape, gathered, mesh.shape)
                kept = [pl for pl in gathered if not pl.is_replicate() and not empty]
                placements_ok = all(
                    [pl for pl in piece.placements if not pl.is_replicate()] == kept for piece in pieces)
                sum((k + 1.0) * p.sum() for k, p in enumerate(pieces)).backward()
                # the whole gradient (its placements follow the pieces', as torch's DTensor
                # leaves a leaf's gradient wherever the backward put it)
                want_grad = np.concatenate([np.full(w.shape, k + 1.0) for k, w in enumerate(want)], dim)
                out.append((str(placements), name, dim, values_ok, placements_ok,
                            x.grad.full_tensor().numpy(), want_grad))
    return out


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_torch_split(run_on_ranks, mesh_shape) -> None:
    """A split that took the fallback would come back Replicate, which ``placements_ok``
    rejects where the input was sharded (it did before core planned torch's split)."""
    for got in run_on_ranks(check_torch_split, mesh_shape, world_size=int(np.prod(mesh_shape)), timeout_s=300):
        for placements, name, dim, values_ok, placements_ok, grad, want_grad in got:
            what = f"{name} along {dim} of {placements}"
            assert values_ok, what
            assert placements_ok, what
            np.testing.assert_array_equal(grad, want_grad, err_msg=what)
