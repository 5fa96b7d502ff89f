"""torch.distributed collectives behind the contract's out-of-place, Work-returning API.

Every buffer handed to torch.distributed is a fresh contiguous copy: inputs are never
modified, and gloo never sees a strided view (see autograd_collectives' module note).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.platform.contract.common import CompletedWork, HandleWork, P2POp, ReduceOp, Work
from hyper_parallel.platform.contract.validation import check_divisible, check_gather_out, check_peer, check_split_sizes

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

# torch 2.13 renamed the flat-buffer collectives (the old names warn with FutureWarning);
# the torch releases torch_npu supports predate the new names.
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy, for collectives that write into their input (all-reduce, broadcast)."""
    return tensor.detach().contiguous().clone()


def _source(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous view or copy, for collectives that only read their input."""
    return tensor.detach().contiguous()


def _keep_alive(buf: torch.Tensor) -> Any:
    """A finish step returning None whose closure holds ``buf`` until the Work is
    waited: an asynchronous send reads its buffer until then."""

    keep: torch.Tensor | None = buf

    def finish() -> None:
        nonlocal keep
        keep = None  # released here, once the send has completed

    return finish


def _work(native: Any, result: Any, async_op: bool) -> Work:
    if async_op:
        return HandleWork([native], lambda: result)
    return CompletedWork(result)


def _check_reduce(op: ReduceOp | str, tensor: torch.Tensor, member: str) -> ReduceOp:
    op = ReduceOp.parse(op)
    if op is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{member}: op='avg' needs a floating tensor, got dtype {tensor.dtype}; cast first or use 'sum'")
    return op


class TorchCollectives:
    """The collectives section for torch; mixed into ``TorchPlatform``."""

    def _group(self, group: Any) -> Any:
        return group if group is not None else dist.group.WORLD

    def all_reduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Work:
        op = _check_reduce(op, tensor, "all_reduce")
        buf = _buffer(tensor)
        return _work(dist.all_reduce(buf, _TORCH_OPS[op], group=self._group(group), async_op=async_op), buf, async_op)

    def all_gather_into_tensor(self, tensor: Any, group: Any = None, async_op: bool = False,
                               out: Any = None) -> Work:
        if tensor.ndim == 0:
            raise ValueError("all_gather_into_tensor: tensor is 0-dimensional; reshape it to [1] first")
        n = dist.get_world_size(self._group(group))
        if out is None:
            out = tensor.new_empty((n * tensor.shape[0], *tensor.shape[1:]))
        else:  # the caller's buffer: the collective writes into it directly
            check_gather_out(out, tensor, n, member="all_gather_into_tensor")
        native = _ALL_GATHER_FLAT(out, _source(tensor), group=self._group(group), async_op=async_op)
        return _work(native, out, async_op)

    def reduce_scatter_tensor(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
                              async_op: bool = False) -> Work:
        op = _check_reduce(op, tensor, "reduce_scatter_tensor")
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"reduce_scatter_tensor: op={op.value!r} is not supported; use 'sum' or 'avg'")
        if tensor.ndim == 0:
            raise ValueError("reduce_scatter_tensor: tensor is 0-dimensional; it needs a dim 0 to scatter")
        n = dist.get_world_size(self._group(group))
        rows = check_divisible(tensor.shape[0], n, what="reduce_scatter_tensor: tensor.shape[0]",
                               fix="pad dim 0 to a multiple of the group size")
        out = tensor.new_empty((rows, *tensor.shape[1:]))
        native = _REDUCE_SCATTER_FLAT(out, _source(tensor), _TORCH_OPS[op], group=self._group(group),
                                      async_op=async_op)
        return _work(native, out, async_op)

    def all_to_all_single(self, tensor: Any, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, group: Any = None,
                          async_op: bool = False) -> Work:
        if tensor.ndim == 0:
            raise ValueError("all_to_all_single: tensor is 0-dimensional; it needs a dim 0 to split")
        n = dist.get_world_size(self._group(group))
        in_sizes = check_split_sizes(input_split_sizes, tensor.shape[0], n, argument="input_split_sizes")
        out_sizes = check_split_sizes(output_split_sizes, None, n, argument="output_split_sizes")
        if in_sizes is None:
            check_divisible(tensor.shape[0], n, what="all_to_all_single: tensor.shape[0]",
                            fix="give input_split_sizes/output_split_sizes for uneven splits")
        rows = sum(out_sizes) if out_sizes is not None else (tensor.shape[0] // n) * n
        out = tensor.new_empty((rows, *tensor.shape[1:]))
        native = dist.all_to_all_single(out, _source(tensor), out_sizes, in_sizes, group=self._group(group),
                                        async_op=async_op)
        return _work(native, out, async_op)

    def differentiable_all_to_all_single_async(self, tensor: Any, input_split_sizes: Sequence[int],
                                               output_split_sizes: Sequence[int], group: Any = None) -> Any:
        """torch's ``_functional_collectives.all_to_all_single_autograd``: an
        ``AsyncCollectiveTensor`` whose wait runs at its first use (see the derived
        member in ``platform/base.py``)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        if tensor.ndim == 0:
            raise ValueError("differentiable_all_to_all_single_async: tensor is 0-dimensional; it needs a dim 0")
        n = dist.get_world_size(self._group(group))
        in_sizes = check_split_sizes(input_split_sizes, tensor.shape[0], n, argument="input_split_sizes")
        out_sizes = check_split_sizes(output_split_sizes, None, n, argument="output_split_sizes")
        return all_to_all_single_autograd(tensor.contiguous(), out_sizes, in_sizes, self._group(group))

    def broadcast(self, tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Work:
        n = dist.get_world_size(self._group(group))
        if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < n:
            raise ValueError(f"broadcast: src={src!r} is not a rank of the group (size {n}); use a group rank in [0, {n})")
        buf = _buffer(tensor)
        native = dist.broadcast(buf, group_src=src, group=self._group(group), async_op=async_op)
        return _work(native, buf, async_op)

    def _check_p2p(self, peer: int, group: Any, argument: str) -> None:
        g = self._group(group)
        check_peer(peer, dist.get_world_size(g), dist.get_rank(g), argument=argument)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        native_ops, results, bufs = [], [], []
        for op in ops:
            self._check_p2p(op.peer, op.group, "P2POp.peer")
        for op in ops:
            if op.op == "isend":
                buf, result = _source(op.tensor), None
                native_ops.append(dist.P2POp(dist.isend, buf, group=self._group(op.group), group_peer=op.peer))
            else:
                buf = op.tensor if op.tensor.is_contiguous() else torch.empty_like(
                    op.tensor, memory_format=torch.contiguous_format)
                result = buf
                native_ops.append(dist.P2POp(dist.irecv, buf, group=self._group(op.group), group_peer=op.peer))
            results.append(result)
            bufs.append(buf)
        handles = dist.batch_isend_irecv(native_ops) if native_ops else []
        # Each Work holds its buffer until waited: a send reads it until then.
        if len(handles) != len(results):
            # NCCL/HCCL coalesce a batch into fewer handles; each op then waits on all.
            return [HandleWork(handles, (lambda r=r, keep=b: r)) for r, b in zip(results, bufs)]
        return [HandleWork([h], (lambda r=r, keep=b: r)) for h, r, b in zip(handles, results, bufs)]
