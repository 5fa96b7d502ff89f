"""Custom step functions: what ``PipelineSchedule.register_custom_function`` hands a
function run in place of one kind of action, under upstream hyper-parallel's names
(MindFormers imports ``MetaStepType`` from here to register its pipeline x
expert-parallel overlap for ``MetaStepType.OVERLAP_B_F``).

The protocol is torch.distributed.pipelining's ``_PipelineScheduleRuntime``:
``fn(action, ctx)``, where ``action`` is the ``Action`` being run (an ``OVERLAP_B_F``
carries its ``B`` and ``F`` in ``sub_actions``, also readable as upstream's
``sub_steps``) and ``ctx`` a ``PipelineContext``; the function runs the action through
``ctx.schedule`` and its stages (``forward_one_chunk``, ``backward_one_chunk``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType

#: upstream hyper-parallel's name for the action types (``MetaStepType.OVERLAP_B_F`` is
#: ``ActionType.OVERLAP_B_F``; the other members are this project's ``F``, ``B``, ``I``,
#: ``W``, ``SEND_F``, ... rather than upstream's ``FWD``, ``BWD``, ``FWD_SEND``, ...)
MetaStepType = ActionType

#: the action types a custom function may take over (the compute ones)
CUSTOM_TYPES = frozenset(t for t in ActionType if t.is_compute)


@dataclass
class PipelineContext:
    """What a custom step function gets besides its action, for the step being run
    (torch's ``_PipelineContext``; MindFormers reads ``ctx.schedule``).

    Attributes:
        schedule: the running ``PipelineSchedule`` (its stages by index in
            ``schedule._stage_dict``).
        arg_mbs: per microbatch, stage 0's positional inputs (``()`` on a rank without
            stage 0).
        kwarg_mbs: per microbatch, the keyword inputs every stage gets (``{}`` when none).
        target_mbs: per microbatch, the target of ``loss_fn`` (``step``); empty otherwise.
        losses: the last stage's outputs in the order its forwards ran, appended by
            ``schedule.update_losses`` (every forward of the step, custom or not).
    """

    schedule: Any  # the runtime's PipelineSchedule (runtime imports this module)
    arg_mbs: list[tuple[Any, ...]]
    kwarg_mbs: list[dict[str, Any]]
    target_mbs: list[Any] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)

    @property
    def schedule_ref(self) -> Any:
        """torch's name for ``schedule``."""
        return self.schedule


#: ``fn(action, ctx) -> None``
CustomStepFn = Callable[[Action, PipelineContext], None]

__all__ = ["CUSTOM_TYPES", "CustomStepFn", "MetaStepType", "PipelineContext"]
