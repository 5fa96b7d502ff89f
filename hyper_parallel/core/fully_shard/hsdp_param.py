"""One parameter under fully_shard: its shard, its gather, its gradient reduction.

Layout (PyTorch FSDP2's ``FSDPParam``, with chunk semantics): a parameter of shape
``[d0, d1, ...]`` placed ``Shard(dim)`` on the shard axis of ``Ns`` ranks is split into
``Ns`` chunks of ``chunk = ceil(d_dim / Ns)`` rows along ``dim``; the last chunks may be
short or empty. The module's registered parameter becomes a framework parameter made from
a DTensor (as FSDP2's are): ``Shard(dim)`` over the mesh (``[Replicate(), Shard(dim)]``
on an HSDP mesh ``(replicate, shard)``), the parameter's global shape, this rank's
**unpadded** chunk as its local tensor. So ``state_dict``, ``clip_grad_norm_`` and the
optimizers see the global tensor and never the padding. The all-gather pads each chunk
to ``chunk`` rows first (every rank then sends the same size), and the reduce-scatter's
padded result is cut back to the chunk. A parameter that tensor parallelism made a
DTensor on a 1-D tp mesh keeps its meaning: fully_shard shards its local piece, and the
parameter becomes a DTensor on the joint ``(tp, *fully_shard mesh)`` mesh with the tp
placement first (the tp chunk, then the dp chunk inside it), the tensor-parallel global
shape. Under ``CPUOffloadPolicy`` the chunk and its gradient live in host memory; each
all-gather starts from a device copy.

The collectives here are one parameter's own. A unit's sharded parameters normally
share its ``ParamGroup`` (``param_group``: one flat all-gather and one flat
reduce-scatter for the whole unit), and their ``start_gather`` ... ``finish_reduce``
hand over to it; a replicated parameter and one gathered into a ``GatherBufferPool``
keep the per-parameter collectives below.

[Note: no empty chunks on MindSpore]
Where a backend's parameters cannot have a zero-size local tensor (its DTensor class says
``empty_parameters = False``: MindSpore, whose optimizers create their state with
``Parameter.clone``, which rejects a zero-size shape), a parameter whose chunks would
leave some rank none (6 rows over 4 ranks: 2, 2, 2, 0) is replicated over the shard axis
instead (a one-time warning names it): ``Replicate()`` there, no all-gather, its gradient
**all-reduced** (sum) over the shard axis and divided like the others (not at all under
the reduce op ``"sum"``). Such a parameter has fewer than ``N x (N - 1)`` rows along its
shard dim, so the memory kept is small. ``fully_shard(replicate_params=...)`` asks for
the same for chosen parameters (MindFormers replicates those whose rows do not divide
evenly).

[Note: a shard axis of one rank]
With one rank on the shard axis (plain fully_shard at world 1, or an HSDP mesh of shape
``(R, 1)``) each rank holds its parameters whole: a gather is a local copy in the compute
dtype (as a replicated parameter's), with no all-gather and no flat buffers, and the
gradient needs no reduce-scatter (only the replicate axis's all-reduce, if any), as FSDP2
issues no collective at world 1. Such parameters join no ``ParamGroup``. The "gathered"
tensor is the shard itself when neither a cast nor an offload copies it: ``GatherParam``
then hands the module a copy (autograd must not take the shard as its output) and the
backward's reload reads the shard (unchanged until the optimizer steps). A divisor of one
(``ReduceOp.AVG`` over one rank) is not applied.
"""

from __future__ import annotations

import warnings
from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, _joint_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor, dtensor_class, make_dtensor, wrap_local
from hyper_parallel.core.dtensor.dtensor_spec import DTensorSpec
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard, chunk_bounds
from hyper_parallel.core.fully_shard.policies import CPUOffloadPolicy
from hyper_parallel.core.tensor_parallel.style import LOCAL_FORWARD
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import CustomFunction, ReduceOp
from hyper_parallel.core.tensor_ops import clone


