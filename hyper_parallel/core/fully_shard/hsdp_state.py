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
All-gathers are issued with ``async_op=True`` by ``unshard(async_op=True)`` (explicit
forward prefetch, implicit or explicit backward prefetch) and waited for at the first
use (``_wait_unshard``, ``_reload``): on NCCL/HCCL ``Work.wait()`` makes the current
stream wait for the collective's stream, so the gather of the next unit overlaps this
unit's compute; on gloo the host thread overlaps. The reduce-scatter is waited for at
once because autograd takes the sharded gradient as ``GatherParam.backward``'s output;
on accelerators that wait is again a stream dependency, not a host block.

[Note: parameter substitution]
During the forward a module reads ``module.<name>``; the sharded parameter stays
registered (the optimizer and ``named_parameters`` see shards) and the gathered tensor
is put in the instance ``__dict__``, which both torch ``Module`` and MindSpore ``Cell``
consult before their registered parameters; it is removed after the forward.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import _axis_lines
from hyper_parallel.core.fully_shard.hsdp_param import GatherParam, HSDPParam
from hyper_parallel.core.fully_shard.policies import MixedPrecisionPolicy
from hyper_parallel.platform import get_platform


#: The attribute of a fully sharded module that holds its ``HSDPState``.
STATE_ATTR = "_hsdp_state"


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
        self.post_forward_order: list[HSDPState] = []


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
            inter = p.split_group([line[i::k] for line in lines for i in range(k)])
            for hp in params:
                hp.inter_group = inter
        self.mp_policy: MixedPrecisionPolicy = mp_policy
        self.is_root: bool = True  # False once an enclosing fully_shard adopts this unit
        self.context: HSDPContext = HSDPContext()
        self.training_state: TrainingState = TrainingState.IDLE
        self.requires_gradient_sync: bool = True
        self.forward_prefetch: list[HSDPState] = []
        self.backward_prefetch: list[HSDPState] | None = None  # None: the next unit the backward reaches
        self._release: Any = None  # the entered release_saved_tensors context during forward
        self._grads_pending: int = 0
        self._param_dtype: Any = None if mp_policy.param_dtype is None else p.dtype(mp_policy.param_dtype)
        reduce = mp_policy.reduce_dtype or mp_policy.param_dtype
        self._reduce_dtype: Any = None if reduce is None else p.dtype(reduce)
        self._output_dtype: Any = None if mp_policy.output_dtype is None else p.dtype(mp_policy.output_dtype)
        self._handles: list[Any] = [
            p.register_forward_pre_hook(module, self._pre_forward),
            p.register_forward_hook(module, self._post_forward),
            p.register_full_backward_pre_hook(module, self._pre_backward),
        ]

    # -- public -----------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """All-gather every managed parameter (no-op for those already gathered or in
        flight). With ``async_op`` the collectives are only issued (prefetch); the next
        use waits for them."""
        for hp in self.params:
            if hp.unsharded is None and hp.pending is None:
                hp.start_gather(self._param_dtype or hp.sharded.dtype)
        if not async_op:
            self._wait_unshard()

    def reshard(self) -> None:
        """Drop the gathered parameters and kept blocks (their memory is released once
        autograd holds none; see [Note: gathered parameters and autograd])."""
        self._drop_gathered()
        for hp in self.params:
            hp.block = None

    def _drop_gathered(self) -> None:
        for hp in self.params:
            if hp.pending is not None:
                hp.finish_gather()
            hp.unsharded = None

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

    # -- hooks ------------------------------------------------------------------------------
    def _wait_unshard(self) -> None:
        for hp in self.params:
            if hp.pending is not None:
                hp.finish_gather()

    def _pre_forward(self, module: Any, args: Any) -> Any:
        p = get_platform()
        if self.is_root:
            self.context.post_forward_order = []
        self.training_state = TrainingState.FORWARD
        self.unshard()
        for other in self.forward_prefetch:
            other.unshard(async_op=True)
        fulls = []
        for hp in self.params:
            full = p.apply_function(GatherParam, hp.sharded, hp, self)
            fulls.append(full)
            if self.reshard_after_forward:
                hp.unsharded = None  # the module reads ``full``, a copy (see GatherParam)
            for owner, name in hp.uses:
                vars(owner)[name] = full
        self._grads_pending = len(self.params)
        if self.reshard_after_forward and self.params:
            # The tensors the module reads (GatherParam's outputs) are what its operations
            # save; a backend may hand them out as copies of ``hp.unsharded``.
            self._release = p.release_saved_tensors(fulls, self._reload)
            self._release.__enter__()
        if self._param_dtype is not None and self.mp_policy.cast_forward_inputs:
            return tuple(self._cast(a, self._param_dtype) for a in args)
        return None

    def _post_forward(self, module: Any, args: Any, output: Any) -> Any:
        if self._release is not None:
            self._release.__exit__(None, None, None)
            self._release = None
        self.context.post_forward_order.append(self)
        for hp in self.params:
            full = None
            for owner, name in hp.uses:
                full = vars(owner).pop(name, None)
            if self.block_size is not None and full is not None:
                hp.keep_block(full, self.block_size)
        if self.reshard_after_forward:
            self._drop_gathered()  # an int keeps the blocks just taken
        self.training_state = TrainingState.IDLE
        if self._output_dtype is not None:
            if isinstance(output, tuple):
                return tuple(self._cast(o, self._output_dtype) for o in output)
            return self._cast(output, self._output_dtype)
        return None

    def _pre_backward(self, module: Any, grad_output: Any) -> None:
        self.training_state = TrainingState.BACKWARD
        self.unshard()
        for other in self._backward_prefetch_targets():
            other.unshard(async_op=True)
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

    def _reload(self, index: int) -> Any:
        hp = self.params[index]
        if hp.unsharded is None:
            if hp.pending is None:
                hp.start_gather(self._param_dtype or hp.sharded.dtype)
            hp.finish_gather()
        return hp.unsharded

    def on_grad(self, hp: HSDPParam, grad: Any) -> Any:
        """The sharded gradient of ``hp`` from its full gradient ``grad`` (called from
        ``GatherParam.backward``, once per backward: autograd sums tied uses first)."""
        p = get_platform()
        reduce_dtype = self._reduce_dtype or hp.sharded.dtype
        if not self.requires_gradient_sync:
            with p.no_grad():
                g = p.to_dtype(grad, reduce_dtype)
                hp.grad_accum = g if hp.grad_accum is None else hp.grad_accum + g
            result = hp.to_home(p.zeros(tuple(hp.sharded.shape), hp.sharded.dtype))
        else:
            if hp.grad_accum is not None:
                with p.no_grad():
                    grad = p.to_dtype(grad, reduce_dtype) + hp.grad_accum
                hp.grad_accum = None
            result = hp.reduce_grad(grad, reduce_dtype)
        # This parameter's gradient is final: its gathered copies are no longer needed.
        hp.unsharded = None
        hp.block = None
        self._grads_pending -= 1
        if self._grads_pending <= 0:
            self.training_state = TrainingState.IDLE
        return result

    def _cast(self, value: Any, dtype: Any) -> Any:
        p = get_platform()
        if p.is_tensor(value) and p.dtype_name(value.dtype) in ("float16", "bfloat16", "float32", "float64"):
            return p.to_dtype(value, dtype)
        return value


def _state_of(module: Any, what: str) -> HSDPState:
    state = vars(module).get(STATE_ATTR)
    if not isinstance(state, HSDPState):
        raise ValueError(f"{what}: {type(module).__name__} was not passed to fully_shard; prefetch targets must "
                         "be fully sharded modules")
    return state
