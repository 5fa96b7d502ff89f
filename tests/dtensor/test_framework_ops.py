"""DTensors as framework tensors: a model written only with the framework's own layers and
functions, whose parameters are DTensors (``torch.nn.Parameter(distribute_tensor(...))``,
``mindspore.Parameter(distribute_tensor(...))``), trains with the framework's own AdamW to
the losses, gradients and parameters of one process, clipping every step by the global
gradient norm (torch's own ``clip_grad_norm_``, with ``foreach`` both ways, and AdamW's
``foreach`` both ways; on MindSpore ``hyper_parallel.clip_grads_by_global_norm``, since
``value_and_grad`` gives local pieces), with attention through torch's fused SDPA;
plus ``SkipDTensorDispatch``, in-place ops and the fallback of an op without a rule.

Float64 data: the tolerance (1e-10) absorbs the different summation orders of sharded
matmuls, reductions and the norm's partial sums.
"""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import pytest

from hyper_parallel import (
    DTensor,
    Replicate,
    Shard,
    SkipDTensorDispatch,
    clip_grads_by_global_norm,
    distribute_tensor,
    global_grad_norm,
    init_device_mesh,
)
from hyper_parallel.platform import get_platform

ON_MINDSPORE = os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore")
torch_only = pytest.mark.skipif(ON_MINDSPORE, reason="torch's layers, AdamW foreach, clip_grad_norm_ and SDPA")
mindspore_only = pytest.mark.skipif(not ON_MINDSPORE, reason="MindSpore's mint layers and AdamW")

TOL = {"rtol": 1e-10, "atol": 1e-10}
VOCAB, DIM, HIDDEN, BATCH, SEQ = 13, 8, 10, 4, 5
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 2

# tensor-parallel placements of each parameter (Megatron: column-parallel in, row-parallel out)
# (the embedding table is vocabulary parallel: Shard(0) over its rows)
TP = {"embed.weight": Shard(0), "norm1": Replicate(), "wq.weight": Shard(0), "wk.weight": Shard(0),
      "wv.weight": Shard(0), "wo.weight": Shard(1), "norm2": Replicate(), "w1.weight": Shard(0),
      "w3.weight": Shard(0), "w2.weight": Shard(1), "norm3": Replicate(), "head.weight": Shard(0)}


