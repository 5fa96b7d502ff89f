"""Checkpoints of ``hyper-parallel train`` resumed in another layout (resharded on load):
exact state after the reshard, loss curves matching the uninterrupted run and the
single-process reference; and the MindSpore pipeline's resume through the launcher."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.testing.rendezvous import framework_of, selected_platform
from tests.train._reshard_ranks import check_reshard_chains

#: (model, layouts): each layout resumes the previous one's checkpoint. tp 2 x dp-shard 2
#: -> dp-shard 4 (tensor-parallel boxes into fully_shard rows) -> dp-replicate 2 x cp 2
#: (replicas: each box written once; fully_shard over cp).
CHAINS = [("tiny", [{"tp": 2, "dp_shard": 2}, {"dp_shard": 4}, {"dp_replicate": 2, "cp": 2, "cp_mode": "ring"}])]

#: torch only (MindSpore's pipelines run through the launcher, see test_train.py): a
#: 2-stage pipeline x dp-shard 2 -> one stage over dp-shard 4 -> 4 stages (interleaved).
PIPELINE_CHAINS = [("tiny-4-layers", [{"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "1f1b"},
                                      {"dp_shard": 4},
                                      {"pp": 2, "dp_shard": 2, "microbatches": 2, "pp_schedule": "interleaved-1f1b"}])]


def test_resume_in_another_layout(run_on_ranks, tmp_path: Path) -> None:
    chains = CHAINS + (PIPELINE_CHAINS if framework_of(selected_platform()) == "torch" else [])
    results = run_on_ranks(check_reshard_chains, str(tmp_path), chains, world_size=4, timeout_s=600)
    for other in results[1:]:  # every rank reports the loss of the whole batch
        for mine, theirs in zip(other, results[0]):
            np.testing.assert_array_equal(mine, theirs)
