"""One fully_shard unit: its hooks, its unshard/reshard, its gradient reduction.

[Note: gathered parameters and autograd]
The unit's forward reads each parameter through ``GatherParam`` (a custom function),
so autograd routes the full gradient to the sharded parameter through our reduction.
With ``reshard_after_forward=True`` the forward runs inside
``platform.release_saved_tensors``: what the module's operations save for backward
from a gathered parameter is stored as a token, not as the tensor, so once the unit
drops ``HSDPParam.unsharded`` after the forward the gathered memory is released; the
backward calls ``_reload``, which all-gathers again (the backward pre-hook has usually
prefetched it). A saved use that the backend cannot match to its source (a copy made
before saving) is kept as is: the gradient stays exact, only that memory is held.

[Note: collectives and overlap]
A fully_shard tree has two streams of its own (``HSDPContext.streams``; no-ops on CPU):
all-gathers are issued on the all-gather stream and reduce-scatters on the
reduce-scatter stream, both ``async_op=True``, so they overlap compute on the current
stream. The orderings that matter, and how each is kept:

1. A collective must not read its input before the current stream has produced it
   (the cast shard; the full gradient): an event is recorded on the current stream and
   the collective's stream waits for it before issuing (``HSDPParam.start_gather``,
   ``start_reduce``).
2. A result must not be read before the collective has written it: ``Work.wait()`` at
   the first use (``_wait_unshard``, ``_reload``, ``WaitReduce.backward``) makes the
   current stream wait for the collective (NCCL/HCCL), or blocks the host (gloo, CPU).
3. A pooled gather buffer must not be overwritten while a reader is queued: see
   [Note: when a pooled buffer may be overwritten] (``buffer_pool``).
4. The reduce-scatter is asynchronous, yet autograd must hand the optimizer (and
   MindSpore's ``value_and_grad``) the sharded gradient. So the sharded parameter
   reaches ``GatherParam`` through ``WaitReduce``, an identity whose backward waits for
   the reduce-scatter and returns the gradient: ``GatherParam.backward`` issues the
   reduce-scatter (the unit's flat one once its last gradient is written: [Note: flat
   reduce-scatter] in ``param_group``) and returns a placeholder, ``WaitReduce.backward``
   returns the real gradient. Autograd runs a ready node created later before one created earlier
   (torch's engine orders ready nodes by creation), so ``WaitReduce`` nodes of unit
   ``U`` are created in the forward pre-hook of the unit that ran just before ``U``
   in the last step: ``U``'s reduce-scatter is then waited for only after that
   previous unit's backward compute, which it overlaps (FSDP2 likewise waits for a
   unit's reduce-scatter at the next unit's). This is the latest safe point: the
   gradient is read right after. Units with no predecessor (the first step, the first
   unit) create their own. A reduce-scatter still in flight when its unit unshards
   (a prefetch of a unit whose backward has partly run) is waited for there and its
   result kept for ``WaitReduce``; one never collected (a backward cut short) is
   waited for and dropped at the root's next forward, so nothing leaks across steps.

[Note: no stale gathered copy]
The optimizer steps the shards between steps (torch: in place, which a gathered copy
does not see; MindSpore: ``Assign`` into the parameter, likewise), so a copy gathered
in one step must not serve the next. Every gather the hooks issue (unshard, prefetch,
``_reload``) marks its unit (``_hook_copy``); the root's forward pre-hook reshards every
marked unit of its tree (``HSDPContext.units``) before anything is gathered, so each
forward computes with parameters gathered from the current shards. A copy the hooks
would leave behind without it: an explicit backward prefetch of a unit whose backward
already ran (skipped in ``_pre_backward``, as it gathers for nothing), a prefetch of a
unit that then did not run, a no-grad forward with ``reshard_after_forward=False``
(nothing drops its copy), a parameter that received no gradient. A manual ``unshard()``
between steps is not marked and is kept (call it after the optimizer step, as with
FSDP2); one on a marked unit gathers again.

[Note: parameter substitution]
During the forward a module reads ``module.<name>``; the sharded parameter stays
registered (the optimizer and ``named_parameters`` see shards) and the gathered tensor
is put in the instance ``__dict__``, which both torch ``Module`` and MindSpore ``Cell``
consult before their registered parameters; it is removed after the forward.

[Note: recomputation and gathered parameters]
A module checkpointed by activation checkpointing (``core/activation_checkpoint``) runs
its forward again inside the backward, reading ``module.<name>`` again after the
post-forward hook removed the gathered tensors. The recomputation must read tensors that,
like ``GatherParam``'s outputs in the forward, require gradients: an operation saves
less for a constant operand, and the frameworks match recomputed saved tensors to the
forward's by their order. So the unit hooks every module that holds one of its
parameters (``_pre_recompute``/``_post_recompute``): in the recomputation only
(``checkpoint_phase()``), each parameter is read through a new ``GatherParam`` of the
gathered tensor (the backward pre-hook gathered it; gathered here otherwise). That graph
only supplies saved values and is never run backward: gradients flow through the first
forward's ``GatherParam``, whose backward reduce-scatters each gradient once. Entries
the recomputation leaves behind (the frameworks stop it early, skipping post-hooks) are
removed when the parameter's gradient is final (``on_grad``) and by ``reshard``. A
module checkpointed as a whole runs its own hooks outside the recomputation, so
fully_shard refuses a parameter held directly by a checkpointed module.

The hooks on those modules are registered only once the unit will be recomputed: when a
checkpointed forward began inside the unit's forward (``checkpointed_forwards()`` moved
between its pre- and post-hook: a checkpointed block, or ``checkpoint`` called in its
forward) or the unit's own hooks run inside a checkpointed region. Both are seen before
the first recomputation. A unit never recomputed has no hooks inside it, so a compiled
block (``Platform.compile_module``) runs as one graph, not one piece per module between
hooks that do nothing (torch: dp-shard 2 compiled, 18 graph breaks per block).

[Note: a unit inside a checkpointed module]
MindFormers checkpoints each decoder layer, then fully_shards the norms inside it, then
the layer. The inner unit's hooks then run inside the checkpointed forward, and again in
the recomputation. In the forward they run as always except that the unit pushes no
saved-tensor hooks: the checkpoint's (outer) hooks drop every save of the region already,
the gathered parameters included, and inner hooks would take those saves from it, so the
recomputation would find them missing. In the recomputation the unit's own hooks only
cast (mixed precision, as the forward did) and ``_pre_recompute`` hands the module its
parameters through a new ``GatherParam`` as above (gathering them again where the
forward dropped them: a collective every rank issues at the same point of the backward);
gradients flow through the first forward's ``GatherParam``, reduce-scattered once.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.activation_checkpoint.region import CheckpointPhase, checkpoint_phase, checkpointed_forwards
from hyper_parallel.core.dtensor.device_mesh import _axis_lines
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.fully_shard.buffer_pool import GatherBufferPool
from hyper_parallel.core.fully_shard.hsdp_param import GatherParam, HSDPParam, WaitReduce
from hyper_parallel.core.fully_shard.param_group import ParamGroup
from hyper_parallel.core.fully_shard.policies import MixedPrecisionPolicy
from hyper_parallel.core.module_attrs import FULLY_SHARDED_ATTR
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import ReduceOp
from hyper_parallel.platform.contract.autograd import unmatched
from hyper_parallel.core.process_groups import split_group
from hyper_parallel.core.tensor_ops import dtype_name


#: The attribute of a fully sharded module that holds its ``HSDPState``.
STATE_ATTR = FULLY_SHARDED_ATTR


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class HSDPContext:
    """What the units of one fully_shard tree share: the order in which their forwards
    finished in the last step. The backward runs in the reverse of that order, so the
    unit before a unit in it is the next one the backward reaches (FSDP2's implicit
    backward prefetch)."""

    def __init__(self) -> None:
        self.units: list[HSDPState] = []  # every unit of the tree, the root last
        self.post_forward_order: list[HSDPState] = []
        self.pre_forward_order: list[HSDPState] = []  # this step's, so far
        self.last_pre_forward_order: list[HSDPState] = []  # the last step's
        self._streams: tuple[Any, Any] | None = None
        # The units' flat all-gather and reduce-scatter buffers (see [Note: flat
        # all-gather copy-in] in ``param_group``): one pool for the tree, so units of
        # one size share them across units and steps.
        self.flat_buffers: GatherBufferPool = GatherBufferPool()

    def streams(self) -> tuple[Any, Any]:
        """``(all_gather_stream, reduce_scatter_stream)``, made at first use (the units
        of a tree share the root's context only once the root is sharded)."""
        if self._streams is None:
            p = get_platform()
            self._streams = (p.new_stream(), p.new_stream())
        return self._streams


class HSDPState:
    """The state of one fully_shard unit (``module`` and the parameters it manages)."""

    def __init__(self, module: Any, params: list[HSDPParam], reshard_after_forward: bool | int,
                 mp_policy: MixedPrecisionPolicy, mesh: Any) -> None:
        p = get_platform()
        self.module: Any = module
        self.params: list[HSDPParam] = params
        self.reshard_after_forward: bool | int = reshard_after_forward
        # int k: the shard axis is cut into blocks of k consecutive ranks (FSDP2 meaning:
        # "reshard to a smaller world size"); k == shard size behaves as False.
        self.block_size: int | None = None
        if not isinstance(reshard_after_forward, bool):
            self.block_size = int(reshard_after_forward)
            # The shard axis's lines across the whole root mesh (not only this rank's
            # submesh): split_group is collective over the world, so every rank must
            # pass the same partition.
            # A flattened mesh (mesh["dp", "cp"].flatten()) has one axis over several root axes.
            root_axes = list(mesh._root_axes)
            shard_axes = root_axes if len(root_axes) != mesh.ndim else root_axes[-1:]
            lines = _axis_lines(mesh._root.mesh, shard_axes)
            k = self.block_size
            inter = split_group([line[i::k] for line in lines for i in range(k)])
            for hp in params:
                hp.inter_group = inter
        self.mp_policy: MixedPrecisionPolicy = mp_policy
        for hp in params:
            hp.accumulate_main_grad = mp_policy.apply_grad_on_fp32_main_grad
        self.is_root: bool = True  # False once an enclosing fully_shard adopts this unit
        self.context: HSDPContext = HSDPContext()
        self.context.units.append(self)
        self.training_state: TrainingState = TrainingState.IDLE
        self.requires_gradient_sync: bool = True
        self.reduce_op: ReduceOp = ReduceOp.AVG  # AVG: gradients divided by the data-parallel size; SUM: not
        self.forward_prefetch: list[HSDPState] = []
        self.backward_prefetch: list[HSDPState] | None = None  # None: the next unit the backward reaches
        self._release: Any = None  # the entered release_saved_tensors context during forward
        self._hook_copy: bool = False  # holds what the hooks gathered: [Note: no stale gathered copy]
        # (id(owner), attribute) -> the tensor _pre_recompute put there, until it is removed
        self._recomputed: dict[tuple[int, str], Any] = {}
        self._grads_pending: int = 0
        self.groups: list[ParamGroup] | None = None  # made at the first gather: see _group
        self._param_dtype: Any = None if mp_policy.param_dtype is None else p.dtype(mp_policy.param_dtype)
        reduce = mp_policy.reduce_dtype or mp_policy.param_dtype
        self._reduce_dtype: Any = None if reduce is None else p.dtype(reduce)
        self._output_dtype: Any = None if mp_policy.output_dtype is None else p.dtype(mp_policy.output_dtype)
        # unmatched (platform/contract/autograd): [Note: selective checkpointing] in platform/selective_checkpoint
        self._handles: list[Any] = [
            p.register_forward_pre_hook(module, unmatched(self._pre_forward)),
            p.register_forward_hook(module, unmatched(self._post_forward)),
            p.register_full_backward_pre_hook(module, unmatched(self._pre_backward)),
        ]
        # [Note: recomputation and gathered parameters]: the modules that read the parameters,
        # hooked by _hook_recomputation once the unit will be recomputed
        self._owners: dict[int, tuple[Any, list[tuple[HSDPParam, str]]]] = {}
        for hp in params:
            for owner, name in hp.uses:
                self._owners.setdefault(id(owner), (owner, []))[1].append((hp, name))
        self._recomputation_hooked = False
        self._forwards_before: int | None = None  # checkpointed_forwards() at the pre-forward

    # -- public -----------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """All-gather every managed parameter over the shard axis (no-op for those
        already gathered or in flight by an earlier ``unshard``; what the hooks gathered
        is dropped and gathered again, see [Note: no stale gathered copy]). With
        ``async_op`` the collectives are only issued (prefetch); the next use waits for
        them. Call it after the optimizer step: the copy is kept until used."""
        if self._hook_copy:
            self.reshard()
        self._unshard(async_op)

    def _group(self) -> None:
        """Put the unit's sharded parameters into ``ParamGroup``s (one per dtype), whose
        one flat all-gather and one flat reduce-scatter serve them all. Made at the
        first gather, after ``weight_parallel`` set its pools: a replicated parameter and
        a pooled one keep their own collectives (see ``param_group``)."""
        if self.groups is not None:
            return
        by_dtype: dict[str, list[HSDPParam]] = {}
        for hp in self.params:
            if not hp.whole_here and hp.pool is None:  # [Note: a shard axis of one rank] in hsdp_param
                by_dtype.setdefault(dtype_name(hp.sharded.dtype), []).append(hp)
        self.groups = [ParamGroup(members, self) for members in by_dtype.values()]

    def _unshard(self, async_op: bool) -> None:
        """``unshard`` from the hooks: marks the unit, whose copy the root's next forward drops."""
        self._group()
        self._hook_copy = True
        for hp in self.params:
            if hp.pending_reduce is not None:
                # Waited for here (a prefetch of a unit whose backward has partly run),
                # kept for its WaitReduce; dropped at the next step if never collected.
                hp.reduced = hp.finish_reduce()
            if not hp.is_gathered and hp.pending is None:
                hp.start_gather(self._param_dtype or hp.sharded.dtype, self.context.streams()[0])
        if not async_op:
            self._wait_unshard()

    def reshard(self) -> None:
        """Drop the gathered parameters and kept blocks (their memory is released once
        autograd holds none; see [Note: gathered parameters and autograd])."""
        self._drop_gathered()
        for hp in self.params:
            hp.block = None
        self._hook_copy = False

    def _drop_gathered(self) -> None:
        for hp in self.params:
            if hp.pending is not None:
                hp.finish_gather()
            hp.drop_unsharded()
            self._unsubstitute(hp)

    def set_modules_to_forward_prefetch(self, modules: Sequence[Any]) -> None:
        """When this unit's forward starts, issue the all-gathers of these fully sharded
        modules' units (asynchronously), so they overlap this unit's compute.

        Raises:
            ValueError: a module that was not passed to fully_shard.
        """
        self.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[Any]) -> None:
        """When this unit's backward starts, issue these units' all-gathers (replaces the
        implicit prefetch of the unit that ran before this one in the forward).

        Raises:
            ValueError: a module that was not passed to fully_shard.
        """
        self.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """``False``: backwards accumulate full gradients locally (no collective) and the
        sharded gradients they return are zero; the next backward with ``True`` adds the
        accumulated sum before the reduce-scatter. Use for gradient accumulation."""
        self.requires_gradient_sync = bool(requires_gradient_sync)

    def set_reduce_op_type(self, op: str | ReduceOp) -> None:
        """How this unit's gradients are reduced over the data-parallel ranks (the
        ``N`` shard ranks times the ``R`` replicate ranks on HSDP): ``"avg"`` (or
        ``"mean"``, ``ReduceOp.AVG``; the default) sums them (reduce-scatter, then the
        replicate all-reduce) and divides by ``N * R``, the gradient of the global mean
        loss when each rank's loss is the mean over an equal share of the batch;
        ``"sum"`` (``ReduceOp.SUM``) leaves the sum, for a loss whose scaling already
        divides (each rank's loss a share of the global sum). Takes effect at the next
        reduction; set it between steps.

        Raises:
            TypeError: ``op`` is not a str or a ReduceOp.
            ValueError: any other value (``"max"``, ``ReduceOp.MIN``, ...).
        """
        reduce_op = parse_reduce_op_type(op)
        self.reduce_op = reduce_op
        for hp in self.params:
            hp.reduce_op = reduce_op

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """Change ``reshard_after_forward`` to ``True`` or ``False`` from the unit's next
        forward on (e.g. ``False`` for evaluation, ``True`` again for training; FSDP2's
        ``set_reshard_after_forward``). An int ``k`` is only taken by ``fully_shard``
        (it builds the groups of the blocks, a collective): setting a bool on such a
        unit drops the block mode for good.

        Raises:
            TypeError: ``reshard_after_forward`` is not a bool.
        """
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"set_reshard_after_forward: reshard_after_forward={reshard_after_forward!r} must be a "
                            "bool; an int k (keep a block of k shards) is only accepted by fully_shard, which builds "
                            "its groups")
        self.reshard_after_forward = reshard_after_forward
        # A block kept by the last forward still serves its backward (HSDPParam.block).
        self.block_size = None

    # -- hooks ------------------------------------------------------------------------------
    def _wait_unshard(self) -> None:
        for hp in self.params:
            if hp.pending is not None:
                hp.finish_gather()

    def _hook_recomputation(self) -> None:
        """Hook the modules that hold the unit's parameters for the recomputation
        ([Note: recomputation and gathered parameters]); once."""
        if self._recomputation_hooked:
            return
        self._recomputation_hooked = True
        p = get_platform()
        for owner, entries in self._owners.values():
            self._handles.append(p.register_forward_pre_hook(owner, unmatched(functools.partial(self._pre_recompute,
                                                                                                entries))))
            self._handles.append(p.register_forward_hook(owner, unmatched(functools.partial(self._post_recompute,
                                                                                            entries))))

    def _pre_forward(self, module: Any, args: Any) -> Any:
        p = get_platform()
        phase = checkpoint_phase()
        if phase is not None:  # the unit inside a checkpointed region: it will be recomputed
            self._hook_recomputation()
        self._forwards_before = checkpointed_forwards()
        if phase is CheckpointPhase.RECOMPUTE:
            # [Note: a unit inside a checkpointed module]: the parameters come from
            # _pre_recompute; the unit's state stays the first forward's
            return self._cast_inputs(args)
        context = self.context
        if self.is_root:
            context.post_forward_order = []
            context.last_pre_forward_order, context.pre_forward_order = context.pre_forward_order, []
            for state in context.last_pre_forward_order:
                for hp in state.params:
                    hp.reduce_src = None  # made for a unit that did not run
                    if hp.pending_reduce is not None:  # a gradient never collected (a backward
                        hp.finish_reduce()  # cut short): wait, drop, so nothing leaks across steps
                    hp.reduced = None
            for state in context.units:  # [Note: no stale gathered copy]
                if state._hook_copy:
                    state.reshard()
        context.pre_forward_order.append(self)
        self.training_state = TrainingState.FORWARD
        self._unshard(async_op=False)
        for other in self.forward_prefetch:
            other._unshard(async_op=True)
        # [Note: collectives and overlap], point 4: the next unit's WaitReduce nodes now.
        last = context.last_pre_forward_order
        if self in last and last.index(self) + 1 < len(last):
            last[last.index(self) + 1]._make_reduce_srcs()
        self._make_reduce_srcs()
        fulls = []
        for hp in self.params:
            src, hp.reduce_src = hp.reduce_src, None
            full = p.apply_function(GatherParam, src, hp, self)
            fulls.append(full)
            if self.reshard_after_forward:
                hp.drop_unsharded()  # the module reads ``full``, GatherParam's own copy
            for owner, name in hp.uses:
                vars(owner)[name] = hp.presented(full, owner)
        self._grads_pending = len(self.params)
        if self.reshard_after_forward and self.params and phase is None:
            # The tensors the module reads (GatherParam's outputs) are what its operations
            # save; a backend may hand them out as copies of ``hp.unsharded``. Inside a
            # checkpointed forward the checkpoint drops every save already, and hooks
            # pushed here would take its saves from it.
            self._release = p.release_saved_tensors(fulls, self._reload)
            self._release.__enter__()
        return self._cast_inputs(args)

    def _cast_inputs(self, args: Any) -> Any:
        if self._param_dtype is not None and self.mp_policy.cast_forward_inputs:
            return tuple(self._cast(a, self._param_dtype) for a in args)
        return None

    def _make_reduce_srcs(self) -> None:
        p = get_platform()
        for hp in self.params:
            if hp.reduce_src is None:
                hp.reduce_src = p.apply_function(WaitReduce, hp.grad_source(), hp)

    def _post_forward(self, module: Any, args: Any, output: Any) -> Any:
        if checkpoint_phase() is CheckpointPhase.RECOMPUTE:  # [Note: a unit inside a checkpointed module]
            return self._cast_output(output)
        if self._forwards_before is not None and checkpointed_forwards() != self._forwards_before:
            self._hook_recomputation()  # a checkpointed region ran inside the unit's forward
        if self._release is not None:
            self._release.__exit__(None, None, None)
            self._release = None
        self.context.post_forward_order.append(self)
        for hp in self.params:
            full = None
            for owner, name in hp.uses:
                full = vars(owner).pop(name, None)
            if self.block_size is not None and full is not None:
                hp.keep_block(full._local if isinstance(full, DTensor) else full, self.block_size)
        if self.reshard_after_forward:
            self._drop_gathered()  # an int keeps the blocks just taken
        self.training_state = TrainingState.IDLE
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
        if self._output_dtype is not None:
            if isinstance(output, tuple):
                return tuple(self._cast(o, self._output_dtype) for o in output)
            return self._cast(output, self._output_dtype)
        return None

    def _pre_backward(self, module: Any, grad_output: Any) -> None:
        self.training_state = TrainingState.BACKWARD
        self._unshard(async_op=False)
        for other in self._backward_prefetch_targets():
            # Every gradient of ``other`` done: its backward already ran (a mis-ordered
            # explicit prefetch); a gather would only be held until the next step.
            if other._grads_pending > 0:
                other._unshard(async_op=True)
        return None

    def _backward_prefetch_targets(self) -> Sequence[HSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.context.post_forward_order
        if self in order:
            index = order.index(self)
            if index > 0 and order[index - 1].reshard_after_forward:
                return [order[index - 1]]
        return []

    def _pre_recompute(self, entries: list[tuple[HSDPParam, str]], module: Any, args: Any) -> None:
        if checkpoint_phase() is not CheckpointPhase.RECOMPUTE:
            return None
        p = get_platform()
        for hp, name in entries:  # [Note: recomputation and gathered parameters]
            self._gathered(hp)
            full = p.apply_function(GatherParam, hp.grad_source(), hp, self)
            full = hp.presented(full, module)
            vars(module)[name] = full
            self._recomputed[(id(module), name)] = full
        return None

    def _post_recompute(self, entries: list[tuple[HSDPParam, str]], module: Any, args: Any, output: Any) -> None:
        if checkpoint_phase() is CheckpointPhase.RECOMPUTE:
            for _, name in entries:
                self._unsubstitute_one(module, name)
        return None

    def _unsubstitute(self, hp: HSDPParam) -> None:
        for owner, name in hp.uses:
            self._unsubstitute_one(owner, name)

    def _unsubstitute_one(self, owner: Any, name: str) -> None:
        """Remove what ``_pre_recompute`` put in ``owner.<name>`` (and nothing else: a
        forward's own substitution stays, see [Note: recomputation and gathered parameters])."""
        full = self._recomputed.pop((id(owner), name), None)
        if full is not None and vars(owner).get(name) is full:
            del vars(owner)[name]

    def _reload(self, index: int) -> Any:
        return self._gathered(self.params[index])

    def _gathered(self, hp: HSDPParam) -> Any:
        self._group()
        if not hp.is_gathered:
            self._hook_copy = True
            if hp.pending is None:
                hp.start_gather(self._param_dtype or hp.sharded.dtype, self.context.streams()[0])
            hp.finish_gather()
        return hp.full()

    def on_grad(self, hp: HSDPParam, grad: Any) -> Any:
        """What ``GatherParam.backward`` returns for ``hp`` given its full gradient ``grad``
        (called once per backward: autograd sums tied uses first): with gradient sync,
        the reduce-scatter is issued and a zero placeholder returned (``WaitReduce``
        returns the sharded gradient); without, the full gradient is accumulated and the
        sharded gradient is zero."""
        p = get_platform()
        self._group()
        if not self.requires_gradient_sync:
            self.accumulate_grad(hp, grad)
            result = hp.to_home(p.zeros(hp.local_shape(), hp.sharded.dtype))
        else:
            if hp.grad_accum is not None:  # the sum of the backwards without sync, this one's added
                self.accumulate_grad(hp, grad)
                grad, hp.grad_accum = hp.grad_accum, None
            self._start_reduce(hp, grad)
            # A placeholder that WaitReduce replaces with the reduced gradient unread, so unfilled.
            result = hp.to_home(p.zeros(hp.local_shape(), hp.sharded.dtype, fill=False))
        # This parameter's gradient is final: its gathered copies are no longer needed.
        hp.drop_unsharded()
        self._unsubstitute(hp)
        hp.block = None
        self._grads_pending -= 1
        if self._grads_pending <= 0:
            self.training_state = TrainingState.IDLE
        return result

    def accumulate_grad(self, hp: HSDPParam, grad: Any) -> None:
        """Add ``grad``, a full gradient of ``hp`` (``hp.shape``, the gathered parameter's;
        any float dtype, cast to the reduce dtype), to what
        this step accumulates without sync (``HSDPParam.grad_accum``, in the reduce dtype);
        ``reduce_accumulated`` or the next backward with gradient sync reduces it. The
        backwards add theirs here when gradient sync is off, and a zero-bubble ``W`` its
        deferred weight gradients ([Note: one reduction per step] in
        ``core/pipeline_parallel/gradient_sync``). No collective."""
        p = get_platform()
        with p.no_grad():
            g = p.to_dtype(grad, self._reduce_dtype or hp.sharded.dtype)
            hp.grad_accum = g if hp.grad_accum is None else hp.grad_accum + g

    def reduce_accumulated(self) -> list[tuple[HSDPParam, Any]]:
        """Reduce what was accumulated without sync (``accumulate_grad``), as a backward
        with gradient sync would have: the unit's flat **reduce-scatter** (and on HSDP the
        **all-reduce** over the replicate axis), each parameter's sharded gradient
        averaged under ``ReduceOp.AVG``. Returns ``(hp, sharded gradient)`` (the local
        chunk, ``hp.local_shape()``, in the parameter's dtype, home) for each parameter that accumulated one, in
        the unit's order (the same on every rank); the accumulation is cleared."""
        self._group()
        started = []
        for hp in self.params:
            if hp.grad_accum is None:
                continue
            grad, hp.grad_accum = hp.grad_accum, None
            self._start_reduce(hp, grad)
            started.append(hp)
        return [(hp, hp.finish_reduce()) for hp in started]

    def _start_reduce(self, hp: HSDPParam, grad: Any) -> None:
        """Issue ``hp``'s reduce-scatter of the full gradient ``grad`` in the reduce dtype,
        dropping a result never collected (see ``_pre_forward``)."""
        if hp.pending_reduce is not None:
            hp.finish_reduce()
        hp.reduced = None
        hp.start_reduce(grad, self._reduce_dtype or hp.sharded.dtype, self.context.streams()[1])

    def _cast(self, value: Any, dtype: Any) -> Any:
        p = get_platform()
        if p.is_tensor(value) and dtype_name(value.dtype) in ("float16", "bfloat16", "float32", "float64"):
            return p.to_dtype(value, dtype)
        return value


def parse_reduce_op_type(op: str | ReduceOp) -> ReduceOp:
    """``op`` of ``set_reduce_op_type`` as ``ReduceOp.AVG`` (``"avg"``, ``"mean"``) or
    ``ReduceOp.SUM`` (``"sum"``); names are case-insensitive.

    Raises:
        TypeError: ``op`` is not a str or a ReduceOp.
        ValueError: another name or ReduceOp.
    """
    allowed = "'avg' or 'mean' (divide by the data-parallel size, the default) or 'sum' (no division)"
    if isinstance(op, ReduceOp):
        if op in (ReduceOp.AVG, ReduceOp.SUM):
            return op
    elif isinstance(op, str):
        if op.lower() in ("avg", "mean"):
            return ReduceOp.AVG
        if op.lower() == "sum":
            return ReduceOp.SUM
    else:
        raise TypeError(f"set_reduce_op_type: op={op!r} is a {type(op).__name__}; pass a str, {allowed}")
    raise ValueError(f"set_reduce_op_type: op={op!r} is not supported for gradient reduction; use {allowed}")


def units_in(module: Any) -> list[HSDPState]:
    """The fully_shard units of ``module`` and its submodules (``platform.named_modules``
    order, ``module`` first)."""
    return [state for _, sub in get_platform().named_modules(module)
            if isinstance(state := vars(sub).get(STATE_ATTR), HSDPState)]


def _state_of(module: Any, what: str) -> HSDPState:
    state = vars(module).get(STATE_ATTR)
    if not isinstance(state, HSDPState):
        raise ValueError(f"{what}: {type(module).__name__} was not passed to fully_shard; prefetch targets must "
                         "be fully sharded modules")
    return state