def build_model():
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float64))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    def linear(fan_in: int, fan_out: int):
        return nn.Linear(fan_in, fan_out, bias=False, dtype=torch.float64)

    class Model(nn.Module):
        """Embedding; causal grouped-query attention (torch's fused SDPA) and a SwiGLU MLP,
        each after an RMSNorm with a residual; RMSNorm; vocabulary head."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
            self.norm1 = RMSNorm(DIM)
            self.wq, self.wo = linear(DIM, HEADS * HEAD_DIM), linear(HEADS * HEAD_DIM, DIM)
            self.wk, self.wv = linear(DIM, KV_HEADS * HEAD_DIM), linear(DIM, KV_HEADS * HEAD_DIM)
            self.norm2 = RMSNorm(DIM)
            self.w1, self.w3, self.w2 = linear(DIM, HIDDEN), linear(DIM, HIDDEN), linear(HIDDEN, DIM)
            self.norm3 = RMSNorm(DIM)
            self.head = linear(DIM, VOCAB)

        def attention(self, h):
            b, s, _ = h.shape
            q = self.wq(h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
            k = self.wk(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = self.wv(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))

        def forward(self, ids):
            x = self.embed(ids)
            x = x + self.attention(self.norm1(x))
            h = self.norm2(x)
            x = x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))
            return self.head(self.norm3(x))

    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _param_names(model) -> list[str]:
    return [name.replace(".weight", "") if name.startswith("norm") else name for name, _ in model.named_parameters()]


def train(mesh_shape: tuple[int, ...] | None, foreach: bool, steps: int = 3) -> dict:
    """Train ``steps`` AdamW steps with clipping; ``mesh_shape`` None: one process on
    plain tensors, else a (tp,) or (dp, tp) mesh with DTensor parameters and batch."""
    import torch
    import torch.nn.functional as F

    p = get_platform()
    model = build_model()
    rng = np.random.default_rng(3)
    batches = [(torch.from_numpy(rng.integers(0, VOCAB, (BATCH, SEQ))),
                torch.from_numpy(rng.integers(0, VOCAB, (BATCH, SEQ)))) for _ in range(steps)]
    mesh = None
    if mesh_shape is not None:
        names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
        mesh = init_device_mesh(p.device_type, mesh_shape, mesh_dim_names=names)
        for (name, module_param), key in zip(list(model.named_parameters()), _param_names(model)):
            placements = [TP[key] if axis == "tp" else Replicate() for axis in names]
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            dparam = torch.nn.Parameter(distribute_tensor(module_param.detach(), mesh, placements))
            assert isinstance(dparam, DTensor) and dparam.shape == module_param.shape
            setattr(owner, name.rsplit(".", 1)[-1], dparam)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, foreach=foreach)
    record: dict = {"loss": [], "norm": [], "grads": []}
    for ids, target in batches:
        if mesh is not None:
            batch = [Shard(0) if axis == "dp" else Replicate() for axis in mesh.mesh_dim_names]
            ids = distribute_tensor(ids, mesh, batch)
            target = distribute_tensor(target, mesh, batch)
        logits = model(ids)
        if mesh is not None:
            # the logits go into torch's cross-entropy as DTensors (never gathered when
            # their classes are sharded)
            assert isinstance(logits, DTensor) and logits.shape == (BATCH, SEQ, VOCAB), repr(logits)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        grads = [param.grad for param in model.parameters()]
        if mesh is not None:
            assert all(isinstance(g, DTensor) for g in grads), [type(g) for g in grads]
            grads = [g.full_tensor() for g in grads]
        record["grads"].append([g.detach().numpy().copy() for g in grads])
        if mesh is not None:  # hyper_parallel's norm from the pieces agrees with torch's
            record.setdefault("hp_norm", []).append(
                float(global_grad_norm(list(model.parameters()), [q.grad for q in model.parameters()])))
        # a small max_norm, so that every step clips
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, foreach=foreach)
        record["norm"].append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        record["loss"].append(float(loss))
        optimizer.step()
    record["params"] = [(param.full_tensor() if isinstance(param, DTensor) else param).detach().numpy()
                        for param in model.parameters()]
    return record


def check_training(mesh_shape: tuple[int, ...]) -> int:
    for foreach in (True, False):
        ref = train(None, foreach)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train(mesh_shape, foreach)
        # every op the model, its backward, AdamW and clip_grad_norm_ reach has a rule
        fallbacks = sorted({str(w.message).split("'")[1] for w in caught if "no sharding rule" in str(w.message)})
        assert not fallbacks, f"ops that took the replicate fallback: {fallbacks}"
        where = f"mesh {mesh_shape}, foreach={foreach}"
        np.testing.assert_allclose(got["loss"], ref["loss"], **TOL, err_msg=f"{where}: losses")
        np.testing.assert_allclose(got["norm"], ref["norm"], **TOL, err_msg=f"{where}: gradient norms")
        np.testing.assert_allclose(got["hp_norm"], ref["norm"], **TOL, err_msg=f"{where}: global_grad_norm")
        assert min(ref["norm"]) > 0.5, f"max_norm 0.5 should clip every step: {ref['norm']}"
        for step, (g_got, g_ref) in enumerate(zip(got["grads"], ref["grads"])):
            for i, (a, b) in enumerate(zip(g_got, g_ref)):
                np.testing.assert_allclose(a, b, **TOL, err_msg=f"{where}: step {step} gradient {i}")
        for i, (a, b) in enumerate(zip(got["params"], ref["params"])):
            np.testing.assert_allclose(a, b, **TOL, err_msg=f"{where}: parameter {i} after the steps")
    return 1


@torch_only
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_torch_layers_and_adamw_on_dtensor_parameters(run_on_ranks, mesh_shape: tuple[int, ...]) -> None:
    world = int(np.prod(mesh_shape))
    assert run_on_ranks(check_training, mesh_shape, world_size=world, timeout_s=300) == [1] * world


def check_skip_and_inplace() -> None:
    import torch

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    rank = mesh.get_local_rank()
    full = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    with SkipDTensorDispatch():
        local_sum = dt + dt
        assert type(local_sum) is torch.Tensor and torch.equal(local_sum, 2 * full[2 * rank:2 * rank + 2])
        assert dt.mul_(3) is dt  # in-place on the local shard, the DTensor returned
        with SkipDTensorDispatch():  # re-entrant
            assert type(dt.sum()) is torch.Tensor
    assert isinstance(dt + dt, DTensor)
    assert torch.equal(dt.full_tensor(), 3 * full)

    # in-place ops keep the written DTensor's placements, whatever the other input's
    rep = distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [Replicate()])
    assert rep.add_(dt) is rep and rep.placements == (Replicate(),)
    assert torch.equal(rep.to_local(), 1 + 3 * full)
    dt.add_(rep)
    assert dt.placements == (Shard(0),) and torch.equal(dt.full_tensor(), 1 + 6 * full)

    # copy.deepcopy (of a module, too) copies the local tensors and shares the mesh
    param = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    twin = copy.deepcopy(torch.nn.ParameterList([param]))[0]
    assert isinstance(twin, DTensor) and twin.placements == (Shard(0),) and twin.requires_grad
    assert torch.equal(twin.full_tensor(), full) and twin.to_local().data_ptr() != param.to_local().data_ptr()
    assert twin.device_mesh is param.device_mesh

    # an op without a rule: inputs to Replicate, one warning naming it, a right answer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.cumsum(dt, 0)
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    assert torch.equal(out.to_local(), torch.cumsum(1 + 6 * full, 0))
    assert any("cumsum" in str(w.message) and "no sharding rule" in str(w.message) for w in caught)

    # reductions, views and norms keep shards where they can
    assert dt.sum(0).placements[0].is_partial() and torch.equal(dt.sum(0).full_tensor(), (1 + 6 * full).sum(0))
    assert dt.t().placements == (Shard(1),) and dt.reshape(2, 2, 3).placements == (Shard(0),)
    norm = torch.linalg.vector_norm(dt)
    assert torch.allclose(norm.full_tensor(), torch.linalg.vector_norm(1 + 6 * full), rtol=1e-14)
    assert float(norm) == pytest.approx(float(torch.linalg.vector_norm(1 + 6 * full)), rel=1e-14)


@torch_only
@pytest.mark.parametrize("world_size", [2])
def test_skip_dispatch_inplace_and_fallback(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_skip_and_inplace, world_size=world_size, timeout_s=120)


# -- MindSpore: mint layers, ops.gather embedding, mindspore.experimental.optim.AdamW ----------
MS_MAX_NORM = 0.5
MS_TP = {"embed": Shard(0), "norm1.weight": Replicate(), "w1.weight": Shard(0), "w3.weight": Shard(0),
         "w2.weight": Shard(1), "norm2.weight": Replicate(), "head.weight": Shard(0)}


def _ms_model(values: dict, mesh=None, placements=None):
    import mindspore as ms
    from mindspore import Parameter, mint, nn, ops

    p = get_platform()

    def param(name: str):
        value = p.from_numpy(values[name])
        if mesh is not None:
            value = distribute_tensor(value, mesh, placements[name])
        return Parameter(value, name=name)

    class Linear(nn.Cell):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.weight = param(f"{name}.weight")

        def construct(self, x):
            return mint.nn.functional.linear(x, self.weight)

    class RMSNorm(nn.Cell):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.weight = param(f"{name}.weight")

        def construct(self, x):
            return x * mint.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * self.weight

    class Model(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.embed = param("embed")
            self.norm1, self.norm2 = RMSNorm("norm1"), RMSNorm("norm2")
            self.w1, self.w3, self.w2, self.head = Linear("w1"), Linear("w3"), Linear("w2"), Linear("head")

        def construct(self, ids):
            x = ops.gather(self.embed, ids, 0)
            h = self.norm1(x)
            x = x + self.w2(mint.nn.functional.silu(self.w1(h)) * self.w3(h))
            return self.head(self.norm2(x))

    del ms
    return Model()


def _ms_train(mesh_shape: tuple[int, ...] | None, steps: int = 3) -> dict:
    import mindspore as ms
    from mindspore import ops
    from mindspore.experimental.optim import AdamW

    from tests.dtensor._reference import expected_local

    p = get_platform()
    rng = np.random.default_rng(0)
    shapes = {"embed": (VOCAB, DIM), "norm1.weight": (DIM,), "w1.weight": (HIDDEN, DIM),
              "w3.weight": (HIDDEN, DIM), "w2.weight": (DIM, HIDDEN), "norm2.weight": (DIM,), "head.weight": (VOCAB, DIM)}
    values = {name: (1.0 if name.startswith("norm") else 0.0) + 0.3 * rng.standard_normal(shape)
              for name, shape in shapes.items()}
    mesh = placements = None
    if mesh_shape is not None:
        names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
        mesh = init_device_mesh(p.device_type, mesh_shape, mesh_dim_names=names)
        placements = {name: [pl if axis == "tp" else Replicate() for axis in names] for name, pl in MS_TP.items()}
    model = _ms_model(values, mesh, placements)
    params = model.trainable_params()
    order = [param.name for param in params]
    optimizer = AdamW(params, lr=0.05, weight_decay=0.1)
    data = np.random.default_rng(3)
    record: dict = {"loss": [], "grads": []}
    for _ in range(steps):
        ids = p.from_numpy(data.integers(0, VOCAB, (BATCH, SEQ)))
        target = p.from_numpy(data.integers(0, VOCAB, (BATCH * SEQ,)).astype(np.int32))
        if mesh is not None:
            batch = [Shard(0) if axis == "dp" else Replicate() for axis in mesh.mesh_dim_names]
            ids = distribute_tensor(ids, mesh, batch)

        def loss_fn(ids):
            logits = model(ids)
            if mesh is not None:
                assert isinstance(logits, DTensor) and tuple(logits.shape) == (BATCH, SEQ, VOCAB), repr(logits)
                logits = logits.full_tensor()
            return ops.cross_entropy(logits.reshape(-1, VOCAB), target)

        loss, grads = ms.value_and_grad(loss_fn, None, params)(ids)
        record["loss"].append(float(loss.asnumpy()))
        record["grads"].append([g.asnumpy().copy() for g in grads])
        # clipping by the global norm, with max_norm small enough to clip every step
        if mesh is not None:
            grads, norm = clip_grads_by_global_norm(params, grads, MS_MAX_NORM)
            record.setdefault("norm", []).append(float(norm.asnumpy()))
        else:
            norm = float(np.sqrt(sum(np.sum(g.asnumpy() ** 2) for g in grads)))
            record.setdefault("norm", []).append(norm)
            grads = tuple(g * min(1.0, MS_MAX_NORM / (norm + 1e-6)) for g in grads)
        optimizer(tuple(grads))
    if mesh is not None:
        coordinate = mesh.get_coordinate()
        record["expect"] = lambda name, full: expected_local(full, placements[name], mesh.shape, coordinate)
        record["params"] = {name: param.full_tensor().asnumpy() for name, param in zip(order, params)}
    else:
        record["params"] = {name: param.asnumpy() for name, param in zip(order, params)}
    record["order"] = order
    return record


def check_training_mindspore(mesh_shape: tuple[int, ...]) -> int:
    ref = _ms_train(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _ms_train(mesh_shape)
    fallbacks = sorted({str(w.message).split("'")[1] for w in caught if "no sharding rule" in str(w.message)})
    assert not fallbacks, f"ops that took the replicate fallback: {fallbacks}"
    where = f"mesh {mesh_shape}"
    for step, (g_got, g_ref) in enumerate(zip(got["grads"], ref["grads"])):
        for name, a, b in zip(got["order"], g_got, g_ref):
            # value_and_grad gives each DTensor parameter the gradient of its local piece
            np.testing.assert_allclose(a, got["expect"](name, b), **TOL, err_msg=f"{where}: step {step} {name}")
    np.testing.assert_allclose(got["loss"], ref["loss"], **TOL, err_msg=f"{where}: losses")
    assert min(ref["norm"]) > MS_MAX_NORM, ref["norm"]
    np.testing.assert_allclose(got["norm"], ref["norm"], **TOL, err_msg=f"{where}: clip_grads_by_global_norm's norm")
    for name in got["order"]:
        np.testing.assert_allclose(got["params"][name], ref["params"][name], **TOL,
                                   err_msg=f"{where}: {name} after the steps")
    return 1


def check_mindspore_inplace() -> int:
    """``Tensor.mul_`` / ``add_`` / ``sub_`` / ``div_`` on MindSpore DTensors write the local
    pieces (MindSpore 2.10's CPU kernels of these return a new tensor and leave their input
    unchanged, even on a plain tensor), first through the full dispatch and then from the
    dispatch cache; each returns the DTensor it wrote."""
    import mindspore as ms

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    full = np.arange(12, dtype=np.float32).reshape(4, 3)
    for _ in range(2):  # the second pass runs from the dispatch cache
        dt = distribute_tensor(ms.Tensor(full), mesh, [Shard(0)])
        rep = distribute_tensor(ms.Tensor(np.ones((4, 3), np.float32)), mesh, [Replicate()])
        assert dt.mul_(3.0) is dt and dt.add_(rep) is dt and dt.sub_(1.0) is dt and dt.div_(2.0) is dt
        assert rep.add_(dt) is rep and rep.placements == (Replicate(),) and dt.placements == (Shard(0),)
        np.testing.assert_array_equal(p.to_numpy(dt.full_tensor()), 1.5 * full)
        np.testing.assert_array_equal(p.to_numpy(rep.full_tensor()), 1 + 1.5 * full)
    # an in-place primitive without a rule is refused by name, not run on copies
    with pytest.raises(RuntimeError, match="InplaceClampScalar on a DTensor: this in-place operation has no"):
        dt.clamp_(0.0, 1.0)
    np.testing.assert_array_equal(p.to_numpy(dt.full_tensor()), 1.5 * full)
    return 1


@mindspore_only
def test_mindspore_inplace_arithmetic_writes(run_on_ranks) -> None:
    assert run_on_ranks(check_mindspore_inplace, world_size=2, timeout_s=120) == [1, 1]


@mindspore_only
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_mindspore_layers_and_adamw_on_dtensor_parameters(run_on_ranks, mesh_shape: tuple[int, ...]) -> None:
    world = int(np.prod(mesh_shape))
    assert run_on_ranks(check_training_mindspore, mesh_shape, world_size=world, timeout_s=600) == [1] * world


def check_norm_bad_input() -> None:
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (p.world_size(),))
    param = distribute_tensor(p.from_numpy(np.ones((4, 3))), mesh, [Shard(0)])
    plain = p.from_numpy(np.ones((4, 3)))
    for call, error, text in (
            (lambda: global_grad_norm([plain], [plain]), TypeError, "not a DTensor; its layout over the ranks"),
            (lambda: global_grad_norm([param], []), ValueError, "1 parameters but 0 gradients"),
            (lambda: global_grad_norm([param], [None], norm_type=0.0), ValueError, "norm_type=0.0")):
        with pytest.raises(error) as err:
            call()
        assert text in str(err.value), str(err.value)


def test_global_grad_norm_bad_input(run_on_ranks) -> None:
    run_on_ranks(check_norm_bad_input, world_size=2, timeout_s=120)


def check_vocab_parallel_cross_entropy(mesh_shape: tuple[int, ...]) -> None:
    """Class-sharded logits: torch's own ``F.cross_entropy`` (with its default
    ``ignore_index=-100`` hit by one row) on torch, ``dtensor_functional.cross_entropy``
    on MindSpore; loss and the logits' gradient against one process, never gathering
    the logits (every reduction)."""
    from hyper_parallel import dtensor_functional as HF
    from tests.dtensor._reference import expected_local

    p = get_platform()
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = init_device_mesh(p.device_type, mesh_shape, mesh_dim_names=names)
    rng = np.random.default_rng(0)
    logits, target = rng.standard_normal((6, 11)), rng.integers(0, 11, (6,)).astype(np.int64)
    if p.framework == "torch":
        target[2] = -100
    logit_pl = [Shard(1) if a == "tp" else Shard(0) for a in names]
    row_pl = [Replicate() if a == "tp" else Shard(0) for a in names]

    def loss_fn(reduction, sharded):
        def fn(x):
            t = p.from_numpy(target)
            if sharded:
                x, t = DTensor.from_local(x, mesh, logit_pl, shape=logits.shape), distribute_tensor(t, mesh, row_pl)
            if p.framework == "torch":
                import torch.nn.functional as F
                out = F.cross_entropy(x, t, reduction=reduction)
            else:
                out = HF.cross_entropy(x, t, reduction)
            return out.full_tensor() if sharded else out
        return fn

    coordinate = mesh.get_coordinate()
    for reduction in ("none", "sum", "mean"):
        ref, ref_back = p.vjp(loss_fn(reduction, False), [p.from_numpy(logits)])
        g = np.asarray(np.random.default_rng(1).standard_normal(p.to_numpy(ref).shape))
        seed = p.from_numpy(g.reshape(-1)).reshape(g.shape)  # 0-dim for the reductions
        (ref_grad,), _ = ref_back([seed])
        local = p.from_numpy(expected_local(logits, logit_pl, mesh.shape, coordinate))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, back = p.vjp(loss_fn(reduction, True), [local])
        assert not [w for w in caught if "no sharding rule" in str(w.message)], [str(w.message) for w in caught]
        np.testing.assert_allclose(p.to_numpy(got), p.to_numpy(ref), **TOL, err_msg=f"{reduction}: loss")
        (grad,), _ = back([seed])
        np.testing.assert_allclose(p.to_numpy(grad), expected_local(p.to_numpy(ref_grad), logit_pl, mesh.shape,
                                                                    coordinate), **TOL, err_msg=f"{reduction}: grad")


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_vocab_parallel_cross_entropy(run_on_ranks, mesh_shape: tuple[int, ...]) -> None:
    run_on_ranks(check_vocab_parallel_cross_entropy, mesh_shape, world_size=int(np.prod(mesh_shape)), timeout_s=300)
