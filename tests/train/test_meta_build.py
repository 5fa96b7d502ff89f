"""The job's decoder built on the meta device, parallelized there on the job's layouts
(dp-shard 4, tp 2 x dp-shard 2, HSDP 2 x 2), then given each rank's pieces by
``fully_shard.materialize`` from ``model.initial_piece``: every piece equals its box of the
one-process weights bit for bit, and the loss equals the one-process model's.

The framework's meta scope is the platform's (``module_types().meta_device``: torch
``torch.device("meta")``, MindSpore ``mindspore.DeviceCtx("meta")``); the job itself still
builds whole (issue 39: ``--init-device meta`` is not wired yet).
The torch backend's ``zeros`` / ``full`` name their device, so the norms and the embedding
are made whole here anyway (small; materialize replaces them); the linear layers are meta.
MindSpore's factories follow ``DeviceCtx``, so there the rotary tables (constants, not
parameters) are meta too and are set again after."""

from __future__ import annotations

import numpy as np

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
