"""``hyper-parallel train --activation-checkpointing``: each decoder block recomputed in
the backward (step 3 of the layout chain, between context parallelism and fully_shard)
gives the loss curve of the single-process reference (which runs without it), on layouts
that combine it with tensor parallelism, fully_shard and context parallelism (with
pipelines: test_pipeline_activation_checkpointing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.core.activation_checkpoint import is_checkpointed
from hyper_parallel.platform import get_platform
from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.config import Layout
from hyper_parallel.train.loop import setup, train
from tests.train._ranks import losses, tiny_config


def check_checkpointed_parity(out: str, layouts: list[dict]) -> list[list[float]]:
    """For each layout, three steps of the train job with ``activation_checkpointing``
    against the single-process reference (rank 0, after every layout's collectives).

    Tolerance: as for the same layouts without checkpointing (``check_data_parallel_parity``
    and ``check_layout_parity`` in ``tests/train/_ranks.py``, 2e-5 relative over three
    steps): checkpointing changes no arithmetic (the recomputation repeats the forward's
    operations on the same values), so the difference to the reference is the layouts'
    own (partial sums and gradient averages in another order)."""
    p = get_platform()
    runs = []
    for degrees in layouts:
        layout = Layout(**degrees)
        cfg = tiny_config(f"{out}/{layout.describe()}", nproc=p.world_size(), layout=layout, steps=3, eval_every=3,
                          activation_checkpointing=True)
        run = setup(cfg)
        assert all(is_checkpointed(block) for block in run.model.layers), degrees
        runs.append((cfg, losses(train(cfg, write_outputs=False, run=run))))
    ref = losses(train(runs[0][0], reference=True, write_outputs=False)) if p.rank() == 0 else None
    for cfg, got in runs if p.rank() == 0 else []:
        assert np.all(np.isfinite(got)), got
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=0,
                                   err_msg=f"{cfg.layout.describe()} with activation checkpointing vs single process")
    return [got.tolist() for _, got in runs]


def test_checkpointed_layouts_match_single_process(run_on_ranks, tmp_path: Path) -> None:
    """tp 2 x dp-shard 2 (fully_shard over the dp submesh of the TP model, its block units
    being the checkpointed blocks) and dp-shard 2 x cp 2 (ring attention, load-balanced;
    fully_shard over the flattened (dp_shard, cp) mesh)."""
    layouts = [{"tp": 2, "dp_shard": 2}, {"dp_shard": 2, "cp": 2, "cp_mode": "ring"}]
    results = run_on_ranks(check_checkpointed_parity, str(tmp_path), layouts, world_size=4, timeout_s=600)
    for other in results[1:]:  # every rank reports the mean loss over the data-parallel ranks
        np.testing.assert_array_equal(other, results[0])


def test_flag_parses_and_is_accepted_with_pipelines() -> None:
    """The flag round-trips through the config, and ``--pp`` takes it (each stage's blocks
    are checkpointed; parity in test_pipeline_activation_checkpointing)."""
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["train", "--activation-checkpointing", "--dp-shard", "2"]))
    assert cfg.activation_checkpointing and type(cfg).from_dict(cfg.to_dict()) == cfg
    assert not config_from_args(parser.parse_args(["train"])).activation_checkpointing
    piped = config_from_args(parser.parse_args(["train", "--activation-checkpointing", "--pp", "2", "--nproc", "2"]))
    piped.refuse_unlanded()
    assert piped.activation_checkpointing and piped.layout.pp == 2
    # the other rules of --pp still hold with the flag
    with pytest.raises(ValueError, match=r"--microbatches=1 must be >= --pp=2"):
        config_from_args(parser.parse_args(["train", "--activation-checkpointing", "--pp", "2", "--nproc", "2",
                                            "--microbatches", "1"]))
