"""Contract: the layout moves that the dim-0 collectives imply, stated once for both sides
of the seam. A collective of the contract works on dim 0 (``all_gather_into_tensor``
stacks the ranks' pieces there, ``reduce_scatter_tensor`` splits it); core, planning a
collective of another dim, and the backends' differentiable collectives, which take a
``dim``, move that dim to the front and fold the per-rank dim back with these four
functions. They are compositions of ``TENSOR_METHODS`` (``permute``, ``contiguous``,
``reshape``), so they behave the same on every backend."""

from __future__ import annotations

from typing import Any


def to_front(x: Any, dim: int) -> Any:
    """``x`` with ``dim`` moved to position 0 (the others keep their order), contiguous."""
    if dim == 0:
        return x.contiguous()
    perm = [dim] + [i for i in range(x.ndim) if i != dim]
    return x.permute(*perm).contiguous()


def from_front(x: Any, dim: int) -> Any:
    """Inverse of ``to_front``: move dim 0 back to position ``dim``, contiguous."""
    if dim == 0:
        return x.contiguous()
    perm = list(range(1, dim + 1)) + [0] + list(range(dim + 1, x.ndim))
    return x.permute(*perm).contiguous()


def merge_leading(buf: Any, dim: int) -> Any:
    """``[n, *shape]`` -> ``shape`` with ``shape[dim]`` grown ``n`` times, the leading
    index major (block ``s`` of the result is ``buf[s]``)."""
    n, rest = buf.shape[0], list(buf.shape[1:])
    return from_front(buf, dim).reshape(*(rest[:dim] + [n * rest[dim]] + rest[dim + 1:]))


def split_leading(x: Any, dim: int, n: int) -> Any:
    """Inverse of ``merge_leading``: ``shape`` -> ``[n, *shape with shape[dim] / n]``, contiguous."""
    shape = list(x.shape)
    blocked = x.reshape(*(shape[:dim] + [n, shape[dim] // n] + shape[dim + 1:]))
    return to_front(blocked, dim)
