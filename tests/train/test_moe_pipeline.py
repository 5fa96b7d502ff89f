"""Mixture-of-experts decoders in pipeline stages (``--pp`` with ``--moe-experts``, with and
without ``--ep``; issue 36 items 2-3): parity with one process on the session's backend,
and the refusals of what does not compose."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyper_parallel.train.cli import build_parser, config_from_args
from tests.train._moe_pipeline_ranks import check_moe_pipeline_parity


def test_two_stage_pipelines_match_single_process(run_on_ranks, tmp_path: Path) -> None:
    """pp 2 on 2 ranks: 1F1B with an MoE block on each stage, and 1F1B with block 0 dense (the
    first stage holds no MoE layer, yet joins the step's routing all-reduce and reports the
    other stage's layer): gradients, losses, gradient norms, routing counts and aux-free
    biases against the single process (``check_moe_pipeline_parity``)."""
    cases = [({"pp": 2, "microbatches": 2}, 1, 2), ({"pp": 2, "microbatches": 2}, 2, 2)]
    results = run_on_ranks(check_moe_pipeline_parity, str(tmp_path), cases, world_size=2, timeout_s=600)
    assert results[0] == results[1]  # every rank reports the whole batch's losses and every layer's stats


def test_expert_parallel_pipeline_matches_single_process(run_on_ranks, tmp_path: Path) -> None:
    """pp 2 x dp-shard 2 x ep 2 on 4 ranks (1F1B): each stage's two routed experts per rank,
    tokens sent by all-to-all among the two ranks of its pipeline coordinate, the rest
    fully_shard'ed over them, against the single process as above."""
    cases = [({"pp": 2, "dp_shard": 2, "ep": 2, "microbatches": 2}, 1, 2)]
    results = run_on_ranks(check_moe_pipeline_parity, str(tmp_path), cases, world_size=4, timeout_s=900)
    for other in results[1:]:
        assert other == results[0]


def _args(*flags: str):
    return config_from_args(build_parser().parse_args(["train", "--out", "/tmp/unused-moe-pp-run", *flags]))


@pytest.mark.parametrize("flags, message", [
    (["--model", "moe-tiny", "--pp", "2", "--nproc", "2", "--microbatches", "2", "--moe-balance", "aux-loss"],
     "--moe-balance aux-loss cannot be combined with --pp=2 yet"),
    (["--model", "moe-tiny", "--pp", "2", "--dp-shard", "2", "--ep", "2", "--nproc", "4", "--microbatches", "2",
      "--pp-schedule", "zbh1"], "--pp-schedule zbh1 cannot be combined with fully_shard"),
])
def test_refusals(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        _args(*flags)
    assert message in str(err.value)


def test_moe_pipeline_flags_are_accepted() -> None:
    cfg = _args("--model", "moe-tiny", "--pp", "2", "--dp-shard", "2", "--ep", "2", "--nproc", "4",
                "--microbatches", "2")
    assert (cfg.layout.pp, cfg.layout.ep, cfg.layout.dp_shard) == (2, 2, 2)
