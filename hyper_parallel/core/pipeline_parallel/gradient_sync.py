"""fully_shard'ed stages under schedules that split or pair backwards: each unit's
gradient reduced once per step, after the stage's last backward work.

[Note: one reduction per step]
fully_shard reduce-scatters a unit's gradient in the backward of its gather
(``GatherParam``, ``core/fully_shard/hsdp_param``). Two kinds of schedule cannot let it:

- a split backward (zero-bubble, DualPipeV: ``I`` then ``W``): when ``I`` runs the
  gather's backward, the split linear layers have handed it no weight gradient; ``W``
  computes those later from the stored ``(x, grad_y)`` (``weight_grad``), after that
  backward ran;
- paired backwards (``OVERLAP_B_F``, ``CommComputeOverlap``): a paired forward of the
  same stage runs on the other thread while the backward runs, so a reduce-scatter
  issued inside the backward would be in flight, and ordered among the forward's
  all-gathers, differently on different ranks.

So when this rank's action list has ``W`` or ``OVERLAP_B_F`` actions, the runtime turns
gradient sync off for the step in every fully_shard unit of its stages
(``StepReduction``; a unit that already had it off, for gradient accumulation across
steps, is left as it is). Each backward then adds its full gradient to the unit
(``HSDPState.accumulate_grad``), ``W`` adds its deferred weight gradients there too, and
after the stage's last action that computes gradients (its last ``B``, ``W`` or pair
holding a backward) every unit reduces the sum once (``HSDPState.reduce_accumulated``:
one flat reduce-scatter per unit and dtype, the replicate all-reduce on HSDP); the
sharded gradients reach the parameters through ``land_gradients`` ([Note: landing
weight gradients] in ``weight_grad``) and the stage's ``param_grads()``. This is how
torch.distributed.pipelining drives FSDP2 (``set_requires_gradient_sync(False)`` during
the step; the units' ``post_backward`` in its ``REDUCE_GRAD`` action after the stage's
last ``W`` or ``B``). Every data-parallel rank of a pipeline coordinate runs the same
action list, so each unit's reduce-scatter is issued at the same point on every one of
them. The values are those of one reduce-scatter per microbatch summed afterwards, in
another float32 summation order; the cost is the full gradients held until the stage's
last backward work, as FSDP2 holds them under pipelining.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.fully_shard.hsdp_state import HSDPState, units_in
from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.weight_grad import land_gradients
from hyper_parallel.platform.base import Platform

A = ActionType


def defers_reduction(actions: Sequence[Action]) -> bool:
    """Whether a rank running ``actions`` reduces its fully_shard gradients once per step
    ([Note: one reduction per step]): it has a ``W`` or an ``OVERLAP_B_F``."""
    return any(a.type in (A.W, A.OVERLAP_B_F) for a in actions)


def last_gradient_actions(actions: Sequence[Action]) -> dict[int, list[int]]:
    """``{index in actions: [stage, ...]}``: after which action each stage has computed
    all of its step's gradients (its last ``B`` or ``W``, or the last pair holding one of
    its backwards)."""
    last: dict[int, int] = {}
    for index, action in enumerate(actions):
        if action.type in (A.B, A.W):
            last[action.stage_index] = index
        elif action.type is A.OVERLAP_B_F:
            last[action.sub_actions[0].stage_index] = index
    after: dict[int, list[int]] = {}
    for stage, index in sorted(last.items()):
        after.setdefault(index, []).append(stage)
    return after


class StepReduction:
    """One step's deferred reductions on this rank ([Note: one reduction per step]).

    Args:
        platform: the stages' platform.
        stages: this rank's stages by stage index.
        actions: this rank's action list for the step.

    Made at the start of a step: turns gradient sync off in the units that had it on.
    ``after(index)`` runs after ``actions[index]``; ``restore()`` after the step, also
    when it failed (sync back on in the units not reduced)."""

    def __init__(self, platform: Platform, stages: dict[int, PipelineStage], actions: Sequence[Action]) -> None:
        self.platform = platform
        self.stages = stages
        self._after = last_gradient_actions(actions)
        self._units: dict[int, list[HSDPState]] = {}
        for index, stage in stages.items():
            units = [unit for unit in units_in(stage.submodule) if unit.requires_gradient_sync]
            for unit in units:
                unit.set_requires_gradient_sync(False)
            self._units[index] = units

    def after(self, index: int) -> None:
        """After ``actions[index]``: reduce the units of each stage whose gradients are
        now complete. Collectives: each unit's flat **reduce-scatter** (and on HSDP an
        **all-reduce** over the replicate axis), over its data-parallel group."""
        for s in self._after.get(index, ()):
            self._reduce(s)

    def _reduce(self, s: int) -> None:
        stage = self.stages[s]
        params: list[Any] = []
        grads: list[Any] = []
        for unit in self._units.pop(s, []):
            unit.set_requires_gradient_sync(True)
            for hp, grad in unit.reduce_accumulated():
                params.append(hp.to_dtensor())
                grads.append(grad)
        if not params:
            return
        by_id = land_gradients(self.platform, params, grads)
        stage._accumulate([by_id.get(id(param)) for _, param in stage.named_params])

    def restore(self) -> None:
        """After the step: gradient sync back on in the units it turned off and did not
        reduce (a step cut short by an error), their partial sums dropped, so that the
        next step does not add them to its own."""
        for units in self._units.values():
            for unit in units:
                unit.set_requires_gradient_sync(True)
                for hp in unit.params:
                    hp.grad_accum = None
        self._units.clear()
