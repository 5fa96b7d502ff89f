"""``hyper-parallel train --pp-schedule`` takes its names from the core's schedule table
(``core/pipeline_parallel/schedule_table.py``): every name is accepted, gives the table's
number of stages, appears in ``--help``, and a microbatch count its schedule does not run
is refused with the schedule's rule before any rank starts. The two schedules the table
added to the job (ZB-H1 on two interleaved stages per rank, DualPipeV) train like the
single-process reference (training and validation losses within 2e-5, each rank's
parameter shapes; ``check_pipeline_parity``), on 2 ranks, both backends. The validation
loss of every pipelined run is the schedule's forward-only step (``PipelineSchedule.eval``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyper_parallel.core.pipeline_parallel import SCHEDULES
from hyper_parallel.train.cli import build_parser, config_from_args
from hyper_parallel.train.config import PP_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from tests.train._ranks import check_pipeline_parity


def _config(*flags: str):
    return config_from_args(build_parser().parse_args(["train", "--pp", "2", *flags]))


def test_pp_schedule_names_come_from_the_table(capsys) -> None:
    assert PP_SCHEDULES == tuple(SCHEDULES)
    assert ZERO_BUBBLE_SCHEDULES == ("zbh1", "interleaved-zero-bubble", "zbv", "dualpipev")
    for name, entry in SCHEDULES.items():
        cfg = _config("--pp-schedule", name, "--microbatches", "4", "--n-layers", "4")
        assert cfg.layout.num_stages == entry.num_stages(2) == 2 * entry.stages_per_rank, name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at hyphens
    assert all(f"{name}:" in help_text for name in SCHEDULES), help_text


@pytest.mark.parametrize("schedule, microbatches, needle", [
    ("interleaved-1f1b", 3, "n_microbatches=3 must be a multiple of num_ranks=2"),
    ("interleaved-zero-bubble", 3, "n_microbatches=3 must be a multiple of num_ranks=2"),
    ("dualpipev", 2, "n_microbatches=2 must be >= 2 * num_ranks = 4"),
])
def test_microbatches_a_schedule_does_not_run_are_refused(schedule: str, microbatches: int, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        _config("--pp-schedule", schedule, "--microbatches", str(microbatches), "--n-layers", "4")
    assert f"--microbatches={microbatches} does not fit --pp-schedule {schedule} with --pp=2" in str(err.value)
    assert needle in str(err.value), str(err.value)


def test_new_schedules_match_single_process(run_on_ranks, tmp_path: Path) -> None:
    layouts = [{"pp": 2, "microbatches": 4, "pp_schedule": "interleaved-zero-bubble"},
               {"pp": 2, "microbatches": 4, "pp_schedule": "dualpipev"}]
    run_on_ranks(check_pipeline_parity, str(tmp_path), layouts, world_size=2, timeout_s=300)
