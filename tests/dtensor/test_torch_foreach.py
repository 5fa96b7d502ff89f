"""torch ``_foreach_*`` ops on DTensor lists (the optimizers' multi-tensor path): one call on
the local tensors when every index's DTensors share a spec without ``Partial``, else index
by index under the single-tensor rule; each way the result is the op on the whole tensors.
The one-call verdict is kept per tuple of spec objects (see ``_foreach_locals`` in
``hyper_parallel/platform/torch/dtensor.py``), so each case runs twice: the second call
takes the kept verdict.

Float64 data, 4 ranks, uneven shards ([7, 3] over 4): element-wise ops on the same values
agree exactly, so the comparisons are exact.
"""

from __future__ import annotations

import os

import pytest

from hyper_parallel import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from hyper_parallel.platform import get_platform

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="torch's _foreach_* ops")


def check_foreach() -> None:
    import torch

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (p.world_size(),))
    torch.manual_seed(0)
    full = [torch.randn(7, 3, dtype=torch.float64) for _ in range(3)]
    grads = [torch.randn(7, 3, dtype=torch.float64) for _ in range(3)]

    def dist(tensors, placement):
        # a new spec object per tensor: equal specs, distinct objects, as an optimizer sees
        return [distribute_tensor(t, mesh, [placement]) for t in tensors]

    def whole(dts):
        return [d.full_tensor() for d in dts]

    for _ in range(2):  # the second round takes the kept verdicts
        params, gs = dist(full, Shard(0)), dist(grads, Shard(0))
        # in place, a list and a ScalarList: one call
        torch._foreach_mul_(params, 0.5)
        torch._foreach_addcdiv_(params, gs, gs, [0.1, 0.2, 0.3])
        expected = [f * 0.5 + s * g / g for f, g, s in zip(full, grads, (0.1, 0.2, 0.3))]
        assert all(torch.equal(a, b) for a, b in zip(whole(params), expected))
        assert all(d.placements == (Shard(0),) for d in params)
        # out of place: results with the inputs' spec
        roots = torch._foreach_sqrt(dist([f.abs() for f in full], Shard(0)))
        assert all(r.placements == (Shard(0),) and isinstance(r, DTensor) for r in roots)
        assert all(torch.equal(a, f.abs().sqrt()) for a, f in zip(whole(roots), full))
        # placements differ at an index (Shard vs Replicate): index by index, written
        # DTensors keep their placements
        params = dist(full, Shard(0))
        mixed = dist(grads[:2], Shard(0)) + dist(grads[2:], Replicate())
        torch._foreach_add_(params, mixed)
        assert all(torch.equal(a, f + g) for a, f, g in zip(whole(params), full, grads))
        assert all(d.placements == (Shard(0),) for d in params)
        # a Partial list: index by index (the sum of the terms, then the op)
        terms = [DTensor.from_local(f.clone(), mesh, [Partial()]) for f in full]
        doubled = torch._foreach_mul(terms, 2.0)
        world = p.world_size()
        assert all(torch.equal(a, f * world * 2.0) for a, f in zip(whole(doubled), full))
    # a plain tensor with dims in a list of DTensors: refused, naming the fix
    params = dist(full, Shard(0))
    with pytest.raises(RuntimeError, match="DTensor.from_local"):
        torch._foreach_add_(params, [torch.ones(7, 3, dtype=torch.float64)] * 3)


def test_foreach_ops_on_dtensor_lists(run_on_ranks) -> None:
    run_on_ranks(check_foreach, world_size=4, timeout_s=120)


def check_attributes() -> None:
    """The attributes read without the ``__torch_function__`` round trip ([Note: attribute
    reads of a torch DTensor]) read, write and fail as a tensor's do."""
    import torch

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (p.world_size(),))
    param = torch.nn.Parameter(distribute_tensor(torch.randn(7, 3, dtype=torch.float64), mesh, [Shard(0)]))
    assert (param.grad, param.is_sparse, param.device.type, param.dtype) == (None, False, "cpu", torch.float64)
    assert param.shape == torch.Size([7, 3]) and param.requires_grad
    grad = distribute_tensor(torch.ones(7, 3, dtype=torch.float64), mesh, [Shard(0)])
    param.grad = grad
    assert param.grad is grad
    del param.grad
    assert param.grad is None
    with pytest.raises(RuntimeError, match="assign a gradient of size"):
        param.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(AttributeError, match="not writable"):
        param.device = torch.device("cpu")
    with pytest.warns(UserWarning, match="not a leaf"):
        assert (param * 2).grad is None


def test_attribute_reads(run_on_ranks) -> None:
    run_on_ranks(check_attributes, world_size=2, timeout_s=120)
