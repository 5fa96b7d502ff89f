"""The job's decoder built on the meta device, parallelized there on the job's layouts
(dp-shard 4, tp 2 x dp-shard 2, HSDP 2 x 2), then given each rank's pieces by
``fully_shard.materialize`` from ``model.initial_piece``: every piece equals its box of the
one-process weights bit for bit, and the loss equals the one-process model's.

The framework's meta scope is the platform's (``module_types().meta_device``: torch
``torch.device("meta")``, MindSpore ``mindspore.DeviceCtx("meta")``); the backends'
factories follow it, so every parameter is meta until materialized. MindSpore's
``from_numpy`` follows ``DeviceCtx`` too, so there the rotary tables (constants, not
parameters) are meta and are set again after (the job: ``model.materialize_model``).

The job itself (``--init-device meta``, its default): under dp-shard 4 no rank allocates
a tensor larger than its share of the largest parameter (torch, counted by a dispatch
mode)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.fully_shard import local_boxes, materialize
from hyper_parallel.platform import get_platform
from hyper_parallel.train.config import Layout
from hyper_parallel.train.model import build_model, initial_piece, initial_weights
from hyper_parallel.train.parallelize import build_mesh, context_parallel_mesh, parallelize
from hyper_parallel.train.model_config import PRESETS
from hyper_parallel.train.optim import local_tensor


def check_meta_build(layouts: list[dict]) -> list[float]:
    p = get_platform()
    cfg, seed = PRESETS["tiny"], 5
    whole = initial_weights(cfg, seed)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, 16)).astype(np.int64)
    positions = np.tile(np.arange(16, dtype=np.int64), (2, 1))
    reference = build_model(p, cfg, seed)
    args = [p.from_numpy(a) for a in (tokens, positions, np.roll(tokens, -1, axis=1))]
    ref_loss = float(p.to_numpy(reference(*args)))
    losses = []
    for degrees in layouts:
        layout = Layout(**degrees)
        mesh = build_mesh(p, layout)
        with p.module_types().meta_device():
            model = build_model(p, cfg, seed, values=False)
            model = parallelize(model, mesh, layout, context_parallel_mesh(mesh, layout))
        materialize(model, lambda fqn, box: initial_piece(cfg, seed, fqn, box.starts, box.lengths))
        # constants made under the scope are meta on MindSpore (its factories follow
        # DeviceCtx): the rotary tables again, outside it
        model.rope_cos, model.rope_sin = reference.rope_cos, reference.rope_sin
        boxes = local_boxes(model)
        for name, param in p.named_parameters(model):
            box = boxes[name]
            want = whole[name][tuple(slice(s, s + n) for s, n in zip(box.starts, box.lengths))]
            np.testing.assert_array_equal(p.to_numpy(local_tensor(param)), want, err_msg=f"{degrees}: {name}")
        loss = model(*args)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        got = float(p.to_numpy(loss))
        # Tolerance: float32, the layouts' partial sums in other orders (a few ulps)
        np.testing.assert_allclose(got, ref_loss, rtol=1e-5, err_msg=f"{degrees}: loss vs one process")
        losses.append(got)
    return losses


def test_meta_build_equals_one_process(run_on_ranks) -> None:
    layouts = [{"dp_shard": 4}, {"tp": 2, "dp_shard": 2}, {"dp_replicate": 2, "dp_shard": 2}]
    results = run_on_ranks(check_meta_build, layouts, world_size=4, timeout_s=300)
    assert all(len(r) == len(layouts) for r in results)


def largest_allocation_in_setup(out: str, init_device: str) -> dict:
    """The largest storage (bytes) a tensor that ``setup`` made on this rank had, the op
    that made it, and the bytes of the largest whole parameter: under dp-shard 4 the job
    must never hold a whole parameter with ``--init-device meta``, and does with ``host``
    (which shows the count sees the whole build)."""
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    from hyper_parallel.train.loop import setup
    from hyper_parallel.train.model import parameter_shapes
    from tests.train._ranks import tiny_config

    class LargestStorage(TorchDispatchMode):
        """Every op's outputs, meta tensors and DTensors excepted (a DTensor is a wrapper
        whose storage reports its global size; its local tensor is made by ops seen
        here): the largest storage and its op."""

        def __init__(self) -> None:
            super().__init__()
            self.nbytes, self.op = 0, ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type != "meta":
                    nbytes = t.untyped_storage().nbytes()
                    if nbytes > self.nbytes:
                        self.nbytes, self.op = nbytes, str(func)
            return out

    cfg = tiny_config(out, nproc=4, layout=Layout(dp_shard=4), init_device=init_device)
    recorder = LargestStorage()
    with recorder:
        setup(cfg)
    whole = max(int(np.prod(shape)) * 4 for shape in parameter_shapes(cfg.model).values())
    return {"largest": recorder.nbytes, "op": recorder.op, "whole": whole}


@pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                    reason="counts allocations with torch's dispatch mode; MindSpore 2.10 has no hook that sees "
                           "every tensor a build allocates")
def test_job_never_holds_a_whole_parameter(run_on_ranks, tmp_path: Path) -> None:
    """The job's setup under dp-shard 4 (every parameter sharded in 4): with ``--init-device
    meta`` no tensor larger than a rank's share of the largest parameter is ever allocated
    (the tiny decoder's embedding and head are [256, 32]: 32 KiB whole, 8 KiB a share); with
    ``host`` the whole one is (the count sees the build)."""
    meta = run_on_ranks(largest_allocation_in_setup, str(tmp_path / "meta"), "meta", world_size=4, timeout_s=300)
    host = run_on_ranks(largest_allocation_in_setup, str(tmp_path / "host"), "host", world_size=4, timeout_s=300)
    for rank, (m, h) in enumerate(zip(meta, host)):
        share = m["whole"] // 4  # 256 rows split evenly: no padding
        assert m["largest"] <= share, f"rank {rank}: --init-device meta allocated {m['largest']} bytes in {m['op']}"
        assert h["largest"] >= h["whole"], f"rank {rank}: the host build's whole parameter was not seen: {h}"


def test_init_device_flag_and_refusals(tmp_path: Path) -> None:
    from hyper_parallel.train.cli import build_parser, config_from_args
    from hyper_parallel.train.config import TrainConfig

    parser = build_parser()
    base = ["train", "--out", str(tmp_path / "run")]
    cfg = config_from_args(parser.parse_args(base))
    assert cfg.init_device is None and cfg.build_on_meta  # the decoder's default
    cfg = config_from_args(parser.parse_args([*base, "--init-device", "host"]))
    assert not cfg.build_on_meta and TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parser.parse_args([*base, "--init-device", "cuda"])
    with pytest.raises(ValueError, match=r"--init-device='cuda' is not a build device; use one of meta, host"):
        TrainConfig(platform="torch", init_device="cuda")
    hf = tmp_path / "config.json"
    hf.write_text('{"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, '
                  '"intermediate_size": 64, "vocab_size": 256}')
    with pytest.raises(ValueError, match=r"--init-device meta builds the job's decoder; a --hf-config model"):
        TrainConfig(platform="torch", hf_config=str(hf), init_device="meta")
