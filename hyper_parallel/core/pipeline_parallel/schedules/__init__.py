"""Pipeline schedules as data: one list of ``Action`` per rank."""

from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType, Schedule, from_csv, to_csv
from hyper_parallel.core.pipeline_parallel.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b
from hyper_parallel.core.pipeline_parallel.schedules.lowering import add_communication, forward_only, loop_placement
from hyper_parallel.core.pipeline_parallel.schedules.simulator import SimulationResult, simulate
from hyper_parallel.core.pipeline_parallel.schedules.validate import ScheduleError, validate

__all__ = ["Action", "ActionType", "Schedule", "ScheduleError", "SimulationResult", "add_communication", "forward_only",
           "from_csv", "gpipe", "interleaved_1f1b", "loop_placement", "one_f_one_b", "simulate", "to_csv", "validate"]

from hyper_parallel.core.pipeline_parallel.schedules.zero_bubble import (interleaved_zero_bubble,  # noqa: E402
                                                                         v_placement, zbv_zero_bubble)

from hyper_parallel.core.pipeline_parallel.schedules.dualpipe import dualpipe_v  # noqa: E402

__all__ += ["dualpipe_v", "interleaved_zero_bubble", "v_placement", "zbv_zero_bubble"]
