"""fully_shard composed with tensor parallelism (torchtitan's order: parallelize_module
over ``mesh2d["tp"]``, then fully_shard over ``mesh2d["dp"]``) on a (dp 2, tp 2) mesh:
AdamW steps beside a single-process copy: losses each step, the sharded gradients of
the first step, the parameters at the end; an MLP (fc1 its own unit), a causal
attention block (``reshard_after_forward=1``: blocks over the dp submesh) and a
sequence-parallel block (norm under ``SequenceParallel`` on sequence slices). Then the
state dicts of each trained model: full (gathered over dp, then tp, on rank 0) and
sharded files, loaded back into fresh TP x fully_shard models and into a plain one.

Tolerance: as in test_fully_shard (rtol 2e-4 / atol 2e-5): the tensor-parallel
partial sums and the data-parallel gradient sums add in another order than the
full-batch GEMMs (float32 ulps, kept relative by Adam); a wrong shard or a missing
reduction is off by O(1)."""

from __future__ import annotations

import fnmatch
import os

import numpy as np
import pytest

from hyper_parallel.core.dtensor import (DTensor, Replicate, Shard, distribute_module, distribute_parameter,
                                         init_device_mesh)
from hyper_parallel.core.fully_shard import (full_state_dict, fully_shard, hsdp_state, load_full_state_dict,
                                             load_sharded_state_dict, save_sharded_state_dict)
from hyper_parallel.core.tensor_parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import chunk
from tests.fully_shard._models import Trainer
from tests.tensor_parallel._models import build, weights
from hyper_parallel.core.process_groups import barrier

TOL = dict(rtol=2e-4, atol=2e-5)
STEPS = 4
PLANS = {"mlp": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
         "attention": {"w[qkv]": ColwiseParallel(), "wo": RowwiseParallel()},
         # sequence parallel: the norm on this rank's slice of the sequence, whose
         # gradient all-reduce over tp fully_shard does on the gathered parameter
         "sp_block": {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
                      "fc2": RowwiseParallel(output_layouts=Shard(1))}}


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


def _dp_mesh(mesh):
    """The data-parallel submesh: ``dp`` (1-D), or ``(replicate, shard)`` for HSDP x TP."""
    return mesh["replicate", "shard"] if mesh.ndim == 3 else mesh["dp"]


def _distribute(model, tp_mesh, kind: str) -> None:
    """``PLANS[kind]``'s parameter placements through ``distribute_module``: the module
    computes on DTensors (torch's and MindFormers' tensor-parallel styles do), its input
    a replicated DTensor, its output made replicated and local."""

    placements = _placements(kind, [name for name, _ in get_platform().named_parameters(model)])

    def partition(fqn, submodule, device_mesh):
        for name, placement in placements.items():
            module_name, _, leaf = name.rpartition(".")
            if module_name == fqn:
                distribute_parameter(submodule, leaf, device_mesh, [placement])

    def output(mod, out, device_mesh):
        return out.redistribute(device_mesh, [Replicate()]).to_local()

    distribute_module(model, tp_mesh, partition,
                      input_fn=lambda mod, args, m: (DTensor.from_local(args[0], m, [Replicate()]),),
                      output_fn=output)


def _tp_fully_shard(p, kind: str, mesh, values: dict, dtensor_forward: bool = False) -> tuple:
    """parallelize_module over tp (or, ``dtensor_forward``, its placements through
    ``distribute_module``), then fully_shard over dp; ``(model, units)``."""
    model = build(p, kind, values)
    if dtensor_forward:
        _distribute(model, mesh["tp"], kind)
    else:
        parallelize_module(model, mesh["tp"], PLANS[kind])
    dp_mesh = _dp_mesh(mesh)
    units = []
    if kind == "mlp":  # a unit on a module that also carries tensor-parallel hooks
        units.append(fully_shard(model.fc1, mesh=dp_mesh))
        units.append(fully_shard(model, mesh=dp_mesh))
    else:
        units.append(fully_shard(model, mesh=dp_mesh, reshard_after_forward=1))
    return model, units


def _check_state_dicts(p, kind: str, mesh, model, ref_params: dict, path: str, x0: np.ndarray) -> None:
    """Full and sharded state dicts of the TP x fully_shard model: the full dict (on
    rank 0) is the whole trained model; loaded back (broadcast from rank 0) and through
    sharded files into fresh models, every rank's pieces are the trained ones
    exactly; the files also load into a plain single-process model."""
    full = full_state_dict(model)
    if p.rank() == 0:
        assert sorted(full) == sorted(ref_params)
        for name, value in full.items():
            np.testing.assert_allclose(value, ref_params[name], **TOL, err_msg=f"{kind}: full {name}")
    else:
        assert full == {}
    mine = {name: p.to_numpy(hp.local_tensor()) for name, hp in
            zip([n for n, _ in p.named_parameters(model)], _hsdp_params(p, model))}
    zeros = {k: np.zeros_like(v) for k, v in weights(kind).items()}
    other, _ = _tp_fully_shard(p, kind, mesh, zeros)
    load_full_state_dict(other, full if p.rank() == 0 else None)  # broadcast_from_rank0
    for (name, _), hp in zip(p.named_parameters(other), _hsdp_params(p, other)):
        np.testing.assert_array_equal(p.to_numpy(hp.local_tensor()), mine[name], err_msg=f"{kind}: full->{name}")
    save_sharded_state_dict(model, path)
    barrier()
    other, _ = _tp_fully_shard(p, kind, mesh, zeros)
    load_sharded_state_dict(other, path)
    for (name, _), hp in zip(p.named_parameters(other), _hsdp_params(p, other)):
        np.testing.assert_array_equal(p.to_numpy(hp.local_tensor()), mine[name], err_msg=f"{kind}: files->{name}")
    Trainer(p, other).backward(x0)  # the loaded model runs (its new parameters are wired)
    plain = build(p, kind, zeros)
    load_sharded_state_dict(plain, path)
    for name, param in p.named_parameters(plain):
        np.testing.assert_allclose(p.to_numpy(param), ref_params[name], **TOL, err_msg=f"{kind}: files->plain {name}")


