"""fully_shard composed with tensor parallelism (torchtitan's order: parallelize_module
over ``mesh2d["tp"]``, then fully_shard over ``mesh2d["dp"]``) on a (dp 2, tp 2) mesh:
AdamW steps beside a single-process copy: losses each step, the sharded gradients of
the first step, the parameters at the end; an MLP (fc1 its own unit) and a causal
attention block (``reshard_after_forward=1``: blocks over the dp submesh).

Tolerance: as in test_fully_shard (rtol 2e-4 / atol 2e-5): the tensor-parallel
partial sums and the data-parallel gradient sums add in another order than the
full-batch GEMMs (float32 ulps, kept relative by Adam); a wrong shard or a missing
reduction is off by O(1)."""

from __future__ import annotations

import fnmatch

import numpy as np

from hyper_parallel.core.dtensor import Replicate, Shard, init_device_mesh
from hyper_parallel.core.fully_shard import full_state_dict, fully_shard, hsdp_state
from hyper_parallel.core.tensor_parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import chunk
from tests.fully_shard._models import Trainer
from tests.tensor_parallel._models import build, weights

TOL = dict(rtol=2e-4, atol=2e-5)
STEPS = 4
PLANS = {"mlp": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
         "attention": {"w[qkv]": ColwiseParallel(), "wo": RowwiseParallel()}}


def _data(step: int) -> np.ndarray:
    return np.random.default_rng(300 + step).standard_normal((4, 4, 6)).astype(np.float32)  # [batch, seq, dim]


def _tp_local(value: np.ndarray, placement, n: int, r: int) -> np.ndarray:
    if isinstance(placement, Shard):
        start, length = chunk(value.shape[placement.dim], n, r)
        return np.take(value, range(start, start + length), axis=placement.dim)
    return value


def _placements(kind: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        for pattern, style in PLANS[kind].items():
            if fnmatch.fnmatchcase(module_name, pattern):
                out[name] = style.parameter_placements().get(leaf, Replicate())
    return out


def _reference(p, kind: str) -> tuple[list[float], dict, dict]:
    ref = build(p, kind, weights(kind))
    trainer = Trainer(p, ref)
    losses, grads = [], {}
    for step in range(STEPS):
        losses.append(trainer.backward(_data(step)))
        if step == 0:
            grads = {name: g for (name, _), g in zip(p.named_parameters(ref), trainer.grad_arrays())}
        trainer.step()
    return losses, grads, {name: p.to_numpy(param) for name, param in p.named_parameters(ref)}


def check_tp_fully_shard() -> None:
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    for kind in ("mlp", "attention"):
        ref_losses, ref_grads, ref_params = _reference(p, kind)
        model = build(p, kind, weights(kind))
        parallelize_module(model, mesh["tp"], PLANS[kind])
        units = []
        if kind == "mlp":  # a unit on a module that also carries tensor-parallel hooks
            units.append(fully_shard(model.fc1, mesh=mesh["dp"]))
            units.append(fully_shard(model, mesh=mesh["dp"]))
        else:
            units.append(fully_shard(model, mesh=mesh["dp"], reshard_after_forward=1))
        managed = {id(hp.sharded): hp for unit in units for hp in hsdp_state(unit).params}
        names = [name for name, _ in p.named_parameters(model)]
        placements = _placements(kind, names)
        trainer = Trainer(p, model)
        for step in range(STEPS):
            loss = trainer.backward(_data(step)[2 * dp:2 * dp + 2])
            if step == 0:
                for name, param, grad in zip(names, trainer.params, trainer.grad_arrays()):
                    hp = managed[id(param)]
                    expected = _tp_local(ref_grads[name], placements.get(name, Replicate()), 2, tp)
                    assert hp.shape == expected.shape, (kind, name, hp.shape, expected.shape)
                    start, length = chunk(hp.shape[0], 2, dp)
                    expected = np.pad(expected[start:start + length], [(0, hp.chunk - length)] +
                                      [(0, 0)] * (expected.ndim - 1))
                    np.testing.assert_allclose(grad, expected, **TOL, err_msg=f"{kind}: gradient of {name} at step 0")
            trainer.step()
            # tp ranks of a dp group hold the same loss: the world mean is the dp mean
            total = float(p.to_numpy(p.all_reduce(p.from_numpy(np.array([loss], np.float32))).wait())[0]) / 4
            np.testing.assert_allclose(total, ref_losses[step], **TOL, err_msg=f"{kind}: loss of step {step}")
        for name, param in p.named_parameters(model):
            full = p.to_numpy(managed[id(param)].to_dtensor().full_tensor())  # gathered over dp: the TP shard
            expected = _tp_local(ref_params[name], placements.get(name, Replicate()), 2, tp)
            np.testing.assert_allclose(full, expected, **TOL, err_msg=f"{kind}: {name} after training")
        try:
            full_state_dict(model)
        except ValueError as err:
            assert "sharded over a submesh" in str(err), str(err)
        else:
            raise AssertionError("full_state_dict of a submesh-sharded model accepted")
    # SequenceParallel's gradient all-reduce is a hook on the parameter object: refused.
    model = build(p, "sp_block", weights("sp_block"))
    parallelize_module(model, mesh["tp"], {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
                                           "fc2": RowwiseParallel(output_layouts=Shard(1))})
    try:
        fully_shard(model, mesh=mesh["dp"])
    except ValueError as err:
        assert "norm.weight belongs to a SequenceParallel module" in str(err), str(err)
    else:
        raise AssertionError("fully_shard over SequenceParallel parameters accepted")


def test_tp_then_fully_shard(run_on_ranks) -> None:
    run_on_ranks(check_tp_fully_shard, world_size=4, timeout_s=600)
