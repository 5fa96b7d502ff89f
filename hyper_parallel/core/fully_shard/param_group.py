"""The flat collectives of one fully_shard unit: one all-gather and one reduce-scatter
for all its sharded parameters (PyTorch FSDP2's ``foreach_all_gather`` /
``foreach_reduce``).

Layout: the unit's parameters (those of one dtype; a unit whose parameters have
several dtypes has one group per dtype) are laid side by side in columns. Parameter
``i`` takes ``numel_i = chunk_i * prod(shape_i without dim_i)`` columns from offset
``off_i`` (its padded chunk with ``dim`` moved first, flattened), ``total`` columns in
all. A flat buffer is 2-D, one row per shard rank:

- all-gather input ``[1, total]``: this rank's chunks (``[k, total]`` in the block mode
  of ``reshard_after_forward=k``: the k chunks of the kept block);
- all-gather output ``[Ns, total]``: row ``r`` holds rank ``r``'s chunks, so
  ``out[:, off_i:off_i + numel_i]`` reshaped to ``[Ns * chunk_i, ...]`` is parameter
  ``i`` with ``dim`` first, padded;
- reduce-scatter input ``[Ns, total]`` laid out as the all-gather output, from the full
  gradients; its output ``[1, total]`` holds this rank's gradient chunks.

Padding (a short or empty last chunk) lives only in these buffers: it is never part of
a parameter, a gradient or a state dict.

[Note: flat all-gather copy-in]
Each all-gather copies every parameter's shard into the input buffer with one
``__setitem__`` per parameter: ``inp[:, off:off + n] = shard``. The write casts (the
framework's copy kernel converts dtypes), so ``MixedPrecisionPolicy.param_dtype`` costs
no separate cast and no padded copy is made: the padding columns of a short chunk are
not written (what they hold, zeros or an earlier use's values of a pooled buffer, only
reaches padding rows of the output, which are dropped). The input buffer goes back to
the tree's pool (``HSDPContext.flat_buffers``) once the all-gather is waited for; the
output is held, each parameter's columns in its ``gathered_columns``, until each is
copied out (one copy of each column block: rows of different ranks are ``total`` apart,
so no parameter is a contiguous view of it; FSDP2 copies out likewise; each rank's
chunk is put back in the parameter's layout and cut to its unpadded rows on a view, so
the ``cat`` of the chunks is the only copy, on any dim) and then goes back too: buffers of one
shape serve every unit of that size and every step. The copy-out is made where the
parameter is read (``HSDPParam.full``): in ``GatherParam``'s forward, whose output it
is (MindSpore needs a custom function's output made inside it: [Note: gathered
parameters and autograd] in ``hsdp_state``), or by a backward's reload. So the module
reads the one copy FSDP2 also makes, not a copy of a copy, and a gathered parameter the
backward does not read is not copied out at all; what is never copied out is forgotten
when the unit reshards. Orderings on accelerators ([Note: collectives and overlap] in
``hsdp_state``): the copy-in runs on the current stream after the buffer's last
readers (the pool's event); the all-gather stream waits for an event recorded after the
copy-in; ``Work.wait()`` makes the current stream wait for the collective before the
copy-outs, and the output is released (an event on the current stream) after the last.

[Note: flat reduce-scatter]
Each full gradient is written into the reduce-scatter input when ``GatherParam``'s
backward hands it over (cast to the reduce dtype by the write; a ``SequenceParallel``
parameter's all-reduce over tp first), so the full gradient can be freed at once. The
reduce-scatter is issued when the last parameter of the group has written its
gradient. A ``WaitReduce`` that needs a result before then (a parameter that got no
gradient this backward) issues it with zeros for the missing ones; a gradient that
arrives after that starts a new round (one more reduce-scatter, the same on every
rank). On HSDP the reduced ``[1, total]`` is all-reduced once over the replicate axis,
then divided once; each parameter's gradient is a view of its columns, cut to its
unpadded chunk.

What stays per parameter (``HSDPParam``'s own collectives): a replicated parameter
(``replicate_params``, [Note: no empty chunks on MindSpore]) has no all-gather and its
gradient is all-reduced over the shard axis; a parameter gathered into a
``GatherBufferPool`` (``weight_parallel(buffer_pool=True)``) keeps its per-parameter
gather, whose pooled buffer is the gathered parameter itself (no copy-out).
"""

