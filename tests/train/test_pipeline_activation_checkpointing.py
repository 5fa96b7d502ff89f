"""``hyper-parallel train --pp 2 --activation-checkpointing``: every stage module runs the
chain TP -> CP -> activation checkpointing -> fully_shard, and each microbatch's backward
recomputes the stage's blocks ([Note: activation checkpointing in pipeline stages] in
``core/activation_checkpoint/checkpoint.py``). On 4 ranks through the harness, against
the same layout without checkpointing and the single-process reference: pp 2 x
dp-shard 2 (interleaved 1F1B: two stages per rank, out-of-order backwards, fully_shard's
block units being the checkpointed blocks), pp 2 x tp 2 (1F1B) and pp 2 x cp 2 ring
(GPipe), on both backends (the core test covers every schedule)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hyper_parallel.core.activation_checkpoint import is_checkpointed
from hyper_parallel.platform import get_platform
from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.config import Layout
from hyper_parallel.train.loop import setup, train
from tests.train._ranks import PIPELINE_MODEL, losses, tiny_config

#: one rank function sweeps them (MindSpore pays seconds per multi-rank call)
LAYOUTS = [{"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "interleaved-1f1b"},
           {"pp": 2, "tp": 2, "microbatches": 2, "pp_schedule": "1f1b"},
           {"pp": 2, "cp": 2, "cp_mode": "ring", "microbatches": 2, "pp_schedule": "gpipe"}]
STEPS = 2


def check_checkpointed_pipelines(out: str, layouts: list[dict]) -> list[list[float]]:
    """Each layout, ``STEPS`` steps of ``PIPELINE_MODEL`` (4 blocks: one per stage under
    interleaved 1F1B) with ``activation_checkpointing``: every block of this rank's stages
    is checkpointed; the losses and the last step's gradients (each reduced over the
    data-parallel ranks) equal the same layout's without it bit for bit: the
    recomputation repeats the forward's operations on the same values, and a gradient
    reduce-scattered twice, or a recomputation reading other parameters, would not be
    equal. And the losses match the single-process reference (rank 0, after every
    layout's collectives) within 2e-5 relative, the layouts' own tolerance without
    checkpointing (check_pipeline_parity in ``tests/train/_ranks.py``: sums in
    another order, a few ulps per step)."""
    p = get_platform()
    n = p.world_size()
    runs = []
    for degrees in layouts:
        layout = Layout(**degrees)
        assert layout.world_size == n, (degrees, n)
        name = f"{layout.describe()}-{layout.pp_schedule}"
        cfg = tiny_config(f"{out}/{name}", nproc=n, layout=layout, steps=STEPS, eval_every=STEPS,
                          model=PIPELINE_MODEL, model_name="tiny-4-layers")
        plain_run = setup(cfg)
        plain = losses(train(cfg, write_outputs=False, run=plain_run))
        checkpointed = cfg.replace(out=f"{out}/{name}-ac", activation_checkpointing=True)
        run = setup(checkpointed)
        assert run.pipe is not None and plain_run.pipe is not None
        blocks = [block for module in run.pipe.modules for block in module.layers.values()]
        assert blocks and all(is_checkpointed(block) for block in blocks), name
        got = losses(train(checkpointed, write_outputs=False, run=run))
        np.testing.assert_array_equal(got, plain, err_msg=f"{name}: losses, checkpointed vs not")
        for index, (grad, want) in enumerate(zip(run.pipe.gradients(), plain_run.pipe.gradients(), strict=True)):
            np.testing.assert_array_equal(p.to_numpy(grad), p.to_numpy(want),
                                          err_msg=f"{name}: gradient of {run.names[index]}, checkpointed vs not")
        runs.append((cfg, got))
    if p.rank() == 0:
        ref = losses(train(runs[0][0], reference=True, write_outputs=False))  # the reference ignores the layout
        for cfg, got in runs:
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=0, err_msg=f"{cfg.layout.describe()} "
                                       f"{cfg.layout.pp_schedule} checkpointed vs single process")
    return [got.tolist() for _, got in runs]


def test_checkpointed_pipelines_match_single_process(run_on_ranks, tmp_path: Path) -> None:
    results = run_on_ranks(check_checkpointed_pipelines, str(tmp_path), LAYOUTS, world_size=4, timeout_s=600)
    for other in results[1:]:  # every rank reports the last stage's losses
        np.testing.assert_array_equal(other, results[0])


def test_flag_is_accepted_with_every_pipeline_schedule() -> None:
    parser = build_parser()
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        cfg = config_from_args(parser.parse_args(["train", "--activation-checkpointing", "--pp", "2", "--dp-shard",
                                                  "2", "--pp-schedule", schedule, "--microbatches", "2"]))
        cfg.refuse_unlanded()
        assert cfg.activation_checkpointing and cfg.layout.pp == 2 and cfg.nproc == 4
        assert type(cfg).from_dict(cfg.to_dict()) == cfg