class HSDPParam:
    """A sharded parameter and the collectives that gather it and reduce its gradient.

    Args:
        fqn: dotted name from the fully_shard root (``"layers.0.weight"``).
        param: the module's framework parameter (same values on every rank of ``mesh``), or
            a tensor-parallel DTensor parameter on a 1-D mesh, whose local piece is then the
            "full" tensor here.
        uses: every ``(module, attribute)`` that reads the parameter (tied weights have several).
        mesh: 1-D ``(shard,)`` or 2-D ``(replicate, shard)`` mesh.
        placement: ``Shard(dim)`` on the shard axis.
        offload: ``CPUOffloadPolicy`` (shard and gradient in host memory) or ``None``.
    """

    def __init__(self, fqn: str, param: Any, uses: list[tuple[Any, str]], mesh: DeviceMesh,
                 placement: Shard, offload: CPUOffloadPolicy | None = None, replicate: bool = False) -> None:
        p = get_platform()
        self.offload: CPUOffloadPolicy | None = offload
        self.fqn: str = fqn
        self.uses: list[tuple[Any, str]] = uses
        self.mesh: DeviceMesh = mesh
        # id of the parameter this one replaced: a module outside the unit that still
        # holds that object shares the weight with the unit (tied across units).
        self.source_id: int = id(param)
        tp = param.spec if isinstance(param, DTensor) else None
        # [Note: a tensor-parallel parameter in a DTensor forward]
        self.tp_spec: DTensorSpec | None = tp
        if tp is not None:
            with p.no_grad():
                param = param.to_local()
        self.shape: tuple[int, ...] = tuple(int(s) for s in param.shape)  # what is sharded here
        self.dim: int = placement.dim % len(self.shape)
        self.placement: Shard = Shard(self.dim)
        self.shard_group: Any = mesh.get_group(mesh.ndim - 1)
        self.shard_size: int = mesh.size(mesh.ndim - 1)
        self.shard_rank: int = mesh.get_local_rank(mesh.ndim - 1)
        self.replicate_group: Any = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_size: int = mesh.size(0) if mesh.ndim == 2 else 1
        # AVG: the reduced gradient is divided by shard_size * replicate_size (the data-
        # parallel size); SUM: it stays the sum over those ranks (set by the unit's
        # ``set_reduce_op_type``).
        self.reduce_op: ReduceOp = ReduceOp.AVG
        # MixedPrecisionPolicy.apply_grad_on_fp32_main_grad (set by the unit)
        self.accumulate_main_grad: bool = False
        self.chunk: int = -(-self.shape[self.dim] // self.shard_size)  # rows per padded shard
        # [Note: no empty chunks on MindSpore]
        self.replicated: bool = (not getattr(dtensor_class(), "empty_parameters", True)
                                 and chunk_bounds(self.shape[self.dim], self.shard_size, self.shard_size - 1)[1] == 0)
        if self.replicated and not replicate:
            warnings.warn(f"fully_shard: {fqn} of shape {self.shape} has {self.shape[self.dim]} rows along dim "
                          f"{self.dim}, so chunks over {self.shard_size} ranks would leave some rank none, which "
                          f"{get_platform().framework} parameters cannot be; it is replicated over the shard axis "
                          "(its gradient all-reduced) instead", RuntimeWarning, stacklevel=3)
        self.replicated = self.replicated or replicate  # fully_shard(replicate_params=...)
        shard_axis = Replicate() if self.replicated else self.placement
        placements = (Replicate(), shard_axis) if mesh.ndim == 2 else (shard_axis,)
        if tp is None:
            self.spec: DTensorSpec = DTensorSpec(mesh, placements, self.shape)
        else:
            self.spec = DTensorSpec(_joint_mesh(tp.mesh, mesh), (*tp.placements, *placements), tp.shape)
        with p.no_grad():
            start, length = chunk_bounds(self.shape[self.dim], self.shard_size, self.shard_rank)
            if self.replicated:
                start, length = 0, self.shape[self.dim]
            local = self.to_home(clone(p.narrow(p.detach(param), self.dim, start, length)))
            # the registered parameter: a DTensor whose local tensor is the unpadded chunk
            self.sharded: Any = p.make_parameter(
                DTensor.from_local(local, self.spec.mesh, self.spec.placements, shape=self.spec.shape),
                requires_grad=True)
        self.unsharded: Any = None  # the gathered full tensor while unsharded, else None
        # a group member's columns of its group's all-gather output, gathered but not yet
        # copied out (ParamGroup.copy_out: GatherParam makes that copy), else None
        self.gathered_columns: Any = None
        self.pending: Any = None  # a Work of an all-gather in flight (prefetch)
        self.grad_accum: Any = None  # the full gradient summed over micro-steps without sync
        # reshard_after_forward=int k: after the forward this rank keeps the k shards of
        # its block of k consecutive shard ranks, [k * chunk, ...] with dim moved first.
        self.block: Any = None
        self.inter_group: Any = None  # ranks holding the same block position (set by the unit)
        self.pool: Any = None  # a GatherBufferPool for the gathers' outputs (weight_parallel), or None
        self.buffer: Any = None  # the pooled buffer behind ``pending`` / ``unsharded``
        self.pending_reduce: Any = None  # a Work of this parameter's reduce-scatter in flight
        self.reduced: Any = None  # its result, when waited for before WaitReduce ran (see unshard)
        self.reduce_src: Any = None  # WaitReduce's output for this step's GatherParam (see hsdp_state)
        # The tp group of a SequenceParallel module's parameter (set by fully_shard): its
        # full gradient is a partial sum over the sequence shards, all-reduced there first.
        self.sequence_parallel_group: Any = None
        # The unit's ParamGroup whose flat collectives serve this parameter (set by the
        # unit at its first gather), or None: its own per-parameter collectives (a
        # replicated or pooled parameter; see ``param_group``).
        self.group: Any = None

    # -- views ---------------------------------------------------------------------------
    def presented(self, full: Any, owner: Any) -> Any:
        """What ``owner``'s forward reads for this parameter, given the gathered tensor.

        [Note: a tensor-parallel parameter in a DTensor forward]
        This package's own tensor-parallel styles run the module's forward on local
        tensors (they mark the module ``LOCAL_FORWARD``), so they get the gathered tp
        piece itself. A module whose forward computes on DTensors (torch's styles,
        MindFormers' ``distribute_module``: their hooks hand DTensor activations in) gets
        it as a DTensor on the tensor-parallel mesh with the tp placements (a
        differentiable ``from_local``, as FSDP2's unsharded parameter is): its gradient
        comes back laid out as the parameter (a Partial one of a sequence-parallel norm
        all-reduced over tp) and reaches the gather's backward as a local tensor."""
        if self.tp_spec is None or getattr(owner, LOCAL_FORWARD, False):
            return full
        return wrap_local(full, self.tp_spec)

    def to_home(self, tensor: Any) -> Any:
        """``tensor`` where the shard lives: host memory under ``CPUOffloadPolicy``
        (a copy through ``platform.to_device``), else ``tensor`` itself."""
        if self.offload is None:
            return tensor
        return get_platform().to_device(tensor, "cpu", pin_memory=self.offload.pin_memory)

    def local_length(self) -> int:
        """Rows of this rank's unpadded chunk along ``dim`` (all of them when replicated)."""
        if self.replicated:
            return self.shape[self.dim]
        return chunk_bounds(self.shape[self.dim], self.shard_size, self.shard_rank)[1]

    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's chunk (``shape`` with ``dim`` cut to ``local_length``)."""
        return tuple(self.local_length() if d == self.dim else n for d, n in enumerate(self.shape))

    @property
    def whole_here(self) -> bool:
        """Whether this rank holds the whole tensor, so a gather is a local copy: a
        replicated parameter, or a shard axis of one rank (world 1 of plain fully_shard:
        [Note: a shard axis of one rank])."""
        return self.replicated or self.shard_size == 1

    def local_tensor(self) -> Any:
        """This rank's chunk: the registered DTensor parameter's local tensor (its
        current values; not differentiable)."""
        return self.sharded._local

    def grad_source(self) -> Any:
        """The registered parameter's local tensor as a differentiable read: what the
        gather's autograd functions take, so the chunk's gradient becomes the DTensor
        parameter's gradient (with its placements)."""
        return self.sharded.to_local()

    def to_dtensor(self) -> DTensor:
        """The registered parameter: a DTensor of ``spec`` (see the module docstring)."""
        return self.sharded

    # -- collectives ---------------------------------------------------------------------
    def keep_block(self, full: Any, k: int) -> None:
        """After the forward with ``reshard_after_forward=k``: keep this rank's block of
        ``k`` shards, sliced from the gathered ``full`` (no communication)."""
        if self.whole_here:
            return  # each gather is a local copy: nothing to keep
        p = get_platform()
        with p.no_grad():
            front = p.detach(full).transpose(0, self.dim) if self.dim else p.detach(full)
            front = p.pad(front, 0, 0, self.chunk * self.shard_size - self.shape[self.dim])
            block = self.shard_rank // k
            self.block = clone(p.narrow(front, 0, block * k * self.chunk, k * self.chunk).contiguous())

    def start_gather(self, dtype: Any, stream: Any) -> None:
        """Issue the **all-gather** of the padded shards over the shard axis (async) on
        the all-gather ``stream``, cast to ``dtype`` first so the collective moves the
        compute dtype (into a pooled buffer when ``pool`` is set). After a forward with
        ``reshard_after_forward=k`` the kept blocks are all-gathered over the
        ``shard_size / k`` ranks of the same block position instead. A member of a
        ``ParamGroup`` issues the group's one flat all-gather instead."""
        if self.group is not None:
            self.group.start_gather(dtype, stream)
            return
        p = get_platform()
        with p.no_grad():
            if self.whole_here:
                # No copy: the shard itself, or the copy the move to the device or the
                # cast makes (GatherParam copies what the module reads: [Note: a shard axis
                # of one rank]).
                local = p.detach(self.local_tensor())
                if self.offload is not None:
                    local = p.to_device(local, p.device_type)
                self.pending = _Ready(p.to_dtype(local, dtype))
                return
            if self.block is not None:
                front, group, out, free = self.block, self.inter_group, None, None
            else:
                shard = p.detach(self.local_tensor())
                if self.offload is not None:  # copy first: the cast then runs on the device
                    shard = p.to_device(shard, p.device_type)
                # every rank sends ``chunk`` rows: the short or empty last chunks are padded
                shard = p.pad(p.to_dtype(shard, dtype), self.dim, 0, self.chunk - self.local_length())
                front = shard.transpose(0, self.dim).contiguous() if self.dim else shard  # gloo: contiguous buffers
                group, out, free = self.shard_group, None, None
                if self.pool is not None:
                    out, free = self.pool.acquire((self.chunk * self.shard_size, *front.shape[1:]), front.dtype)
                    self.buffer = out
            # [Note: collectives and overlap] (hsdp_state): the all-gather stream waits for
            # the input made on the current stream and for the last readers of a reused buffer.
            ready = p.record_event()
            with p.stream(stream):
                p.wait_event(ready)
                if free is not None:
                    p.wait_event(free)
                self.pending = p.all_gather_into_tensor(front, group=group, async_op=True, out=out)

    def finish_gather(self) -> None:
        """Wait for the all-gather (on accelerators: the current stream waits for the
        collective); drop the padding; set ``self.unsharded`` (a group's member: the
        group's wait, which leaves every member's columns for ``full``)."""
        if self.group is not None:
            self.group.finish_gather()
            return
        p = get_platform()
        with p.no_grad():
            gathered = self.pending.wait()  # [Ns * chunk, ...] with dim moved to the front
            self.pending = None
            if self.whole_here:
                self.unsharded = gathered
                return
            full = p.narrow(gathered, 0, 0, self.shape[self.dim])
            if self.dim:
                full = full.transpose(0, self.dim)
            self.unsharded = full.contiguous()

    @property
    def is_gathered(self) -> bool:
        """Gathered, and the all-gather waited for (copied out or not)."""
        return self.unsharded is not None or self.gathered_columns is not None

    def full(self, no_grad: bool = True) -> Any:
        """The gathered tensor, ``unsharded``, copied out of the group's all-gather output
        first if it has not been (``ParamGroup.copy_out``, under ``no_grad``); ``None``
        when not gathered."""
        if self.unsharded is None and self.gathered_columns is not None:
            self.unsharded = self.group.copy_out(self, no_grad)
        return self.unsharded

    def drop_unsharded(self) -> None:
        """Forget the gathered tensor; a pooled buffer goes back to the pool (see
        [Note: when a pooled buffer may be overwritten] in ``buffer_pool``)."""
        self.unsharded = None
        if self.gathered_columns is not None:
            self.group.forget(self)
        if self.buffer is not None and self.pending is None:
            self.pool.release(self.buffer)
            self.buffer = None

    def start_reduce(self, grad: Any, reduce_dtype: Any, stream: Any) -> None:
        """Issue the **reduce-scatter** (sum) of the full gradient ``grad`` over the shard
        axis, asynchronously on the reduce-scatter ``stream``; ``finish_reduce`` waits.
        A ``SequenceParallel`` parameter's gradient is first **all-reduced** (sum) over
        its tp group (each tp rank saw part of the sequence). A member of a
        ``ParamGroup`` writes its gradient into the group's flat reduce-scatter instead."""
        if self.group is not None:
            self.group.start_reduce(self, grad, reduce_dtype, stream)
            return
        p = get_platform()
        with p.no_grad():
            g = p.to_dtype(grad, reduce_dtype)
            if self.sequence_parallel_group is not None:
                g = p.all_reduce(g, group=self.sequence_parallel_group).wait()
            if self.shard_size == 1:  # [Note: a shard axis of one rank]: nothing to reduce over it
                self.pending_reduce = _Ready(g.contiguous())
                return
            if self.replicated:  # [Note: no empty chunks on MindSpore]
                ready = p.record_event()
                with p.stream(stream):
                    p.wait_event(ready)
                    self.pending_reduce = p.all_reduce(g.contiguous(), group=self.shard_group, async_op=True)
                return
            if self.dim:
                g = g.transpose(0, self.dim)
            g = p.pad(g, 0, 0, self.chunk * self.shard_size - self.shape[self.dim]).contiguous()
            ready = p.record_event()  # the gradient was computed on the current stream
            with p.stream(stream):
                p.wait_event(ready)
                self.pending_reduce = p.reduce_scatter_tensor(g, group=self.shard_group, async_op=True)

    def finish_reduce(self) -> Any:
        """The gradient of this rank's chunk: wait for the reduce-scatter, **all-reduce**
        (sum) over the replicate axis (HSDP), divide by the data-parallel size
        ``shard_size * replicate_size`` when ``reduce_op`` is ``AVG`` (each rank's loss
        is a mean over its own batch; ``SUM`` leaves the sum), cut the padding, cast to
        the parameter's dtype and home (a group's member: its columns of the group's
        flat result, see ``param_group``)."""
        p = get_platform()
        if self.group is not None:
            return self._home_grad(self.group.finish_reduce(self))
        with p.no_grad():
            g = self.pending_reduce.wait()
            self.pending_reduce = None
            if self.replicate_group is not None:
                g = p.all_reduce(g, group=self.replicate_group).wait()
            if self.reduce_op is ReduceOp.AVG and self.shard_size * self.replicate_size > 1:
                g = g * (1.0 / (self.shard_size * self.replicate_size))
            if not self.whole_here:
                g = p.narrow(g, 0, 0, self.local_length())  # the padding rows' sums are dropped
                if self.dim:
                    g = g.transpose(0, self.dim)
        return self._home_grad(g)

    def _home_grad(self, g: Any) -> Any:
        """The reduced chunk ``g`` as the sharded gradient: the parameter's dtype, home
        (and added onto ``main_grad`` in float32 under ``apply_grad_on_fp32_main_grad``)."""
        p = get_platform()
        with p.no_grad():
            if self.accumulate_main_grad:
                self._add_main_grad(self.to_home(p.to_dtype(g.contiguous(), p.dtype("float32"))))
            return self.to_home(p.to_dtype(g.contiguous(), self.sharded.dtype))

    def _add_main_grad(self, local: Any) -> None:
        """``sharded.main_grad += local`` (float32, this rank's piece), made on first use
        (a new DTensor each time: the caller may hold the previous one)."""
        current = getattr(self.sharded, "main_grad", None)
        if current is not None:
            local = current.to_local() + local
        self.sharded.main_grad = make_dtensor(local, self.spec)


class _Ready:
    """A finished ``Work``: the "gather" of a parameter this rank holds whole (see
    [Note: no empty chunks on MindSpore], [Note: a shard axis of one rank]), or the
    "reduce-scatter" over a shard axis of one rank."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result


class WaitReduce(CustomFunction):
    """``src = WaitReduce(sharded, hsdp_param)``: the sharded parameter as ``GatherParam``'s
    input (``sharded`` itself; its values are not read).
    Backward: waits for the parameter's reduce-scatter that ``GatherParam.backward``
    issued and returns the sharded gradient; when none is in flight (gradient sync
    off) the incoming gradient passes through. Where this node is created decides
    when autograd runs it: see [Note: collectives and overlap] (hsdp_state)."""

    @staticmethod
    def forward(ctx: Any, sharded: Any, hsdp_param: HSDPParam) -> Any:
        ctx.hsdp_param = hsdp_param
        # No copy: GatherParam never reads its input's values. torch hands out an input
        # returned as is as a view of it; MindSpore copies it.
        return sharded

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        hp = ctx.hsdp_param
        if hp.pending_reduce is not None:
            hp.reduced = hp.finish_reduce()
        if hp.reduced is None:
            return grad, None
        result, hp.reduced = hp.reduced, None
        return result, None


class GatherParam(CustomFunction):
    """``full = GatherParam(sharded, hsdp_param, state)``: hands the module the gathered
    parameter (all-gathered beforehand by the unit's unshard; a group member's copied out
    of the all-gather output here, its one copy: [Note: flat all-gather copy-in] in
    ``param_group``) while recording the sharded parameter (through ``WaitReduce``) as
    its source. Backward: the full gradient
    goes to ``state.on_grad``, which issues its reduce-scatter (collected by
    ``WaitReduce``) or accumulates it when gradient sync is off. Nothing is saved here
    (SimpleFSDP, arXiv 2411.00284)."""

    @staticmethod
    def forward(ctx: Any, sharded: Any, hsdp_param: HSDPParam, state: Any) -> Any:
        ctx.hsdp_param = hsdp_param
        ctx.state = state
        if hsdp_param.unsharded is None and hsdp_param.gathered_columns is not None:
            # [Note: flat all-gather copy-in] (param_group): the copy out of the group's
            # all-gather output, made here, is the tensor the module reads (FSDP2's one
            # copy); made by this function's own operation, not under no_grad, as the clone
            # below is ([Note: gathered parameters and autograd] in hsdp_state)
            return hsdp_param.full(no_grad=False)
        if not state.reshard_after_forward and hsdp_param.unsharded is not hsdp_param.local_tensor():
            return hsdp_param.unsharded  # a gathered copy of its own (the shard itself is copied below)
        # [Note: gathered parameters and autograd] (hsdp_state): the output must be a
        # tensor made here. MindSpore saves a copy of a custom function's output that
        # is an outside tensor, and a copy is not matched to its source; the unit drops
        # ``unsharded`` right after, so only one full copy lives.
        return clone(hsdp_param.unsharded)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return ctx.state.on_grad(ctx.hsdp_param, grad), None, None