from __future__ import annotations

import math
from typing import Any

from hyper_parallel.core.fully_shard.buffer_pool import GatherBufferPool
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import ReduceOp


class _FlatGather:
    """A flat all-gather in flight: its ``Work``, its buffers and the parameters that
    take their gathered tensors from it."""

    def __init__(self, work: Any, inp: Any, out: Any, members: list[Any]) -> None:
        self.work: Any = work
        self.inp: Any = inp  # [rows, total]
        self.out: Any = out  # [Ns, total]
        self.members: list[Any] = members  # HSDPParams whose ``pending`` is this


class _FlatReduce:
    """One round of a group's flat reduce-scatter (see [Note: flat reduce-scatter])."""

    def __init__(self, buffer: Any, dtype: Any) -> None:
        self.buffer: Any = buffer  # [Ns, total] in the reduce dtype; None once the collective is waited for
        self.dtype: Any = dtype
        self.arrived: set[int] = set()  # indexes (into the group) of the gradients written
        self.work: Any = None  # the reduce-scatter's Work once issued
        self.result: Any = None  # [1, total]: reduced, all-reduced over replicas, divided
        self.collected: int = 0  # members that took their gradient; at len(arrived) the round is dropped


class ParamGroup:
    """The sharded parameters of one unit (of one dtype) and their flat collectives.

    Each member's ``start_gather`` / ``finish_gather`` / ``start_reduce`` /
    ``finish_reduce`` lands here (``HSDPParam.group``): the first member asked issues
    the collective for the group, the others find theirs in flight.

    Args:
        params: the members, all sharded (not replicated) over the same shard axis.
        unit: their ``HSDPState``; its ``context`` (replaced when an enclosing
            fully_shard adopts the unit, so read at each use) holds the pool
            ``flat_buffers`` and the streams.
    """

    def __init__(self, params: list[Any], unit: Any) -> None:
        self.params: list[Any] = params
        self.unit: Any = unit  # the HSDPState: its context holds the pool and the streams
        first = params[0]
        self.shard_size: int = first.shard_size
        self.numels: list[int] = [hp.chunk * math.prod(hp.shape) // hp.shape[hp.dim] for hp in params]
        self.offsets: list[int] = [sum(self.numels[:i]) for i in range(len(params))]
        self.total: int = sum(self.numels)
        self.gather: _FlatGather | None = None  # the all-gather in flight
        # the all-gather outputs whose members' copy-outs are still to come (GatherParam
        # makes them: [Note: flat all-gather copy-in]), each with those members
        self.held: list[tuple[Any, list[Any]]] = []
        self.reduce: _FlatReduce | None = None  # the round gradients are written into now
        for hp in params:
            hp.group = self

    def _pool(self) -> GatherBufferPool:
        return self.unit.context.flat_buffers

    def _front_shape(self, hp: Any, rows: int) -> tuple[int, ...]:
        """The shape of ``_front`` of ``hp`` (``transpose(0, dim)``: dims 0 and ``dim``
        swapped) with ``rows`` rows first."""
        shape = list(hp.shape)
        if hp.dim:
            shape[hp.dim] = shape[0]
        shape[0] = rows
        return tuple(shape)

    @staticmethod
    def _front(p: Any, tensor: Any, dim: int) -> Any:
        return tensor.transpose(0, dim) if dim else tensor

    # -- all-gather --------------------------------------------------------------------
    def start_gather(self, dtype: Any, stream: Any) -> None:
        """Issue the group's **all-gather** (async, on the all-gather ``stream``) for every
        member not gathered and not in flight; see [Note: flat all-gather copy-in]. With
        every member holding its kept block (``reshard_after_forward=k``) the blocks are
        gathered over the ranks of the same block position instead."""
        p = get_platform()
        if self.gather is not None:  # a member dropped since: finish that one first
            self.finish_gather()
        members = [hp for hp in self.params if not hp.is_gathered and hp.pending is None]
        if not members:
            return
        pool = self._pool()
        blocks = all(hp.block is not None for hp in self.params)
        rows = self.params[0].block.shape[0] // self.params[0].chunk if blocks else 1
        group = self.params[0].inter_group if blocks else self.params[0].shard_group
        with p.no_grad():
            inp, free_in = pool.acquire((rows, self.total), dtype)
            if free_in is not None:
                p.wait_event(free_in)  # the buffer's last all-gather read it
            for hp, off, n in zip(self.params, self.offsets, self.numels):
                if blocks:
                    inp[:, off:off + n] = hp.block.reshape(rows, n)
                    continue
                shard = p.detach(hp.local_tensor())
                if hp.offload is not None:
                    shard = p.to_device(shard, p.device_type)
                length = hp.local_length()
                if length:  # the write casts to ``dtype``; padding columns stay zero
                    inp[:, off:off + length * (n // hp.chunk)] = self._front(p, shard, hp.dim).reshape(1, -1)
            out, free_out = pool.acquire((self.shard_size, self.total), dtype)
            ready = p.record_event()  # [Note: collectives and overlap] (hsdp_state)
            with p.stream(stream):
                p.wait_event(ready)
                if free_out is not None:
                    p.wait_event(free_out)
                work = p.all_gather_into_tensor(inp, group=group, async_op=True, out=out)
        self.gather = _FlatGather(work, inp, out, members)
        for hp in members:
            hp.pending = self.gather

    def finish_gather(self) -> None:
        """Wait for the all-gather in flight; give the input buffer back to the pool and
        hold the output, each member's columns in its ``gathered_columns`` until
        ``copy_out`` (GatherParam's forward, or a reader of ``HSDPParam.full``) copies
        them out."""
        p = get_platform()
        flat, self.gather = self.gather, None
        if flat is None:
            return
        with p.no_grad():
            out = flat.work.wait()  # [Ns, total]
        self._pool().release(flat.inp)
        self.held.append((out, list(flat.members)))
        for hp in flat.members:
            i = self.params.index(hp)
            off, n = self.offsets[i], self.numels[i]
            hp.gathered_columns = out[:, off:off + n]
            hp.pending = None

    def copy_out(self, hp: Any, no_grad: bool = True) -> Any:
        """``hp`` gathered, ``hp.shape`` and contiguous, copied out of the held all-gather
        output (padding dropped, ``dim`` back in place): the one copy a gathered
        parameter costs; under ``no_grad`` unless the caller is a custom function's
        forward, whose output it is. The output goes back to the pool after its last
        member's."""
        p = get_platform()
        if no_grad:
            with p.no_grad():
                full = self._copy_out(hp, hp.gathered_columns)
        else:
            full = self._copy_out(hp, hp.gathered_columns)
        self.forget(hp)
        return full

    def forget(self, hp: Any) -> None:
        """``hp``'s columns are not needed any more (copied out, or its gathered copy
        dropped); the held output goes back to the pool after the last member's."""
        hp.gathered_columns = None
        for index, (out, members) in enumerate(self.held):
            if hp in members:
                members.remove(hp)
                if not members:
                    self._pool().release(out)
                    del self.held[index]
                return

    def _copy_out(self, hp: Any, columns: Any) -> Any:
        """``hp`` gathered, ``hp.shape`` and contiguous, from its columns ``[Ns, numel]``
        of the all-gather output: one copy, a ``cat`` along ``dim`` of the ranks' chunks,
        their padding left out. Row ``r`` holds rank ``r``'s chunk laid out as
        ``_front``; on a view it is put back in ``hp``'s layout (``reshape`` of the row,
        ``transpose(0, dim)``, the padding cut) before the copy. The result is the ``cat``'s own tensor,
        not a view of it: ``GatherParam`` returns it, and MindSpore hands out a copy of a
        custom function's output that is a view, which the saved-tensor release cannot
        match ([Note: gathered parameters and autograd] in ``hsdp_state``)."""
        p = get_platform()
        front, pieces = self._front_shape(hp, hp.chunk), []
        for r in range(self.shard_size):
            rows = min(hp.chunk, hp.shape[hp.dim] - r * hp.chunk)  # a short or empty last chunk's padding: left out
            if rows > 0:
                pieces.append(p.narrow(self._front(p, columns[r].reshape(front), hp.dim), hp.dim, 0, rows))
        return p.cat(pieces, hp.dim)

    # -- reduce-scatter ----------------------------------------------------------------
    def start_reduce(self, hp: Any, grad: Any, reduce_dtype: Any, stream: Any) -> None:
        """Write ``hp``'s full gradient into this round's reduce-scatter input; issue the
        **reduce-scatter** (sum, async, on ``stream``) once every member's is written
        (see [Note: flat reduce-scatter])."""
        p = get_platform()
        i = self.params.index(hp)
        if self.reduce is None or self.reduce.work is not None or i in self.reduce.arrived:
            buffer, free = self._pool().acquire((self.shard_size, self.total), reduce_dtype)
            if free is not None:
                p.wait_event(free)
            self.reduce = _FlatReduce(buffer, reduce_dtype)
        flat = self.reduce
        with p.no_grad():
            g = grad
            if hp.sequence_parallel_group is not None:
                g = p.all_reduce(p.to_dtype(g, reduce_dtype), group=hp.sequence_parallel_group).wait()
            g = self._front(p, g, hp.dim)
            padding = hp.chunk * self.shard_size - hp.shape[hp.dim]
            if padding:  # otherwise the reshape below is a view and the write the one copy
                g = p.pad(g, 0, 0, padding)
            off, n = self.offsets[i], self.numels[i]
            flat.buffer[:, off:off + n] = g.reshape(self.shard_size, n)  # the write casts
        flat.arrived.add(i)
        hp.pending_reduce = flat
        if len(flat.arrived) == len(self.params):
            self._issue_reduce(flat, stream)

    def _issue_reduce(self, flat: _FlatReduce, stream: Any) -> None:
        p = get_platform()
        with p.no_grad():
            for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
                if i not in flat.arrived:  # no gradient this round: its columns reduce zeros
                    flat.buffer[:, off:off + n] = p.zeros((self.shard_size, n), flat.dtype)
            ready = p.record_event()  # the gradients were written on the current stream
            with p.stream(stream):
                p.wait_event(ready)
                flat.work = p.reduce_scatter_tensor(flat.buffer, group=self.params[0].shard_group, async_op=True)

    def finish_reduce(self, hp: Any) -> Any:
        """``hp``'s reduced gradient chunk in the reduce dtype (``[local_length, ...]``
        with ``dim`` in place, a view of the round's result): issue the round if it is
        not yet (see [Note: flat reduce-scatter]); wait for it once; **all-reduce** (sum)
        over the replicate axis (HSDP) once; divide by ``shard_size * replicate_size``
        under ``ReduceOp.AVG``."""
        p = get_platform()
        flat = hp.pending_reduce
        hp.pending_reduce = None
        with p.no_grad():
            if flat.work is None:
                self._issue_reduce(flat, self.unit.context.streams()[1])
            if flat.result is None:
                g = flat.work.wait()  # [1, total]
                self._pool().release(flat.buffer)
                flat.buffer = None
                first = self.params[0]
                if first.replicate_group is not None:
                    g = p.all_reduce(g, group=first.replicate_group).wait()
                if first.reduce_op is ReduceOp.AVG:  # shard_size > 1 in a group
                    g = g * (1.0 / (first.shard_size * first.replicate_size))
                flat.result = g
            i = self.params.index(hp)
            off, n = self.offsets[i], self.numels[i]
            g = flat.result[:, off:off + n].reshape(self._front_shape(hp, hp.chunk))
            flat.collected += 1
            if flat.collected == len(flat.arrived):  # the gradients hold what they view, no more
                flat.result = None
                if self.reduce is flat:
                    self.reduce = None
            g = p.narrow(g, 0, 0, hp.local_length())  # the padding rows' sums are dropped
            return self._front(p, g, hp.dim)
