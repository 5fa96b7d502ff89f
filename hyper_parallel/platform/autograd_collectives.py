"""The differentiable collectives, written once against the contract.

``DifferentiableCollectives`` implements ``DifferentiableSection`` with
``apply_function`` and the plain collectives, so torch and MindSpore share one forward
and one backward per collective. Every buffer handed to a collective is made contiguous
first (torch's gloo produced wrong gradients from non-contiguous incoming gradients of
``torch.distributed.nn.functional.all_gather``; this module never relies on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.contract.common import CustomFunction, HandleWork, ReduceOp, Work
from hyper_parallel.platform.contract.differentiable import DifferentiableSection
from hyper_parallel.platform.contract.layout import from_front as _from_front
from hyper_parallel.platform.contract.layout import merge_leading as _merge_leading
from hyper_parallel.platform.contract.layout import split_leading as _split_leading
from hyper_parallel.platform.contract.layout import to_front as _to_front
from hyper_parallel.platform.contract.validation import check_divisible, check_split_sizes, normalize_dim


def _all_to_all(p: Any, x: Any, split_dim: int, concat_dim: int, group: Any,
                in_sizes: list[int] | None, out_sizes: list[int] | None, async_op: bool = False) -> Work:
    """All-to-all of ``x`` split on ``split_dim`` and concatenated on ``concat_dim``."""
    if split_dim == concat_dim:
        work = p.all_to_all_single(_to_front(x, split_dim), out_sizes, in_sizes, group=group, async_op=async_op)
        return HandleWork([work], lambda: _from_front(work.wait(), split_dim))
    n = p.world_size(group)
    work = p.all_to_all_single(_split_leading(x, split_dim, n), group=group, async_op=async_op)
    return HandleWork([work], lambda: _merge_leading(work.wait(), concat_dim))


class _AllGather(CustomFunction):
    @staticmethod
    def forward(ctx: Any, p: Any, x: Any, dim: int, group: Any) -> Any:
        ctx.p, ctx.dim, ctx.group = p, dim, group
        return _from_front(p.all_gather_into_tensor(_to_front(x, dim), group=group).wait(), dim)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        p = ctx.p
        shard = p.reduce_scatter_tensor(_to_front(grad, ctx.dim), ReduceOp.SUM, group=ctx.group).wait()
        return None, _from_front(shard, ctx.dim), None, None


class _AllReduce(CustomFunction):
    @staticmethod
    def forward(ctx: Any, p: Any, x: Any, op: ReduceOp, group: Any) -> Any:
        ctx.p, ctx.op, ctx.group = p, op, group
        return p.all_reduce(x, op, group=group).wait()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        p = ctx.p
        total = p.all_reduce(grad.contiguous(), ReduceOp.SUM, group=ctx.group).wait()
        if ctx.op is ReduceOp.AVG:
            total = total / p.world_size(ctx.group)
        return None, total, None, None


class _AllToAll(CustomFunction):
    @staticmethod
    def forward(ctx: Any, p: Any, x: Any, split_dim: int, concat_dim: int, group: Any,
                in_sizes: list[int] | None, out_sizes: list[int] | None) -> Any:
        ctx.p, ctx.split_dim, ctx.concat_dim, ctx.group = p, split_dim, concat_dim, group
        ctx.in_sizes, ctx.out_sizes = in_sizes, out_sizes
        return _all_to_all(p, x, split_dim, concat_dim, group, in_sizes, out_sizes).wait()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        back = _all_to_all(ctx.p, grad, ctx.concat_dim, ctx.split_dim, ctx.group, ctx.out_sizes, ctx.in_sizes).wait()
        return None, back, None, None, None, None, None


def _deliver(ctx: Any, send: Any, work: Work) -> Any:
    """The gradient of ``x`` for the async waits' backward: without a handle box, the
    reverse collective's result now; with one, ``(work, send)`` is handed over and ``x``
    gets zeros (the consumer adds the real gradient after ``work.wait()``)."""
    if ctx.handle_box is None:
        return work.wait()
    # The send buffer rides along with its Work: on accelerators the collective reads it
    # until the wait, so it must stay alive until then.
    ctx.handle_box.append((work, send))
    return ctx.p.zeros(ctx.x_shape, ctx.x_dtype)


class _AsyncA2AWait(CustomFunction):
    @staticmethod
    def forward(ctx: Any, p: Any, x: Any, work: Work, out_perm: Any, group: Any, world_size: int,
                concat_dim: int, split_dim: int, handle_box: list | None) -> Any:
        ctx.p, ctx.group, ctx.n = p, group, world_size
        ctx.concat_dim, ctx.split_dim, ctx.handle_box = concat_dim, split_dim, handle_box
        ctx.x_shape, ctx.x_dtype = tuple(x.shape), x.dtype
        buf = work.wait()
        return _merge_leading(out_perm if buf is None else buf, concat_dim)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        send = _split_leading(grad, ctx.concat_dim, ctx.n)
        launched = ctx.p.all_to_all_single(send, group=ctx.group, async_op=ctx.handle_box is not None)
        grad_x = _deliver(ctx, send, HandleWork([launched], lambda: _merge_leading(launched.wait(), ctx.split_dim)))
        return None, grad_x, None, None, None, None, None, None, None


class _SyncHook(CustomFunction):
    @staticmethod
    def forward(ctx: Any, p: Any, x: Any, hook_name: str, coordinator: Any) -> Any:
        ctx.hook_name, ctx.coordinator = hook_name, coordinator
        coordinator.forward_hook(hook_name)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        ctx.coordinator.backward_hook(ctx.hook_name)
        return None, grad, None, None


def _sum_or_avg(op: ReduceOp | str, member: str) -> ReduceOp:
    parsed = ReduceOp.parse(op)
    if parsed not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{member}: op={parsed.value!r} has no gradient here; use 'sum' or 'avg'")
    return parsed


class DifferentiableCollectives(DifferentiableSection):
    """The differentiable section, implemented once for every backend (see module doc)."""

    def differentiable_all_gather(self, tensor: Any, dim: int = 0, group: Any = None) -> Any:
        dim = normalize_dim(dim, tensor.ndim)
        return self.apply_function(_AllGather, self, tensor, dim, group)  # type: ignore[attr-defined]

    def differentiable_all_reduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, group: Any = None) -> Any:
        op = _sum_or_avg(op, "differentiable_all_reduce")
        return self.apply_function(_AllReduce, self, tensor, op, group)  # type: ignore[attr-defined]

    def differentiable_all_to_all(self, tensor: Any, split_dim: int, concat_dim: int, group: Any = None,
                                  input_split_sizes: Sequence[int] | None = None,
                                  output_split_sizes: Sequence[int] | None = None) -> Any:
        split_dim = normalize_dim(split_dim, tensor.ndim, argument="split_dim")
        concat_dim = normalize_dim(concat_dim, tensor.ndim, argument="concat_dim")
        n = self.world_size(group)  # type: ignore[attr-defined]
        if (input_split_sizes is None) != (output_split_sizes is None):
            raise ValueError(
                "differentiable_all_to_all: give both input_split_sizes and output_split_sizes, or neither "
                f"(got input_split_sizes={input_split_sizes}, output_split_sizes={output_split_sizes})"
            )
        in_sizes = check_split_sizes(input_split_sizes, tensor.shape[split_dim], n, argument="input_split_sizes")
        out_sizes = check_split_sizes(output_split_sizes, None, n, argument="output_split_sizes")
        if in_sizes is not None and split_dim != concat_dim and (len(set(in_sizes)) > 1 or len(set(out_sizes)) > 1):
            raise ValueError(
                f"differentiable_all_to_all: uneven split sizes (input {in_sizes}, output {out_sizes}) need "
                f"split_dim == concat_dim, got split_dim={split_dim}, concat_dim={concat_dim}; "
                "move the dim first or use even splits"
            )
        if in_sizes is None:
            check_divisible(tensor.shape[split_dim], n, what=f"differentiable_all_to_all: tensor.shape[{split_dim}]",
                            fix="give split sizes or pad the split dim")
        if split_dim != concat_dim:
            in_sizes = out_sizes = None  # even by the check above; the reshaping path needs none
        return self.apply_function(_AllToAll, self, tensor, split_dim, concat_dim, group,  # type: ignore[attr-defined]
                                   in_sizes, out_sizes)

    def differentiable_async_a2a_wait(self, x: Any, work: Work, out_perm: Any, group: Any, world_size: int,
                                      concat_dim: int, split_dim: int,
                                      handle_box: list[tuple[Work, Any]] | None = None) -> Any:
        concat_dim = normalize_dim(concat_dim, x.ndim, argument="concat_dim")
        split_dim = normalize_dim(split_dim, x.ndim, argument="split_dim")
        return self.apply_function(_AsyncA2AWait, self, x, work, out_perm, group,  # type: ignore[attr-defined]
                                   world_size, concat_dim, split_dim, handle_box)

    def differentiable_sync_hook(self, x: Any, hook_name: str, coordinator: Any) -> Any:
        return self.apply_function(_SyncHook, self, x, hook_name, coordinator)  # type: ignore[attr-defined]
