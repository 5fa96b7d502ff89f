"""Tensor parallelism: a TP-parallelized MLP, attention block and sequence-parallel block
against the unsharded module (outputs, input and parameter gradients, one AdamW step).

float32: the sharded GEMMs add their partial sums in a different order from the full
GEMM, so values agree to a few ulps of the magnitudes (atol/rtol 1e-5)."""

from __future__ import annotations

import fnmatch

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, Replicate, Shard, init_device_mesh
from hyper_parallel.core.tensor_parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                  SequenceParallel, parallelize_module)
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import chunk
from tests.tensor_parallel._models import build, optimizer_step, weights

TOL = dict(rtol=1e-5, atol=1e-5)


def _plan(kind: str) -> dict:
    if kind == "mlp":
        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if kind == "attention":
        return {"w[qkv]": ColwiseParallel(), "wo": RowwiseParallel()}
    return {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Shard(1))}


def _shard(value: np.ndarray, placement, n: int, r: int) -> np.ndarray:
    if isinstance(placement, Shard):
        start, length = chunk(value.shape[placement.dim], n, r)
        return np.take(value, range(start, start + length), axis=placement.dim)
    return value


def _local(p, x) -> np.ndarray:
    """A DTensor's local piece (parameters; torch's gradients), a plain tensor's values."""
    return p.to_numpy(x.to_local() if isinstance(x, DTensor) else x)


def check_parity(kind: str, kv_heads: int = 4) -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (n,), mesh_dim_names=("tp",))
    values = weights(kind, kv_heads=kv_heads)
    ref, tp = build(p, kind, values), build(p, kind, values)
    plan = _plan(kind)
    parallelize_module(tp, mesh["tp"], plan)
    placements = {}
    for pattern, style in plan.items():
        for name in values:
            module_name, _, leaf = name.rpartition(".")
            if fnmatch.fnmatchcase(module_name, pattern):
                placements[name] = style.parameter_placements().get(leaf, Replicate())
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 6)).astype(np.float32)  # [batch, seq, dim]
    g = rng.standard_normal((2, 4, 6)).astype(np.float32)
    seq = Shard(1) if kind == "sp_block" else Replicate()

    ref_named = list(p.named_parameters(ref))
    ref_params = [param for _, param in ref_named]
    tp_named = list(p.named_parameters(tp))
    assert [name for name, _ in tp_named] == [name for name, _ in ref_named] and len(tp_named) == len(values)
    for name, param in tp_named:
        # every parameter of a parallelized module is a DTensor of the global shape
        assert isinstance(param, DTensor) and tuple(param.shape) == values[name].shape, (name, type(param))
        assert list(param.placements) == [placements.get(name, Replicate())], (name, param.placements)
        np.testing.assert_array_equal(_local(p, param), _shard(values[name], placements.get(name), n, r),
                                      err_msg=f"{name}: the parameter should hold this rank's shard")
    # Each model's forward and backward run back to back: MindSpore 2.10's PyNative
    # autograd lost the first graph ("Can not find top cell for backward") when two vjp
    # recordings of these hooked models were interleaved.
    ref_out, ref_backward = p.vjp(ref, [p.from_numpy(x)], ref_params)
    (ref_gx,), ref_grads = ref_backward([p.from_numpy(g)])
    tp_out, tp_backward = p.vjp(tp, [p.from_numpy(_shard(x, seq, n, r))], [param for _, param in tp_named])
    (tp_gx,), tp_grads = tp_backward([p.from_numpy(_shard(g, seq, n, r))])
    np.testing.assert_allclose(p.to_numpy(tp_out), _shard(p.to_numpy(ref_out), seq, n, r), **TOL)
    np.testing.assert_allclose(p.to_numpy(tp_gx), _shard(p.to_numpy(ref_gx), seq, n, r), **TOL,
                               err_msg="input gradient")
    for (name, _), ref_grad, tp_grad in zip(tp_named, ref_grads, tp_grads):
        if p.framework == "torch":  # MindSpore's value_and_grad returns the local pieces
            assert isinstance(tp_grad, DTensor) and list(tp_grad.placements) == [placements.get(name, Replicate())]
        np.testing.assert_allclose(_local(p, tp_grad), _shard(p.to_numpy(ref_grad), placements.get(name), n, r),
                                   **TOL, err_msg=f"gradient of {name}")

    optimizer_step(p, ref_params, ref_grads)
    optimizer_step(p, [param for _, param in tp_named], tp_grads)
    for (name, tp_param), ref_param in zip(tp_named, ref_params):
        np.testing.assert_allclose(_local(p, tp_param), _shard(p.to_numpy(ref_param), placements.get(name), n, r),
                                   **TOL, err_msg=f"{name} after one AdamW step")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["mlp", "attention", "sp_block"])
