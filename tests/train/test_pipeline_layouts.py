"""``hyper-parallel train`` pipelines composed with the other axes: ``--pp`` with ``--tp``,
``--dp-replicate``, ``--dp-shard`` and ``--cp`` (every mode), each stage module running the
chain TP -> CP -> fully_shard on its pipeline coordinate's submeshes
(``[Note: pipeline stages and the other axes]`` in ``train/pipeline.py``), against the
single-process reference on the same seed and data; and the configuration errors of
these compositions, caught before any rank starts.

Layouts tested: on 4 ranks pp 2 x tp 2 (1F1B; interleaved 1F1B), pp 2 x dp-replicate 2
(GPipe), pp 2 x cp 2 (ring 1F1B; Ulysses GPipe; all-gather interleaved); on 8 ranks
pp 2 x tp 2 x dp-shard 2 (1F1B) and pp 2 x cp 4 hybrid (Ulysses 2 x ring 2). All through
the harness, on both backends. The launcher's own pipeline runs are in
test_train.test_command_line_run and test_checkpoint_reshard.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.train.cli import build_parser, config_from_args
from tests.train._ranks import check_pipeline_parity

#: (world size, layouts): one rank function per world size sweeps its layouts. Interleaved
#: 1F1B runs 4 stages of one block (``PIPELINE_MODEL``), the others 2 stages of ``tiny``.
LAYOUT_CASES = [
    (4, [{"pp": 2, "tp": 2, "microbatches": 2, "pp_schedule": "1f1b"},
         {"pp": 2, "tp": 2, "microbatches": 4, "pp_schedule": "interleaved-1f1b"},
         {"pp": 2, "dp_replicate": 2, "microbatches": 2, "pp_schedule": "gpipe"},
         {"pp": 2, "cp": 2, "cp_mode": "ring", "microbatches": 2, "pp_schedule": "1f1b"},
         {"pp": 2, "cp": 2, "cp_mode": "ulysses", "microbatches": 2, "pp_schedule": "gpipe"},
         {"pp": 2, "cp": 2, "cp_mode": "allgather", "microbatches": 4, "pp_schedule": "interleaved-1f1b"}]),
    (8, [{"pp": 2, "tp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "1f1b"},
         {"pp": 2, "cp": 4, "cp_mode": "hybrid", "ulysses_degree": 2, "microbatches": 2, "pp_schedule": "1f1b"}]),
]


@pytest.mark.parametrize("world_size, layouts", LAYOUT_CASES, ids=["4ranks", "8ranks"])
def test_pipeline_layouts_match_single_process(run_on_ranks, tmp_path: Path, world_size: int,
                                               layouts: list[dict]) -> None:
    """Each composition: this rank holds its stages' parameters split by TP and
    fully_shard, and the training and validation losses equal the reference's within
    2e-5 relative (see check_pipeline_parity for the tolerance). Every rank
    reports the same losses (the last stage's, averaged and handed to all ranks)."""
    results = run_on_ranks(check_pipeline_parity, str(tmp_path), layouts, world_size=world_size,
                           timeout_s=400)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


def _config(*flags: str):
    return config_from_args(build_parser().parse_args(["train", *flags]))


@pytest.mark.parametrize("flags, needles", [
    # tensor parallelism inside a pipeline: whole heads per rank, as without --pp
    (["--pp", "2", "--tp", "3", "--nproc", "6", "--microbatches", "2", "--batch-size", "6"],
     ["--tp=3", "query heads (8)", "key/value heads (4)", "divides 4"]),
    (["--pp", "2", "--tp", "4", "--model", "tiny", "--hidden-dim", "66", "--nproc", "8"],
     ["--tp=4 must divide the MLP hidden size 66"]),
    # microbatches are cut from each data-parallel rank's share of the batch
    (["--pp", "2", "--dp-replicate", "2", "--microbatches", "4", "--batch-size", "4", "--nproc", "4"],
     ["--batch-size=4", "data-parallel degree (2) x --microbatches (4) = 8"]),
    (["--pp", "2", "--dp-replicate", "2", "--dp-shard", "2", "--microbatches", "2", "--batch-size", "4",
      "--nproc", "8"], ["--batch-size=4", "data-parallel degree (4) x --microbatches (2) = 8"]),
    # context parallelism inside a pipeline: the sequence and head rules of --cp
    (["--pp", "2", "--cp", "2", "--seq-len", "30", "--nproc", "4"], ["--seq-len=30", "2 x --cp = 4"]),
    (["--pp", "2", "--cp", "8", "--cp-mode", "ulysses", "--tp", "2", "--seq-len", "64", "--nproc", "32"],
     ["--cp=8 with --cp-mode ulysses", "query heads per tensor-parallel rank (4)"]),
    (["--pp", "2", "--cp", "2", "--cp-mode", "hybrid", "--nproc", "4"],
     ["--cp=2 with --cp-mode hybrid", "no Ulysses degree"]),
    (["--pp", "2", "--tp", "2", "--nproc", "2"], ["needs 4 ranks", "--nproc=2"]),
])
def test_bad_pipeline_composition(flags: list[str], needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        _config(*flags)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("flags, degrees", [
    (["--pp", "2", "--tp", "2"], {"pp": 2, "tp": 2}),
    (["--pp", "2", "--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"],
     {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}),
    (["--pp", "2", "--cp", "4", "--cp-mode", "hybrid"], {"pp": 2, "cp": 4}),
])
def test_pipeline_compositions_are_accepted(flags: list[str], degrees: dict[str, int]) -> None:
    """The compositions that landed pass the launcher's checks (``--nproc`` defaults to the
    product of the degrees) and are no longer refused."""
    cfg = _config(*flags)
    cfg.refuse_unlanded()
    assert {axis: d for axis, d in cfg.layout.degrees().items() if d > 1} == degrees
    assert cfg.nproc == int(np.prod(list(degrees.values())))