def _hsdp_params(p, model) -> list:
    managed = {id(hp.sharded): hp for _, sub in p.named_modules(model) if "_hsdp_state" in vars(sub)
               for hp in hsdp_state(sub).params}
    return [managed[id(param)] for _, param in p.named_parameters(model)]


def check_tp_fully_shard(path: str, dtensor_forward: bool = False) -> None:
    """World 4: (dp 2, tp 2); world 8: HSDP x TP, (replicate 2, shard 2, tp 2).
    ``dtensor_forward``: the MLP only, its forward on DTensors ([Note: a tensor-parallel
    parameter in a DTensor forward] in ``hsdp_param``): fc1 must read its gathered
    weight as a DTensor on the tp mesh, ``Shard(0)``, of the full shape."""
    p = get_platform()
    if p.world_size() == 8:
        mesh = init_device_mesh(p.device_type, (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp, ndp = 2 * mesh.get_local_rank("replicate") + mesh.get_local_rank("shard"), 4
    else:
        mesh = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
        dp, ndp = mesh.get_local_rank("dp"), 2
    tp, rows = mesh.get_local_rank("tp"), 4 // ndp
    # CI budget (MindSpore pays ~35 s per kind on 8 ranks): the MLP, the simplest, on 4 only.
    kinds = ("mlp", "attention", "sp_block") if ndp == 2 else ("attention", "sp_block")
    for kind in ("mlp",) if dtensor_forward else kinds:
        sp = kind == "sp_block"
        ref_losses, ref_grads, ref_params = _reference(p, kind)
        model, units = _tp_fully_shard(p, kind, mesh, weights(kind), dtensor_forward)
        read: list = []
        if kind == "mlp":
            p.register_forward_pre_hook(model.fc1, lambda m, args: read.append(
                (type(m.weight), getattr(m.weight, "placements", None), tuple(m.weight.shape))))
        managed = {id(hp.sharded): hp for unit in units for hp in hsdp_state(unit).params}
        names = [name for name, _ in p.named_parameters(model)]
        placements = _placements(kind, names)
        trainer = Trainer(p, model)
        for step in range(STEPS):
            x = _data(step)[rows * dp:rows * dp + rows]
            if sp:  # this tp rank's half of the sequence; its loss is half of the dp batch's mean
                x = x[:, 2 * tp:2 * tp + 2]
            loss = trainer.backward(x, 0.5 if sp else 1.0)
            if step == 0 and kind == "mlp":
                # what fc1's forward reads: the gathered tp piece itself (local forward), or
                # a DTensor of the tp mesh with the tp placement and the full shape
                full = weights(kind)["fc1.weight"].shape
                if dtensor_forward:
                    assert issubclass(read[0][0], DTensor) and tuple(read[0][1]) == (Shard(0),) and read[0][2] == full, read[0]
                else:
                    assert not issubclass(read[0][0], DTensor) and read[0][2] == (chunk(full[0], 2, tp)[1], full[1]), read[0]
            if step == 0:
                for name, param, grad in zip(names, trainer.params, trainer.grad_arrays()):
                    hp = managed[id(param)]
                    expected = _tp_local(ref_grads[name], placements.get(name, Replicate()), 2, tp)
                    assert hp.shape == expected.shape, (kind, name, hp.shape, expected.shape)
                    start, length = chunk(hp.shape[0], hp.shard_size, hp.shard_rank)
                    if hp.replicated:  # [Note: no empty chunks on MindSpore]
                        start, length = 0, hp.shape[0]
                    expected = expected[start:start + length]
                    np.testing.assert_allclose(grad, expected, **TOL, err_msg=f"{kind}: gradient of {name} at step 0")
            trainer.step()
            # tp ranks of a dp group hold the same loss (sequence parallel: halves of it)
            total = float(p.to_numpy(p.all_reduce(p.from_numpy(np.array([loss], np.float32))).wait())[0])
            total /= ndp if sp else ndp * 2
            np.testing.assert_allclose(total, ref_losses[step], **TOL, err_msg=f"{kind}: loss of step {step}")
        for name, param in p.named_parameters(model):
            # one DTensor on the joint (tp, dp...) mesh, tp placement first: its full tensor is the global one
            assert param is managed[id(param)].to_dtensor() and tuple(param.shape) == ref_params[name].shape
            assert param.placements[0] == placements.get(name, Replicate()), (name, param.placements)
            full = p.to_numpy(param.full_tensor())
            np.testing.assert_allclose(full, ref_params[name], **TOL, err_msg=f"{kind}: {name} after training")
        _check_state_dicts(p, kind, mesh, model, ref_params, os.path.join(path, kind), x)


@pytest.mark.parametrize("world", [4, 8], ids=["dp2_tp2", "hsdp2x2_tp2"])
def test_tp_then_fully_shard(run_on_ranks, tmp_path, world: int) -> None:
    run_on_ranks(check_tp_fully_shard, str(tmp_path), world_size=world, timeout_s=600)


def test_dtensor_forward_then_fully_shard(run_on_ranks, tmp_path) -> None:
    run_on_ranks(check_tp_fully_shard, str(tmp_path), True, world_size=4, timeout_s=600)
