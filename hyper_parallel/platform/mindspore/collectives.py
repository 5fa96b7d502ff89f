"""Collectives and point-to-point operations on ``mindspore.mint.distributed``.

Every operation is out-of-place: MindSpore's collectives write into the buffers they
are given, so each one runs on a fresh buffer and the input is never touched.

[Note: CPU collectives]
MindSpore 2.10's CPU communication (MCCL) implements AllReduce (sum, max, min, prod),
list AllGather, Broadcast and point-to-point, but has no AlltoAll, ReduceScatter or
AllGatherIntoTensor kernel. On CPU those are built from AllGather/AllReduce, with the
same results and more traffic:

- ``all_gather_into_tensor``: list all-gather, then ``cat``;
- ``reduce_scatter_tensor``: all-reduce, then this rank's rows;
- ``all_to_all_single``: all-gather of every rank's input (rows padded to the largest
  split when splits are uneven, after an all-gather of the split sizes), then this
  rank's rows of each block.

Some dtypes have no kernel either, on CPU and (we assume) in HCCL: AllReduce lacks
float64, uint8 and bool, AllGather/Broadcast/send/recv lack bool. Bool tensors travel
as uint8 views (same bytes); reductions of those three dtypes gather every rank's
tensor and reduce locally in rank order, so every rank computes bit-identical results.

A collective that fails inside MindSpore leaves the process's operation queue broken
(later, unrelated operations re-raise the error), so every argument is checked here, on
every rank, before anything is issued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hyper_parallel.platform.contract.collectives import CollectivesSection
from hyper_parallel.platform.contract.common import CompletedWork, HandleWork, P2POp, ReduceOp, Work
from hyper_parallel.platform.mindspore import p2p
from hyper_parallel.platform.contract.validation import check_divisible, check_gather_out, check_peer, check_split_sizes

#: The MindSpore name of each reduction; AVG is a sum divided by the group size.
_NATIVE_OP = {ReduceOp.SUM: "sum", ReduceOp.AVG: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
              ReduceOp.PRODUCT: "prod"}
#: Dtypes MindSpore's AllReduce/ReduceScatter kernels accept (see [Note: CPU collectives]).
_NATIVE_REDUCE_DTYPES = frozenset({"float32", "float16", "bfloat16", "int32", "int64", "int8"})


def _block_on(tensor: Any) -> None:
    """Wait until ``tensor`` is computed: reading it is what blocks in PyNative."""
    tensor.asnumpy()


def _work(handle: Any, finish: Callable[[], Any]) -> Work:
    """A Work for a native call: complete already when the call was synchronous."""
    return CompletedWork(finish()) if handle is None else HandleWork([handle], finish)


class MindSporeCollectives(CollectivesSection):
    """Collective members of ``MindSporePlatform``: native on Ascend, partly emulated on
    CPU (see [Note: CPU collectives]).

    Uses the platform's ``_ms``/``_mint``/``_dist`` modules, ``_device_type``,
    ``_recv_channels``, and ``_member_group`` from the groups section.
    """

    _ms: Any
    _mint: Any
    _dist: Any
    _device_type: str
    _recv_channels: p2p.RecvChannels
    _member_group: Callable[[Any, str], tuple[str, list[int], int]]

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Work:
        """``mint.distributed.all_reduce`` on a copy of ``tensor``; AVG is the sum divided
        by the group size; float64/uint8/bool are reduced locally after an all-gather."""
        op = ReduceOp.parse(op)
        if op is ReduceOp.AVG and not tensor.is_floating_point():
            raise ValueError(f"all_reduce: op='avg' needs a floating tensor, got dtype {tensor.dtype}; "
                             "cast first or use op='sum'")
        name, ranks, _ = self._member_group(group, "all_reduce")
        return self._reduce(tensor, op, name, len(ranks), async_op)

    def all_gather_into_tensor(self, tensor: Any, group: Any = None, async_op: bool = False,
                               out: Any = None) -> Work:
        """Ascend: ``mint.distributed.all_gather_into_tensor`` (into ``out`` when given);
        CPU: list all-gather + cat, copied into ``out`` when given."""
        if tensor.ndim == 0:
            raise ValueError("all_gather_into_tensor: tensor is 0-dimensional; gather along dim 0 needs "
                             "at least 1 dim (reshape it to [1])")
        name, ranks, _ = self._member_group(group, "all_gather_into_tensor")
        n, dtype = len(ranks), tensor.dtype
        if out is not None:
            check_gather_out(out, tensor, n, member="all_gather_into_tensor")
        if self._device_type == "ascend":
            wire = self._wire(self._contiguous(tensor))
            dest = self._wire(out) if out is not None else \
                self._mint.empty((n * tensor.shape[0], *tensor.shape[1:]), dtype=wire.dtype)
            handle = self._dist.all_gather_into_tensor(dest, wire, group=name, async_op=async_op)
            return _work(handle, lambda: out if out is not None else self._unwire(dest, dtype))
        handle, pieces = self._gather(tensor, name, n, async_op)
        if out is None:
            return _work(handle, lambda: self._unwire(self._mint.cat(pieces, 0), dtype))

        def into_out() -> Any:
            if out.numel():  # see _gather: nothing was gathered for empty buffers
                self._wire(out).copy_(self._mint.cat(pieces, 0))
            return out

        return _work(handle, into_out)

    def reduce_scatter_tensor(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
                              async_op: bool = False) -> Work:
        """Ascend: ``mint.distributed.reduce_scatter_tensor`` (sum; AVG divides); CPU:
        all-reduce then this rank's rows, copied so the full buffer is released."""
        op = ReduceOp.parse(op)
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"reduce_scatter_tensor: op={op.value!r} is not supported; use 'sum' or 'avg'")
        if op is ReduceOp.AVG and not tensor.is_floating_point():
            raise ValueError(f"reduce_scatter_tensor: op='avg' needs a floating tensor, got dtype {tensor.dtype}")
        if tensor.ndim == 0:
            raise ValueError("reduce_scatter_tensor: tensor is 0-dimensional; it needs a dim 0 to scatter")
        name, ranks, me = self._member_group(group, "reduce_scatter_tensor")
        n = len(ranks)
        rows = check_divisible(tensor.shape[0], n, what="reduce_scatter_tensor: tensor.shape[0]",
                               fix="pad dim 0 to a multiple of the group size")
        if self._device_type == "ascend" and self._dtype_key(tensor.dtype) in _NATIVE_REDUCE_DTYPES:
            out = self._mint.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype)
            handle = self._dist.reduce_scatter_tensor(out, self._contiguous(tensor), "sum", group=name,
                                                      async_op=async_op)
            return _work(handle, lambda: out / n if op is ReduceOp.AVG else out)
        reduced = self._reduce(tensor, op, name, n, async_op)
        return HandleWork([reduced], lambda: self._fresh(self._mint.narrow(reduced.wait(), 0, me * rows, rows)))

    def all_to_all_single(self, tensor: Any, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, group: Any = None,
                          async_op: bool = False) -> Work:
        """Ascend: ``mint.distributed.all_to_all_single``; CPU: built on all-gather (see
        [Note: CPU collectives]). Uneven splits on CPU cost one extra small all-gather, of
        the split sizes, which also checks that they agree across ranks."""
        if tensor.ndim == 0:
            raise ValueError("all_to_all_single: tensor is 0-dimensional; it needs a dim 0 to split")
        name, ranks, me = self._member_group(group, "all_to_all_single")
        n, rows, dtype = len(ranks), tensor.shape[0], tensor.dtype
        in_sizes = check_split_sizes(input_split_sizes, rows, n, argument="input_split_sizes")
        out_sizes = check_split_sizes(output_split_sizes, None, n, argument="output_split_sizes")
        even = in_sizes is None and out_sizes is None
        if in_sizes is None or out_sizes is None:
            block = check_divisible(rows, n, what="all_to_all_single: tensor.shape[0]",
                                    fix="give input_split_sizes and output_split_sizes for uneven splits")
            in_sizes = [block] * n if in_sizes is None else in_sizes
            out_sizes = [block] * n if out_sizes is None else out_sizes
        rest = tuple(tensor.shape[1:])
        if self._device_type == "ascend":
            wire = self._wire(self._contiguous(tensor))
            out = self._mint.empty((sum(out_sizes), *rest), dtype=wire.dtype)
            handle = self._dist.all_to_all_single(out, wire, None if even else out_sizes, None if even else in_sizes,
                                                  group=name, async_op=async_op)
            return _work(handle, lambda: self._unwire(out, dtype))
        if even:
            block = rows // n
            handle, pieces = self._gather(tensor, name, n, async_op)
            return _work(handle, lambda: self._take_rows(pieces, me * block, [block] * n, dtype))
        width = self._agreed_split_width(in_sizes, out_sizes, name, n)
        if width == 0:
            return CompletedWork(self._mint.empty((0, *rest), dtype=dtype))
        padded = [self._pad_rows(piece, width) for piece in self._mint.split(self._contiguous(tensor), in_sizes, 0)]
        handle, pieces = self._gather(self._mint.cat(padded, 0), name, n, async_op)
        return _work(handle, lambda: self._take_rows(pieces, me * width, out_sizes, dtype))

    def broadcast(self, tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Work:
        """``mint.distributed.broadcast`` into a fresh buffer; ``src`` (a group rank) is
        translated to the global rank MindSpore expects."""
        name, ranks, me = self._member_group(group, "broadcast")
        if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < len(ranks):
            raise ValueError(f"broadcast: src={src!r} is not a rank of the group (size {len(ranks)}); "
                             f"use a group rank in [0, {len(ranks)})")
        if getattr(tensor, "is_meta", False):
            # a meta tensor has no values to send (MindSpore refuses it as a kernel input):
            # every rank gets a meta tensor of its shape and dtype, as torch's broadcast of
            # a meta tensor does; MindFormers distributes parameters under ms.DeviceCtx("meta")
            with self._ms.DeviceCtx("meta"):
                return CompletedWork(self._mint.empty(tuple(tensor.shape), dtype=tensor.dtype))
        buf = self._wire(self._fresh(tensor)) if me == src else self._receive_buffer(tensor)
        if buf.numel() == 0:  # see _gather: empty buffers are not sent
            return CompletedWork(self._unwire(buf, tensor.dtype))
        handle = self._dist.broadcast(buf, ranks[src], group=name, async_op=async_op)
        return _work(handle, lambda: self._unwire(buf, tensor.dtype))

    # -- point-to-point ------------------------------------------------------------------

    def _isend(self, tensor: Any, dst: int, group: Any = None) -> Work:
        """``dist_comm_isend_op`` (see [Note: calling the p2p primitives directly])."""
        name, ranks, me = self._member_group(group, "isend")
        check_peer(dst, len(ranks), me, argument="dst")
        wire = self._wire(self._contiguous(tensor))
        handle = p2p.post_send(wire, dst, name)
        # The default argument keeps the buffer alive until the send is waited on.
        return HandleWork([handle], lambda keep=wire: None)

    def _irecv(self, tensor: Any, src: int, group: Any = None) -> Work:
        """``dist_comm_irecv_op`` into ``tensor``, or into a fresh buffer when ``tensor`` is
        not contiguous or is bool (see ``_receive_buffer``); on CPU posted at ``wait()``
        (see [Note: CPU receives are posted at wait])."""
        name, ranks, me = self._member_group(group, "irecv")
        check_peer(src, len(ranks), me, argument="src")
        buf = self._receive_buffer(tensor, in_place=True)
        result = self._unwire(buf, tensor.dtype)
        if self._device_type == "ascend":
            return HandleWork([p2p.post_recv(buf, src, name)], lambda: result)
        pending = p2p.PendingRecv((name, src), lambda: p2p.post_recv(buf, src, name))
        self._recv_channels.add(pending)
        return p2p.DeferredRecvWork(self._recv_channels, pending, result)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """Ascend, one group: ``mint.distributed.batch_isend_irecv``. Otherwise every
        send is issued first, then every receive (CPU sends are buffered, so no order of
        the batch among peers can deadlock)."""
        checked = []
        for index, op in enumerate(ops):
            if not isinstance(op, P2POp):
                raise TypeError(f"batch_isend_irecv: ops[{index}] is {type(op).__name__}, not a P2POp")
            name, ranks, me = self._member_group(op.group, "batch_isend_irecv")
            check_peer(op.peer, len(ranks), me, argument="P2POp.peer")
            checked.append((op, name, ranks))
        if self._device_type == "ascend" and checked and len({name for _, name, _ in checked}) == 1:
            return self._native_batch(checked)
        works: dict[int, Work] = {}
        for kind, post in (("isend", self._isend), ("irecv", self._irecv)):
            for index, (op, _, _) in enumerate(checked):
                if op.op == kind:
                    works[index] = post(op.tensor, op.peer, op.group)
        return [works[index] for index in range(len(checked))]

    def _native_batch(self, checked: list[tuple[P2POp, str, list[int]]]) -> list[Work]:
        """One ``mint.distributed.batch_isend_irecv`` call; its P2POps take global peers."""
        native, results = [], []
        for op, name, ranks in checked:
            if op.op == "isend":
                buf = self._contiguous(op.tensor)
                results.append(None)
            else:
                buf = self._receive_buffer(op.tensor, in_place=True)
                results.append(self._unwire(buf, op.tensor.dtype))
            native.append(self._dist.P2POp(op.op, self._wire(buf), ranks[op.peer], group=name))
        handles = self._dist.batch_isend_irecv(native)
        return [HandleWork(handles, lambda result=result, keep=native: result) for result in results]

    # -- buffers and emulation helpers ---------------------------------------------------

    def _dtype_key(self, dtype: Any) -> str | None:
        try:
            return self._dtype_name(dtype)  # type: ignore[attr-defined]
        except ValueError:
            return None

    def _contiguous(self, tensor: Any) -> Any:
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def _fresh(self, tensor: Any) -> Any:
        """A contiguous copy that owns its memory: ``cat`` of the tensor alone. MindSpore
        2.10 on CPU has no ``Clone`` kernel, and its ``copy_`` misreads a view that starts
        at offset 0 of a larger buffer (it fails with "unexpected kernel")."""
        if tensor.ndim == 0:
            return self._mint.cat([tensor.reshape(1)], 0).reshape(())
        return self._mint.cat([tensor], 0)

    def _wire(self, tensor: Any) -> Any:
        """The view communication moves: bool as uint8 (no bool kernels), else itself."""
        return tensor.view(self._ms.uint8) if tensor.dtype == self._ms.bool_ else tensor

    def _receive_buffer(self, like: Any, in_place: bool = False) -> Any:
        """A buffer to receive ``like``'s shape and dtype into, in its wire dtype. With
        ``in_place``, ``like`` itself when it is contiguous and not bool: a receive
        through a uint8 view of a bool tensor does not reach the tensor in MindSpore 2.10."""
        if in_place and like.is_contiguous() and like.dtype != self._ms.bool_:
            return like
        dtype = self._ms.uint8 if like.dtype == self._ms.bool_ else like.dtype
        return self._mint.empty(tuple(like.shape), dtype=dtype)

    def _unwire(self, tensor: Any, dtype: Any) -> Any:
        return tensor.view(self._ms.bool_) if dtype == self._ms.bool_ else tensor

    def _gather(self, tensor: Any, name: str, n: int, async_op: bool) -> tuple[Any, list[Any]]:
        """List all-gather of ``tensor`` (as its wire view): ``(handle, pieces)``."""
        wire = self._wire(self._contiguous(tensor))
        pieces = [self._mint.empty(tuple(wire.shape), dtype=wire.dtype) for _ in range(n)]
        if wire.numel() == 0:
            # MindSpore's CPU ring all-gather fails on empty buffers ("Memcpy error ...
            # size is 0"); every rank has the same empty shape, so none communicates.
            return None, pieces
        handle = self._dist.all_gather(pieces, wire, group=name, async_op=async_op)
        return handle, pieces

    def _reduce(self, tensor: Any, op: ReduceOp, name: str, n: int, async_op: bool) -> Work:
        if tensor.numel() == 0:  # see _gather: empty buffers are not sent
            return CompletedWork(self._fresh(tensor))
        if self._dtype_key(tensor.dtype) in _NATIVE_REDUCE_DTYPES:
            buf = self._fresh(tensor)
            handle = self._dist.all_reduce(buf, _NATIVE_OP[op], group=name, async_op=async_op)
            return _work(handle, lambda: buf / n if op is ReduceOp.AVG else buf)
        shape, dtype = tuple(tensor.shape), tensor.dtype
        handle, pieces = self._gather(tensor.reshape(-1), name, n, async_op)
        return _work(handle, lambda: self._unwire(self._combine(pieces, op, dtype, n), dtype).reshape(shape))

    def _combine(self, pieces: list[Any], op: ReduceOp, dtype: Any, n: int) -> Any:
        """Reduce gathered pieces locally, in rank order. Bool pieces are uint8 0/1:
        sum and max are a logical or, product and min a logical and."""
        is_bool = dtype == self._ms.bool_
        total = pieces[0]
        for piece in pieces[1:]:
            if op in (ReduceOp.SUM, ReduceOp.AVG) and not is_bool:
                total = total + piece
            elif op is ReduceOp.PRODUCT and not is_bool:
                total = total * piece
            elif op in (ReduceOp.SUM, ReduceOp.MAX):
                total = self._mint.maximum(total, piece)
            else:
                total = self._mint.minimum(total, piece)
        return total / n if op is ReduceOp.AVG else total

    def _agreed_split_width(self, in_sizes: list[int], out_sizes: list[int], name: str, n: int) -> int:
        """All-gather every rank's split sizes; check that what each rank sends is what its
        peer expects (the same check, with the same outcome, on every rank) and return
        the largest split, the padded width of every block."""
        mine = self._ms.Tensor(np.asarray(list(in_sizes) + list(out_sizes), dtype=np.int64))
        _, pieces = self._gather(mine, name, n, False)
        table = np.stack([piece.asnumpy() for piece in pieces])  # [rank, 2n]
        sends, receives = table[:, :n], table[:, n:]  # sends[r, s]: rows r sends to s
        mismatch = np.argwhere(receives.T != sends)
        if mismatch.size:
            r, s = (int(v) for v in mismatch[0])
            raise ValueError(
                f"all_to_all_single: group rank {r} sends {int(sends[r, s])} rows to group rank {s}, which expects "
                f"{int(receives[s, r])} (its output_split_sizes[{r}]); make each rank's output_split_sizes match "
                "what its peers send"
            )
        return int(sends.max()) if sends.size else 0

    def _take_rows(self, pieces: list[Any], start: int, counts: Sequence[int], dtype: Any) -> Any:
        """Rows ``start .. start + counts[s]`` of each gathered piece ``s``, concatenated
        in rank order: this rank's blocks of an emulated all-to-all."""
        rows = [self._mint.narrow(piece, 0, start, count) for piece, count in zip(pieces, counts)]
        return self._unwire(self._mint.cat(rows, 0), dtype)

    def _pad_rows(self, piece: Any, width: int) -> Any:
        missing = width - piece.shape[0]
        if missing == 0:
            return piece
        filler = self._mint.zeros((missing, *piece.shape[1:]), dtype=piece.dtype)
        return self._mint.cat([piece, filler], 0)
