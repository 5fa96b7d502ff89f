"""Executing a schedule: each rank runs its own action list over the stages it holds.

The schedule classes (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ...;
``named_schedules``) produce the compute actions of every rank (``schedules.generators``), lower them to
point-to-point actions (``schedules.lowering``), validate the result
(``schedules.validate``) and hand this rank's list to ``PipelineSchedule.step``.

A forward ``F`` runs the stage under ``platform.vjp``, which keeps what its backward
needs; ``B`` runs that backward with the output gradient received from the next stage
(the last stage starts from its loss). Zero-bubble schedules split ``B`` into ``I`` (the
input gradient, sent on at once) and a later ``W`` (the parameter gradients): their stages'
linear layers go through ``weight_grad.LinearWeightSplit``, whose ``I`` computes only
the input-gradient matmuls and stores the weight gradients' operands for ``W``; other
parameters use ``vjp``'s ``part="input"``/``part="weight"``. Gradients of a step are summed over
microbatches, scaled by ``1 / n_microbatches`` by default (a mean loss over the batch
then gives the unpipelined model's gradients).

[Note: the loss inside the last stage] A schedule built without ``loss_fn`` follows
upstream hyper-parallel's and MindFormers' convention instead of torch.distributed.pipelining's:
``run(*args, **kwargs)`` hands every stage the microbatch's keyword arguments (a causal
LM's last stage reads its labels there and returns its loss), stage 0 also the
positional ones; the last stage's outputs are seeded by its ``get_last_stage_sens``
(which carries any loss scale: MindFormers' ``ScaledLossPipelineStage`` multiplies in
``1 / (data-parallel size x microbatches)``), and gradients are summed over microbatches
unless ``scale_grads=True``.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

from hyper_parallel.core.pipeline_parallel.boundary import Rebuild, rebuilds_of, resolve, unwrap_outputs, wrap_inputs
from hyper_parallel.core.pipeline_parallel.comm_compute_overlap import CommComputeOverlap
from hyper_parallel.core.pipeline_parallel.messages import (META_LEN, Mailbox, MessageKey, TensorSpec, decode_specs,
                                                            encode_specs, receive, send, spec_of)
from hyper_parallel.core.pipeline_parallel.microbatch import merge_microbatches, split_microbatches
from hyper_parallel.core.pipeline_parallel.custom_step import CUSTOM_TYPES, CustomStepFn, PipelineContext
from hyper_parallel.core.pipeline_parallel.gradient_sync import StepReduction, defers_reduction
from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType, Schedule
from hyper_parallel.core.pipeline_parallel.schedules.lowering import add_communication, forward_only
from hyper_parallel.core.pipeline_parallel.schedules.validate import validate
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.weight_grad import Capture
from hyper_parallel.platform import Work

A = ActionType

#: [Note: forwards inside a stage's backward] A stage's forward can run again inside its
#: backward: MindSpore's out-of-order backwards re-record it ([Note: out-of-order
#: backwards] in ``platform/mindspore/autograd.py``), and a checkpointed block recomputes.
#: The math is the same forward's; a model's per-forward bookkeeping (an MoE layer's
#: routing counts) must not count it a second time, so the runtime marks every backward it
#: runs (``B``, ``I``, ``W``) and ``in_stage_backward`` tells a forward it is such a rerun.
#: A context variable: per thread, so the forward of an ``OVERLAP_B_F`` pair, on the other
#: thread, is not marked.
_IN_STAGE_BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("hyper_parallel_stage_backward",
                                                                          default=False)


def in_stage_backward() -> bool:
    """True while this thread runs a pipeline stage's backward (``B``, ``I`` or ``W``): a
    forward running now reruns one already counted ([Note: forwards inside a stage's
    backward])."""
    return _IN_STAGE_BACKWARD.get()


@contextlib.contextmanager
def _stage_backward() -> Iterator[None]:
    token = _IN_STAGE_BACKWARD.set(True)
    try:
        yield
    finally:
        _IN_STAGE_BACKWARD.reset(token)
#: loss_fn(last stage's output for one microbatch, that microbatch's target) -> scalar tensor
LossFn = Callable[[Any, Any], Any]
Microbatch = tuple[tuple[Any, ...], dict[str, Any]]


class PipelineSchedule:
    """Runs ``compute`` (every rank's compute actions, lowered and validated here) on this
    rank's ``stages``.

    Args:
        stages: the stages this rank runs (stage ``s`` on group rank ``s % group_size``),
            all of one pipeline (same ``num_stages`` and group).
        n_microbatches: microbatches per step; the batch size must be a multiple of it.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage, per microbatch
            (``step``); ``None``: the last stage's output is its loss (``run``, see
            [Note: the loss inside the last stage]).
        compute: ``{rank: [Action, ...]}`` compute actions of every rank of the group.
        scale_grads: multiply gradients by ``1 / n_microbatches`` (default: with a
            ``loss_fn``; without one the stages' seeds carry the scale).
        overlap: runs ``OVERLAP_B_F`` actions (required when the schedule has them).

    Raises:
        ValueError: no stages; stages of different pipelines; ``stages`` differ from the
            stages the schedule puts on this rank; a stage built with another
            ``placement=`` than the schedule's; ``n_microbatches < 1``.
        TypeError: ``loss_fn`` is neither callable nor ``None``.
        ScheduleError: the lowered schedule is invalid (see ``validate``).
    """

    #: where the schedule's stages run: ``"loop"`` (stage ``s`` on group rank ``s %
    #: group_size``) or ``"v"`` (rank ``r``: stages ``r`` and ``2 group_size - 1 - r``);
    #: handed to the stages when the schedule is built ([Note: stage placement] in
    #: ``stage.py``). ``None`` (this base class): the stages' own.
    placement: ClassVar[str | None] = None
    #: whether the schedule splits backwards into ``I`` and ``W`` (zero-bubble, DualPipeV)
    splits_backward: ClassVar[bool] = False

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: LossFn | None,
                 compute: Schedule, *, scale_grads: bool | None = None,
                 overlap: CommComputeOverlap | None = None) -> None:
        stages = list(stages)
        if not stages:
            raise ValueError(f"{type(self).__name__}: no stages; pass the PipelineStage(s) this rank runs")
        first = stages[0]
        if any(s.num_stages != first.num_stages or s.group is not first.group for s in stages):
            raise ValueError(f"{type(self).__name__}: stages {stages} are not of one pipeline (same num_stages and "
                             "group)")
        if n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches={n_microbatches} must be >= 1")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{type(self).__name__}: loss_fn={loss_fn!r} is not callable; give "
                            "loss_fn(output, target) -> scalar tensor, or None when the last stage returns its loss")
        if self.placement is not None:  # [Note: stage placement] in stage.py
            for stage in stages:
                stage._bind_placement(self.placement, type(self).__name__)
        self.platform = first.platform
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.scale_grads = loss_fn is not None if scale_grads is None else scale_grads
        #: runs ``OVERLAP_B_F`` actions (its wrap_dispatch/wrap_combine hooks pair them)
        self.overlap = overlap
        self.num_stages = first.num_stages
        self.group = first.group
        self._rank = first.group_rank
        self._place = first.stage_rank
        self._stages = {stage.stage_index: stage for stage in stages}
        expected = sorted({a.stage_index for a in compute.get(self._rank, [])})
        if sorted(self._stages) != expected:
            raise ValueError(f"{type(self).__name__}: rank {self._rank} holds stages {sorted(self._stages)} but the "
                             f"schedule runs stages {expected} here; build one PipelineStage per stage of this rank")
        #: every rank's lowered action list (this rank runs ``schedule[rank]``)
        self.schedule: Schedule = add_communication(compute, self.num_stages, self._place)
        validate(self.schedule, self.num_stages, n_microbatches, stage_to_rank=self._place)
        #: every rank's lowered forward-only action list, run by ``eval``: the schedule's
        #: forwards in its order (``schedules.lowering.forward_only``)
        self.eval_schedule: Schedule = add_communication(forward_only(compute), self.num_stages, self._place)
        validate(self.eval_schedule, self.num_stages, n_microbatches, stage_to_rank=self._place, backward=False)
        if overlap is None and any(a.type is A.OVERLAP_B_F for a in self.schedule[self._rank]):
            raise ValueError(f"{type(self).__name__}: the schedule has OVERLAP_B_F actions; pass overlap="
                             "CommComputeOverlap() (the one whose wrap_dispatch/wrap_combine the model uses)")
        if any(a.type is A.W for a in self.schedule[self._rank]):
            for stage in stages:  # split backwards: I computes no weight gradient of linear layers
                stage._split_weight_grads()
        self._defers_reduction = defers_reduction(self.actions)  # [Note: one reduction per step]
        self._incoming = self._incoming_messages(self.schedule)
        self._eval_incoming = self._incoming_messages(self.eval_schedule)
        self._specs_known = False
        self._custom: dict[ActionType, CustomStepFn] = {}  # register_custom_function
        #: after a step: the most (stage, microbatch) forwards this rank held for their
        #: backward at once, the runtime's count of what the simulator calls peak activations
        self.peak_activations = 0

    @property
    def actions(self) -> list[Action]:
        """This rank's lowered action list."""
        return self.schedule[self._rank]

    @property
    def _stage_dict(self) -> dict[int, PipelineStage]:
        """This rank's stages by stage index (upstream hyper-parallel's attribute, which
        MindFormers' custom step function reads)."""
        return self._stages

    def register_custom_function(self, action_type: ActionType, fn: CustomStepFn) -> None:
        """Run ``fn(action, ctx)`` in place of this runtime's own execution of every
        action of ``action_type`` (torch's ``_PipelineScheduleRuntime.register_custom_function``;
        MindFormers registers its pipeline x expert-parallel overlap for
        ``MetaStepType.OVERLAP_B_F``). ``ctx`` is a ``PipelineContext``; the function runs
        the action through the stages' ``forward_one_chunk`` / ``backward_one_chunk`` and
        the schedule's ``wait_fwd_recv`` / ``wait_bwd_recv`` / ``update_losses``
        (``core/pipeline_parallel/custom_step``). A later registration for the same type
        replaces the earlier one.

        Warns (``UserWarning``) when no rank's schedule has an action of that type: the
        function will not run (an ``OVERLAP_B_F`` needs ``overlap_b_f=True`` and a steady
        state).

        Raises:
            ValueError: ``action_type`` is not a compute type (``F``, ``B``, ``I``, ``W``,
                ``OVERLAP_B_F``).
            TypeError: ``fn`` is not callable.
        """
        if action_type not in CUSTOM_TYPES:
            raise ValueError(f"{type(self).__name__}.register_custom_function: action_type={action_type!r} is not a "
                             f"compute action type; use one of {sorted(t.name for t in CUSTOM_TYPES)}")
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}.register_custom_function: fn={fn!r} is not callable; give "
                            "fn(action, ctx) -> None")
        if not any(a.type is action_type for actions in self.schedule.values() for a in actions):
            # not an error: MindFormers registers its overlap whenever it asked for one, and a
            # schedule too short for a steady state (n_microbatches=1) still trains correctly
            fix = (" (Schedule1F1B / ScheduleInterleaved1F1B pair them with overlap_b_f=True, given a steady "
                   "state: more microbatches than pipeline ranks)") if action_type is A.OVERLAP_B_F else ""
            warnings.warn(f"{type(self).__name__}.register_custom_function: no rank runs an action of type "
                          f"{action_type.name} in this schedule, so fn will not run{fix}", stacklevel=2)
        self._custom[action_type] = fn

    def wait_fwd_recv(self, stage_index: int, microbatch_index: int) -> None:
        """Upstream's wait for the forward input a ``RECV_F`` received (the custom step
        function calls it before ``forward_one_chunk``). Here the ``RECV_F`` actions
        complete their receive before the compute action runs, so this checks it is there.

        Raises:
            RuntimeError: no step is running, or stage ``stage_index`` (after the first) has
                no input for the microbatch.
        """
        self._check_received("wait_fwd_recv", stage_index, microbatch_index, stage_index > 0, "inputs", "input",
                             "its RECV_F (or the previous stage's forward on this rank)")

    def wait_bwd_recv(self, stage_index: int, microbatch_index: int) -> None:
        """Upstream's wait for the output gradient a ``RECV_B`` received; as
        ``wait_fwd_recv``, the receive has completed and this checks the gradient is there.

        Raises:
            RuntimeError: no step is running, or stage ``stage_index`` (before the last) has
                no output gradient for the microbatch.
        """
        self._check_received("wait_bwd_recv", stage_index, microbatch_index, stage_index < self.num_stages - 1,
                             "output_grads", "output gradient", "its RECV_B (or the next stage's backward on this rank)")

    def _check_received(self, caller: str, s: int, m: int, expected: bool, store: str, what: str,
                        source: str) -> None:
        run = self._stages[s]._running(caller)
        if expected and (s, m) not in getattr(run, store):
            raise RuntimeError(f"{type(self).__name__}.{caller}: stage {s} has no {what} for microbatch {m}; {source} "
                               "must come first in the schedule")

    def update_losses(self, stage: PipelineStage, output: Any, losses: list[Any]) -> None:
        """Append ``output`` (what ``stage.forward_one_chunk`` returned) to ``losses`` if
        ``stage`` is the last (upstream's ``update_losses``). The step's own results do not
        depend on it: ``run`` / ``step`` return the last stage's outputs in microbatch order."""
        if stage.is_last:
            losses.append(output)

    @property
    def exec_order(self) -> Schedule:
        """Every rank's lowered action list (``self.schedule``), under upstream
        hyper-parallel's name (MindFormers logs it)."""
        return self.schedule

    def _incoming_messages(self, schedule: Schedule) -> dict[int, list[MessageKey]]:
        """Per peer, the messages it sends to this rank under ``schedule``, in its send order."""
        incoming: dict[int, list[MessageKey]] = {}
        for peer, actions in sorted(schedule.items()):
            for a in actions:
                if a.type is A.SEND_F and self._place(a.stage_index + 1) == self._rank:
                    incoming.setdefault(peer, []).append(("F", a.stage_index, a.microbatch_index))
                elif a.type is A.SEND_B and self._place(a.stage_index - 1) == self._rank:
                    incoming.setdefault(peer, []).append(("B", a.stage_index, a.microbatch_index))
        return incoming

    def _message_spec(self, key: MessageKey) -> tuple[TensorSpec, ...]:
        kind, stage, _ = key
        spec = self._stages[stage + 1].input_spec if kind == "F" else self._stages[stage - 1].output_spec
        assert spec is not None, "specs are inferred before the first message"
        return spec

    def _infer_specs(self, first: Microbatch, every_kwargs: dict[str, Any] | None = None) -> None:
        """The shapes crossing each stage boundary, from microbatch 0: every stage, in
        stage order, runs its forward without recording and sends its output's specs,
        then the output, to the next stage (which runs on it in turn). Pairs of ranks see
        their messages in stage order, so no reordering is needed here. ``every_kwargs``:
        microbatch 0's keyword arguments for the stages after the first (``run``)."""
        p = self.platform
        works: list[Work] = []
        local: tuple[Any, ...] = ()
        handed: tuple[Rebuild | None, ...] = ()  # the previous stage's layouts, on this rank
        for s in sorted(self._stages):
            stage = self._stages[s]
            args, kwargs = first if s == 0 else (local, every_kwargs or {})
            if s > 0 and self._place(s - 1) != self._rank:
                meta = receive(p, [TensorSpec((META_LEN,), "int64")], self._place(s - 1), self.group)[0]
                specs = decode_specs(p, meta)
                args = receive(p, specs, self._place(s - 1), self.group)
                # [Note: DTensors between stages]
                stage.input_rebuilds = tuple(None if spec.layout is None else
                                             resolve(stage, spec.layout, p.rank(), f"stage {s} input {i}")
                                             for i, spec in enumerate(specs))
            elif s > 0:
                stage.input_rebuilds = handed
            if s > 0:
                stage.input_spec = spec_of(p, args, f"stage {s - 1} output")
                args = wrap_inputs(args, stage.input_rebuilds)
            with p.no_grad():
                out = stage.submodule(*args, **kwargs)
            if stage.is_last:
                continue
            outs = out if isinstance(out, tuple) else (out,)
            stage.output_spec = spec_of(p, outs, f"stage {s} output")
            handed = stage.output_rebuilds = rebuilds_of(outs)
            outs = unwrap_outputs(outs)
            if self._place(s + 1) == self._rank:
                local = outs
            else:
                works += send(p, [encode_specs(p, stage.output_spec)], self._place(s + 1), self.group)
                works += send(p, outs, self._place(s + 1), self.group)
        for work in works:
            work.wait()
        self._specs_known = True

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any) -> Any:
        """Run one training step's forwards and backwards over ``n_microbatches``.

        Args:
            *args, **kwargs: stage 0's inputs for the whole batch, ``[batch, ...]``
                tensors split along dim 0 (non-tensors go to every microbatch); used on
                the rank running stage 0, ignored elsewhere.
            target: ``[batch, ...]``, split like the inputs; required on the rank
                running the last stage.
            losses: if given, the last stage's rank appends each microbatch's loss
                (detached scalar tensors, microbatch order, unscaled).

        Returns:
            On the rank running the last stage, its output for the whole batch (the
            microbatch outputs concatenated along dim 0); ``None`` elsewhere. Gradients
            are in each stage's ``param_grads()`` (and, on torch, ``param.grad``).

        Raises:
            ValueError: stage 0's rank got no inputs, the last stage's rank no target, or
                a batch size not divisible by ``n_microbatches``.
        """
        if self.loss_fn is None:
            raise TypeError(f"{type(self).__name__}.step: this schedule has no loss_fn (its last stage returns the "
                            "loss); call run(*args, **kwargs), or build it with loss_fn=")
        p, n = self.platform, self.n_microbatches
        last = self.num_stages - 1
        microbatches: list[Microbatch] = []
        targets: list[Any] = []
        if 0 in self._stages:
            if not args and not kwargs:
                raise ValueError(f"{type(self).__name__}.step: rank {self._rank} runs stage 0 and needs the batch "
                                 "(step(x, ...))")
            microbatches = split_microbatches(p, args, kwargs, n)
        if last in self._stages:
            if target is None:
                raise ValueError(f"{type(self).__name__}.step: rank {self._rank} runs the last stage and needs "
                                 "target= for loss_fn")
            targets = [mb[0][0] for mb in split_microbatches(p, (target,), {}, n)]
        run = self._execute(microbatches, targets, None)
        if last not in self._stages:
            return None
        if losses is not None:
            losses.extend(run.losses[m] for m in range(n))
        return merge_microbatches(p, [run.outputs[m] for m in range(n)])

    def run(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Run one training step's forwards and backwards over ``n_microbatches``, the
        loss computed by the last stage ([Note: the loss inside the last stage]; upstream
        hyper-parallel's ``run``, which MindFormers' trainer calls as ``run(**batch)``).

        Args:
            *args: stage 0's positional inputs, ``[batch, ...]`` tensors split along dim 0.
            **kwargs: every stage's keyword inputs, split the same way (non-tensors go to
                every microbatch); a stage after the first takes the previous stage's
                outputs positionally, then these.

        Returns:
            On the rank running the last stage, its outputs per microbatch (detached, in
            microbatch order; MindFormers reads the loss as ``output[0]``); ``[]``
            elsewhere. Gradients are in each stage's ``param_grads()`` (and, on torch,
            ``param.grad``; under fully_shard, where its hooks put them).

        Raises:
            TypeError: the schedule was built with a ``loss_fn`` (use ``step``).
            ValueError: stage 0's rank got no inputs, or a batch size not divisible by
                ``n_microbatches``.
        """
        if self.loss_fn is not None:
            raise TypeError(f"{type(self).__name__}.run: this schedule has a loss_fn; call step(*args, target=...), "
                            "or build it with loss_fn=None for a last stage that returns its loss")
        if 0 in self._stages and not args and not kwargs:
            raise ValueError(f"{type(self).__name__}.run: rank {self._rank} runs stage 0 and needs the batch "
                             "(run(**batch))")
        n = self.n_microbatches
        split = split_microbatches(self.platform, args, kwargs, n) if args or kwargs else [((), {})] * n
        every_kwargs = [mb_kwargs for _, mb_kwargs in split]
        run = self._execute(split if 0 in self._stages else [], [], every_kwargs)
        if self.num_stages - 1 not in self._stages:
            return []
        return [run.outputs[m] for m in range(n)]

    def eval(self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any) -> Any:
        """A forward-only step (torch.distributed.pipelining's ``eval``): the schedule's
        forwards over ``n_microbatches``, in its order (``self.eval_schedule``), without
        recording for a backward (under ``platform.no_grad``), with the sends and receives
        of the activations only. No gradient is computed or touched (``param_grads()``
        keeps the last ``step``'s); custom step functions do not run; the stages' split
        linear layers run their own forward.

        With a ``loss_fn`` it takes ``step``'s arguments and returns what ``step`` would:
        on the last stage's rank the merged output, and with ``target`` given each
        microbatch's loss appended to ``losses`` (without ``target`` no loss is computed).
        Without one it takes ``run``'s and returns what ``run`` would (the last stage's
        outputs per microbatch; ``[]`` elsewhere). ``None`` elsewhere for the former.

        Collectives: point-to-point over the pipeline group (and, on the first call of
        the schedule, the shape inference of ``step``).

        Raises:
            ValueError: stage 0's rank got no inputs, or a batch size not divisible by
                ``n_microbatches``.
        """
        p, n = self.platform, self.n_microbatches
        last = self.num_stages - 1
        if 0 in self._stages and not args and not kwargs:
            raise ValueError(f"{type(self).__name__}.eval: rank {self._rank} runs stage 0 and needs the batch "
                             "(eval(x, ...))")
        if self.loss_fn is None:  # run()'s form: kwargs go to every stage
            split = split_microbatches(p, args, kwargs, n) if args or kwargs else [((), {})] * n
            with p.no_grad():
                run = self._execute(split if 0 in self._stages else [], [], [mb_kwargs for _, mb_kwargs in split],
                                    forward_only=True)
            return [run.outputs[m] for m in range(n)] if last in self._stages else []
        microbatches = split_microbatches(p, args, kwargs, n) if 0 in self._stages else []
        targets = [mb[0][0] for mb in split_microbatches(p, (target,), {}, n)] \
            if last in self._stages and target is not None else []
        with p.no_grad():
            run = self._execute(microbatches, targets, None, forward_only=True)
        if last not in self._stages:
            return None
        if losses is not None and targets:
            losses.extend(run.losses[m] for m in range(n))
        return merge_microbatches(p, [run.outputs[m] for m in range(n)])

    def _execute(self, microbatches: list[Microbatch], targets: list[Any],
                 every_kwargs: list[dict[str, Any]] | None, forward_only: bool = False) -> _StepState:
        if not self._specs_known:
            self._infer_specs(microbatches[0] if microbatches else ((), {}),
                              every_kwargs[0] if every_kwargs else None)
        if forward_only:
            run = _StepState(self, microbatches, targets, every_kwargs, forward_only=True)
            for action in self.eval_schedule[self._rank]:
                run.execute(action)
            for work in run.sends:
                work.wait()
            return run
        for stage in self._stages.values():
            stage._reset_grads()
        run = _StepState(self, microbatches, targets, every_kwargs)
        self.peak_activations = 0
        for stage in self._stages.values():
            stage._step = run  # forward_one_chunk / backward_one_chunk run inside this step
        # fully_shard'ed stages reduce once per step here: [Note: one reduction per step]
        reduction = StepReduction(self.platform, self._stages, self.actions) if self._defers_reduction else None
        try:
            for index, action in enumerate(self.actions):
                run.execute(action)
                self.peak_activations = max(self.peak_activations, len(run.backward))
                if reduction is not None:
                    reduction.after(index)
        finally:
            if reduction is not None:
                reduction.restore()
            for stage in self._stages.values():
                stage._step = None
        for work in run.sends:
            work.wait()
        return run


class _StepState:
    """What one step holds between actions, keyed by (stage, microbatch)."""

    def __init__(self, schedule: PipelineSchedule, microbatches: list[Microbatch], targets: list[Any],
                 every_kwargs: list[dict[str, Any]] | None = None, forward_only: bool = False) -> None:
        self.schedule = schedule
        self.p = schedule.platform
        self.microbatches = microbatches
        self.targets = targets
        self.every_kwargs = every_kwargs  # run(): each microbatch's kwargs, for every stage
        self.forward_only = forward_only  # eval(): forwards without recording, no custom functions
        incoming = schedule._eval_incoming if forward_only else schedule._incoming
        self.mailbox = Mailbox(self.p, schedule.group, incoming, schedule._message_spec)
        self.inputs: dict[tuple[int, int], tuple[Any, ...]] = {}  # F's inputs (received or handed over)
        # vjp backward of each F (None after an I that left W nothing to re-walk)
        self.backward: dict[tuple[int, int], Callable[..., Any] | None] = {}
        self.captures: dict[tuple[int, int], Capture] = {}  # split linear layers' deferred operands
        self.outputs_to_send: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.output_grads: dict[tuple[int, int], tuple[Any, ...]] = {}  # B's output gradients
        self.input_grads_to_send: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.weight_pending: dict[tuple[int, int], list[Any]] = {}  # I ran: W's output gradients
        self.last_outputs: dict[int, tuple[Any, list[Any]]] = {}  # last stage: (loss, outputs) per microbatch
        self.losses: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.sends: list[Work] = []
        n = schedule.n_microbatches
        # what a custom step function sees (register_custom_function)
        self.context = PipelineContext(
            schedule,
            [args for args, _ in microbatches] if microbatches else [()] * n,
            [kwargs for _, kwargs in microbatches] if microbatches else (every_kwargs or [{}] * n),
            targets)

    def execute(self, action: Action) -> None:
        s, m = action.stage_index, action.microbatch_index
        sched, place = self.schedule, self.schedule._place
        custom = None if self.forward_only else sched._custom.get(action.type)
        if custom is not None:
            custom(action, self.context)
        elif action.type is A.F:
            self.forward_step(s, m)
        elif action.type is A.B:
            self.backward_full(s, m)
        elif action.type is A.I:
            self.backward_full(s, m, part="input")
        elif action.type is A.W:
            self.backward_weight(s, m)
        elif action.type is A.OVERLAP_B_F:
            b, f = action.sub_actions
            assert sched.overlap is not None, "checked at construction"
            sched.overlap.run(lambda: self.forward_step(f.stage_index, f.microbatch_index),
                              lambda: self.backward_full(b.stage_index, b.microbatch_index))
        elif action.type is A.RECV_F:
            self.inputs[(s, m)] = self.mailbox.get(place(s - 1), ("F", s - 1, m))
        elif action.type is A.SEND_F:
            self.sends += send(self.p, self.outputs_to_send.pop((s, m)), place(s + 1), sched.group)
        elif action.type is A.RECV_B:
            self.output_grads[(s, m)] = self.mailbox.get(place(s + 1), ("B", s + 1, m))
        elif action.type is A.SEND_B:
            self.sends += send(self.p, self.input_grads_to_send.pop((s, m)), place(s - 1), sched.group)
        else:
            raise NotImplementedError(f"pipeline runtime: action {action} ({action.type.name}) is not run by "
                                      f"{type(sched).__name__}")

    def forward_step(self, s: int, m: int) -> None:
        """The runtime's own ``F``: the forward on the microbatch's inputs, its output
        recorded for ``update_losses`` as a custom function's would be."""
        self.schedule.update_losses(self.schedule._stages[s], self.forward(s, m), self.context.losses)

    def forward(self, s: int, m: int, args: Any = None, kwargs: dict[str, Any] | None = None) -> Any:
        """Stage ``s``'s forward of microbatch ``m``; ``args`` (stage 0) and ``kwargs``
        default to the microbatch's. Returns the stage's output (detached; the last
        stage's, or with a ``loss_fn`` its loss)."""
        sched, p = self.schedule, self.p
        stage = sched._stages[s]
        if s == 0:
            args = self.microbatches[m][0] if args is None else tuple(args)
            kwargs = self.microbatches[m][1] if kwargs is None else kwargs
        else:
            args = self.inputs.pop((s, m))
            if kwargs is None:
                kwargs = self.every_kwargs[m] if self.every_kwargs else {}
        if self.forward_only:
            return self._forward_only(s, m, args, kwargs)
        params = [param for _, param in stage.named_params]
        split = stage.weight_split
        capture = None if split is None else Capture()
        if capture is not None:
            self.captures[(s, m)] = capture

        def module(*xs: Any) -> Any:
            # differentiated on local pieces: [Note: DTensors between stages] in boundary.py
            xs = wrap_inputs(xs, stage.input_rebuilds)
            if split is None:
                out = stage.submodule(*xs, **kwargs)
            else:
                with split.recording(capture):  # also on a recompute inside a MindSpore backward
                    out = stage.submodule(*xs, **kwargs)
            return out if stage.is_last else unwrap_outputs(out)

        if stage.is_last and sched.loss_fn is None:  # [Note: the loss inside the last stage]
            result, backward = p.vjp(module, args, params)
            if isinstance(result, (tuple, list)):
                self.outputs[m] = type(result)(p.detach(t) for t in result)
            else:
                self.outputs[m] = p.detach(result)
            self.last_outputs[m] = (None, [self.outputs[m]])
        elif stage.is_last:
            target = self.targets[m]

            def fn(*xs: Any) -> Any:
                out = module(*xs)
                return (sched.loss_fn(out, target),) + (out if isinstance(out, tuple) else (out,))

            result, backward = p.vjp(fn, args, params)
            outs = tuple(p.detach(t) for t in result)
            self.losses[m] = outs[0]
            self.outputs[m] = outs[1:] if len(outs) > 2 else outs[1]
            self.last_outputs[m] = (outs[0], list(outs[1:]))
        else:
            result, backward = p.vjp(module, args, params)
            outs = tuple(p.detach(t) for t in (result if isinstance(result, tuple) else (result,)))
            if sched._place(s + 1) == sched._rank:
                self.inputs[(s + 1, m)] = outs
            else:
                self.outputs_to_send[(s, m)] = outs
        self.backward[(s, m)] = backward
        if not stage.is_last:
            return outs if len(outs) > 1 else outs[0]
        return self.losses[m] if sched.loss_fn is not None else self.outputs[m]

    def _forward_only(self, s: int, m: int, args: Any, kwargs: dict[str, Any]) -> Any:
        """``eval``'s ``F``: stage ``s`` on microbatch ``m``'s ``args``, nothing recorded
        (the caller holds ``no_grad``); the output goes on as ``forward``'s does, the last
        stage's is kept (with its loss when there is a target)."""
        sched = self.schedule
        stage = sched._stages[s]
        out = stage.submodule(*wrap_inputs(tuple(args), stage.input_rebuilds), **kwargs)
        if stage.is_last:
            self.outputs[m] = out
            if sched.loss_fn is not None and self.targets:
                self.losses[m] = sched.loss_fn(out, self.targets[m])
                return self.losses[m]
            return out
        outs = unwrap_outputs(out if isinstance(out, tuple) else (out,))
        if sched._place(s + 1) == sched._rank:
            self.inputs[(s + 1, m)] = outs
        else:
            self.outputs_to_send[(s, m)] = outs
        return outs if len(outs) > 1 else outs[0]

    def _recording(self, s: int, capture: Capture | None) -> AbstractContextManager[None]:
        """Around a backward of stage ``s``: its split linear layers record into the
        microbatch's ``capture``, so that a checkpointed block recomputed inside this
        backward takes the path its forward took ([Note: activation checkpointing in
        pipeline stages] in ``core/activation_checkpoint/checkpoint``)."""
        split = self.schedule._stages[s].weight_split
        return nullcontext() if split is None or capture is None else split.recording(capture)

    def _grads_of_outputs(self, s: int, m: int) -> list[Any]:
        p = self.p
        if s == self.schedule.num_stages - 1:
            loss, outs = self.last_outputs.pop(m)
            scale = 1.0 / self.schedule.n_microbatches if self.schedule.scale_grads else 1.0
            if loss is None:  # the stage's output is the loss: seeded by the stage
                seeds = self.schedule._stages[s].get_last_stage_sens(outs[0])
                seeds = list(seeds) if isinstance(seeds, (tuple, list)) else [seeds]
                return seeds if scale == 1.0 else [seed * scale for seed in seeds]
            # the loss starts the backward; the outputs returned beside it take no gradient
            return [p.full(tuple(loss.shape), scale, loss.dtype)] + [p.zeros(tuple(o.shape), o.dtype) for o in outs]
        return list(self.output_grads.pop((s, m)))

    def backward_full(self, s: int, m: int, part: str = "all") -> None:
        """``B`` (``part="all"``) or ``I`` (``part="input"``: the input gradient only;
        the recording and its output gradients wait for ``W``)."""
        sched = self.schedule
        grads_out = self._grads_of_outputs(s, m)
        capture = self.captures.get((s, m)) if part == "input" else self.captures.pop((s, m), None)
        if part == "input":
            backward = self.backward[(s, m)]  # held until W: the activations stay alive
            assert backward is not None, "F ran"
            self.weight_pending[(s, m)] = grads_out
        else:
            backward = self.backward.pop((s, m))
            assert backward is not None, "F ran"
        if capture is not None and part == "input":
            capture.deferring = True  # split linear layers store (x, grad_y) for W
        try:
            with self._recording(s, capture), _stage_backward():
                input_grads, param_grads = backward(grads_out, part=part)
        finally:
            if capture is not None:
                capture.deferring = False
        if part == "all":
            sched._stages[s]._accumulate(param_grads)
        split = sched._stages[s].weight_split
        if capture is not None and part == "input" and split is not None and not split.rewalk_needed(capture):
            self.backward[(s, m)] = None  # W needs only the stored operands: free the recording
        if s > 0:
            grads = tuple(input_grads)
            if sched._place(s - 1) == sched._rank:
                self.output_grads[(s - 1, m)] = grads
            else:
                self.input_grads_to_send[(s, m)] = grads

    def backward_weight(self, s: int, m: int) -> None:
        """``W``: the parameter gradients of a backward whose ``I`` ran: the split linear
        layers' stored weight-gradient matmuls, and ``vjp``'s ``part="weight"`` for the
        other parameters (when there are any)."""
        stage = self.schedule._stages[s]
        backward, grads_out = self.backward.pop((s, m)), self.weight_pending.pop((s, m))
        capture = self.captures.pop((s, m), None)
        params = [param for _, param in stage.named_params]
        grads: list[Any] = [None] * len(params)
        if backward is not None:
            with self._recording(s, capture), _stage_backward():
                grads = list(backward(grads_out, part="weight")[1])
        if capture is not None and stage.weight_split is not None:
            landed = stage.weight_split.land(capture, params)
            grads = [own if new is None else (new if own is None else own + new) for own, new in zip(grads, landed)]
        stage._accumulate(grads)
