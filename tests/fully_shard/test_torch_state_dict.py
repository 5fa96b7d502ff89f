"""``torch.distributed.checkpoint.state_dict``'s functions on models whose parameters are
this project's DTensors (fully_shard over 4 ranks with uneven and empty chunks, tensor
parallel over 4, tp 2 x fully_shard 2), and ``hyper_parallel.platform.torch.state_dict``'s
functions of the same names:

- default options (torch's and ours): DTensors with the parameters' specs, moments too;
  ``dcp.save`` of them on one layout, ``dcp.load`` + ``set_*`` on another: exact;
- ``full_state_dict=True, cpu_offload=True``: ours give plain full tensors on rank 0 and
  ``{}`` elsewhere, exact; torch's give our DTensors back ungathered, whose plain reads
  raise naming the supported path; loading full dicts (each rank's, or rank 0's
  broadcast) through ours, and the model's through torch's own function, is exact, and the
  next AdamW step matches the original model's exactly; torch's own full optimizer load
  leaves plain moments and the next step raises naming ours;
- a DCP checkpoint saved on 4 ranks loads into a plain model and optimizer in this
  process, with no process group.
torch only.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.platform import get_platform
from tests.fully_shard.test_dcp import _model, _moments, _step
from tests.tensor_parallel._models import build, weights

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="torch.distributed.checkpoint is torch's")


def _values(model) -> dict[str, np.ndarray]:
    p = get_platform()
    return {name: p.to_numpy(param.full_tensor() if isinstance(param, DTensor) else param)
            for name, param in p.named_parameters(model)}


def _next_step(model, opt) -> dict[str, np.ndarray]:
    """One more AdamW step on another fixed batch; the parameters after it."""
    p = get_platform()
    x = np.random.default_rng(8).standard_normal((4, 3, 6)).astype(np.float32)
    (model(p.from_numpy(x)) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    return _values(model)


def save_sharded(path: str, layout: str) -> dict[str, np.ndarray]:
    """torch's get_* (default options) on ``layout``: the parameters and moments
    themselves; dcp.save of them. Returns the full values saved."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, \
        get_optimizer_state_dict

    model = _model(layout, weights("mlp"))
    opt = _step(model)
    params = dict(model.named_parameters())
    for options in (StateDictOptions(), StateDictOptions(cpu_offload=True)):
        msd = get_model_state_dict(model, options=options)
        osd = get_optimizer_state_dict(model, opt, options=options)
        for name, value in msd.items():
            assert isinstance(value, DTensor) and value.placements == params[name].placements, (name, value)
            assert torch.equal(value._local, params[name]._local), name
        for name, state in osd["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                moment = state[key]
                assert isinstance(moment, DTensor) and moment._spec == params[name]._spec, (name, key)
                assert torch.equal(moment._local, opt.state[params[name]][key]._local), (name, key)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    return {**_values(model), **_moments(model, opt)}


def load_sharded(path: str, layout: str, saved: dict[str, np.ndarray]) -> None:
    """A model of ``layout`` with other values and moments: torch's get_* for the
    structure, dcp.load into it, torch's set_*: every value exact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, \
        set_model_state_dict, set_optimizer_state_dict

    model = _model(layout, {name: np.zeros_like(v) for name, v in weights("mlp").items()})
    opt = _step(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    got = {**_values(model), **_moments(model, opt)}
    for key, value in saved.items():
        np.testing.assert_array_equal(got[key], value, err_msg=f"{layout}: {key}")


@pytest.mark.parametrize("saved,loaded", [("fsdp", "tp_fsdp"), ("tp", "fsdp"), ("tp_fsdp", "tp")])
def test_torch_functions_sharded_through_dcp(run_on_ranks, tmp_path, saved: str, loaded: str) -> None:
    path = str(tmp_path / "ckpt")
    values = run_on_ranks(save_sharded, path, saved, world_size=4)[0]
    run_on_ranks(load_sharded, path, loaded, values, world_size=4)


def full_round_trip(layout: str) -> None:
    """Full state dicts on ``layout`` (see the module docstring)."""
    import torch
    import torch.distributed.checkpoint.state_dict as dsd
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from hyper_parallel.platform.torch import state_dict as hp_sd

    p = get_platform()
    rank = p.rank()
    model = _model(layout, weights("mlp"))
    opt = _step(model)
    values, moments = _values(model), _moments(model, opt)
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)

    # torch's own: our DTensors come back ungathered; reading them as plain values refuses
    theirs = dsd.get_model_state_dict(model, options=offload)
    if rank == 0:
        assert theirs and all(isinstance(v, DTensor) for v in theirs.values()), theirs
        for read in (lambda t: t.numpy(), lambda t: t.tolist(), lambda t: torch.zeros(t.shape).copy_(t)):
            with pytest.raises(RuntimeError, match="hyper_parallel.platform.torch.state_dict"):
                read(theirs["fc1.weight"])
    else:
        assert theirs == {}, theirs

    # ours: plain full tensors on rank 0 (host), nothing elsewhere; every rank: without offload
    msd = hp_sd.get_model_state_dict(model, options=offload)
    osd = hp_sd.get_optimizer_state_dict(model, opt, options=offload)
    everywhere = hp_sd.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    everywhere_osd = hp_sd.get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    for name, value in everywhere.items():
        assert type(value) is torch.Tensor, (name, type(value))
        np.testing.assert_array_equal(value.numpy(), values[name], err_msg=name)
    if rank == 0:
        assert set(msd) == set(values), msd.keys()
        for name, value in msd.items():
            assert type(value) is torch.Tensor and value.device.type == "cpu", (name, type(value))
            np.testing.assert_array_equal(value.numpy(), values[name], err_msg=name)
        for name, state in osd["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert type(state[key]) is torch.Tensor, (name, key, type(state[key]))
                np.testing.assert_array_equal(state[key].numpy(), moments[f"{key}/{name}"], err_msg=f"{key}/{name}")
    else:
        assert msd == {} and osd == {}, (msd, osd)
    # the original, one step further, on a twin: the state dicts hold references to the
    # optimizer's live step counters (as torch's do), so the original must not step
    twin = _model(layout, weights("mlp"))
    expected = _next_step(twin, _step(twin))

    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for how in ("broadcast", "every_rank", "torch_model_fn"):
        fresh = _model(layout, {name: np.zeros_like(v) for name, v in weights("mlp").items()})
        fresh_opt = _step(fresh)  # other moments, the same step count
        if how == "broadcast":  # rank 0's dicts only
            hp_sd.set_model_state_dict(fresh, msd, options=broadcast)
            hp_sd.set_optimizer_state_dict(fresh, fresh_opt, osd, options=broadcast)
        elif how == "every_rank":
            every = StateDictOptions(full_state_dict=True)
            hp_sd.set_model_state_dict(fresh, everywhere, options=every)
            hp_sd.set_optimizer_state_dict(fresh, fresh_opt, everywhere_osd, options=every)
        else:  # torch's own model function loads plain full tensors correctly (copy_ of the piece)
            dsd.set_model_state_dict(fresh, msd, options=broadcast)
            hp_sd.set_optimizer_state_dict(fresh, fresh_opt, osd, options=broadcast)
        for name, value in _values(fresh).items():
            np.testing.assert_array_equal(value, values[name], err_msg=f"{how}: {name}")
        for key, value in _moments(fresh, fresh_opt).items():
            np.testing.assert_array_equal(value, moments[key], err_msg=f"{how}: {key}")
        for name, param in fresh.named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                assert fresh_opt.state[param][key]._spec == param._spec, (how, name, key)
        for name, value in _next_step(fresh, fresh_opt).items():
            np.testing.assert_array_equal(value, expected[name], err_msg=f"{how}, next step: {name}")

    # torch's own optimizer function: plain full moments in the optimizer; the step refuses
    fresh = _model(layout, weights("mlp"))
    fresh_opt = _step(fresh)
    dsd.set_optimizer_state_dict(fresh, fresh_opt, everywhere_osd, options=StateDictOptions(full_state_dict=True))
    with pytest.raises(RuntimeError, match="hyper_parallel.platform.torch.state_dict.set_optimizer_state_dict"):
        _next_step(fresh, fresh_opt)

    # bad input: a moment of another shape; every rank raises before any tensor is sent
    fresh = _model(layout, weights("mlp"))
    fresh_opt = _step(fresh)
    bad = {"state": dict(osd["state"]), "param_groups": osd["param_groups"]} if rank == 0 else {}
    if rank == 0:
        bad["state"]["fc1.weight"] = {**bad["state"]["fc1.weight"], "exp_avg": torch.zeros(3)}
    with pytest.raises(ValueError, match="rank 0's optim_state_dict lacks 1 moments"):
        hp_sd.set_optimizer_state_dict(fresh, fresh_opt, bad, options=broadcast)
    with torch.no_grad(), pytest.raises(RuntimeError, match="must have the global shape"):
        fresh.fc1.weight.copy_(torch.zeros(3, 6))


@pytest.mark.parametrize("layout", ["fsdp", "tp", "tp_fsdp"])
def test_full_state_dicts(run_on_ranks, layout: str) -> None:
    run_on_ranks(full_round_trip, layout, world_size=4)


def save_fqn_keyed(path: str) -> dict[str, np.ndarray]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _model("tp_fsdp", weights("mlp"))
    opt = _step(model)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    return {**_values(model), **_moments(model, opt)}


# DCP's notice that it loads without a process group: what this test asks of it
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_checkpoint_loads_in_one_process(run_on_ranks, tmp_path) -> None:
    """Saved by tp 2 x fully_shard 2; loaded here, a plain model and AdamW, no process group."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, \
        set_model_state_dict, set_optimizer_state_dict

    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(save_fqn_keyed, path, world_size=4)[0]
    assert not dist.is_initialized()
    p = get_platform()
    model = build(p, "mlp", {name: np.zeros_like(v) for name, v in weights("mlp").items()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    for name, param in model.named_parameters():
        np.testing.assert_array_equal(param.detach().numpy(), saved[name], err_msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(opt.state[param][key].numpy(), saved[f"{key}/{name}"], err_msg=name)
