"""Rank functions of ``tests/train/test_compile.py``: the job's step with ``--compile``
beside the same step eager, on each rank of one layout."""

from __future__ import annotations

import dataclasses

import numpy as np

from hyper_parallel.platform import get_platform
from hyper_parallel.train.compile import compiled_parts
from hyper_parallel.train.config import PRESETS, Layout
from hyper_parallel.train.loop import _train_step, setup
from hyper_parallel.train.optim import local_tensor
from tests.train._ranks import tiny_config


def _run(out: str, degrees: dict, compile_: bool, steps: int, qk_norm: bool) -> dict:
    """``steps`` training steps of the tiny preset on ``degrees``: each step's loss and
    global gradient norm (before clipping), this rank's pieces of the weights after the
    last step (float32 by name), how many of ``compiled_parts`` run a replaced forward (the
    instance attribute ``compile_module`` sets: torch's ``forward``, MindSpore's
    ``construct``), and how many blocks do (torch: the compiled block itself; MindSpore:
    the forward routed through the compiled parts). ``qk_norm``: the tiny preset with
    per-head query/key norms."""
    p = get_platform()
    layout = Layout(**degrees)
    model = dataclasses.replace(PRESETS["tiny"], qk_norm=qk_norm)
    cfg = tiny_config(out, nproc=layout.world_size, layout=layout, steps=steps, compile=compile_, model=model)
    run = setup(cfg)
    rows = [_train_step(run, step) for step in range(steps)]
    weights = {name: p.to_numpy(local_tensor(param)).astype(np.float32)
               for name, param in zip(run.names, run.params)}
    parts = compiled_parts(p, run.model)
    replaced = sum(1 for part in parts if {"forward", "construct"} & set(vars(part)))
    blocks = sum(1 for block in run.model.layers if {"forward", "construct"} & set(vars(block)))
    return {"losses": [loss for loss, _ in rows], "norms": [norm for _, norm in rows], "weights": weights,
            "parts": len(parts), "replaced": replaced, "blocks": blocks, "n_blocks": len(run.model.layers)}


def compiled_and_eager(out: str, degrees: dict, steps: int, qk_norm: bool = False) -> dict:
    """The eager run and the compiled run of one layout on this rank."""
    return {"eager": _run(out + "/eager", degrees, False, steps, qk_norm),
            "compiled": _run(out + "/compiled", degrees, True, steps, qk_norm)}