def test_tensor_parallel_parity(run_on_ranks, kind: str, world_size: int) -> None:
    run_on_ranks(check_parity, kind, world_size=world_size)


def test_attention_gqa(run_on_ranks) -> None:
    run_on_ranks(check_parity, "attention", 2, world_size=2)


def _swapped(p, values: dict, mesh, plan: dict) -> None:
    model = build(p, "mlp", values)
    parallelize_module(model, mesh, plan)
    model(p.from_numpy(np.ones((2, 6), np.float32)))


def check_prepare_module_input_and_errors() -> None:
    p = get_platform()
    n = p.world_size()
    mesh = init_device_mesh(p.device_type, (n,))
    values = weights("mlp")
    model = build(p, "mlp", values)
    parallelize_module(model, mesh, {"fc1": PrepareModuleInput(input_layouts=[Shard(0)],
                                                                desired_input_layouts=[Replicate()])})
    x = np.random.default_rng(2).standard_normal((2 * n, 6)).astype(np.float32)
    start, length = chunk(2 * n, n, p.rank())
    out = model(p.from_numpy(x[start:start + length]))  # fc1 gets the all-gathered batch
    ref = build(p, "mlp", values)
    np.testing.assert_allclose(p.to_numpy(out), p.to_numpy(ref(p.from_numpy(x))), **TOL)
    for call, needle in [
        (lambda: parallelize_module(build(p, "mlp", values), mesh, {"fc9": ColwiseParallel()}), "matches no submodule"),
        (lambda: parallelize_module(build(p, "mlp", values), mesh, {"fc1": "colwise"}), "is not a ParallelStyle"),
        (lambda: PrepareModuleInput(input_layouts=[Shard(0)], desired_input_layouts=[]), "desired_input_layouts"),
        # a plan with the styles swapped, or two column-parallel layers in a row: refused on
        # every rank at the layer's input (a local check, before any collective), naming
        # what the style expects and the fix
        (lambda: _swapped(p, values, mesh, {"fc1": RowwiseParallel(), "fc2": ColwiseParallel()}),
         "RowwiseParallel on Linear (in_features=6): expects its input sharded on the last dim"),
        (lambda: _swapped(p, values, mesh, {"fc1": ColwiseParallel(), "fc2": ColwiseParallel()}),
         "ColwiseParallel on Linear (in_features=7): expects its input whole on every rank"),
    ]:
        try:
            call()
        except (TypeError, ValueError) as err:
            assert needle in str(err), str(err)
        else:
            raise AssertionError(f"no error mentioning {needle!r}")
    if n == 4:
        mesh_2d = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
        try:
            parallelize_module(build(p, "mlp", values), mesh_2d, {"fc1": ColwiseParallel()})
        except ValueError as err:
            assert "1-D mesh" in str(err) and "mesh['tp']" in str(err)
        else:
            raise AssertionError("a 2-D mesh was accepted")


@pytest.mark.parametrize("world_size", [2, 4])
def test_prepare_module_input_and_errors(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_prepare_module_input_and_errors, world_size=world_size)
