"""Layout moves shared by the platform's collectives and by core: moving a dim to the
front before a dim-0 collective, and folding a leading per-rank dim back into a tensor
dim after it. Only the documented tensor methods are used, so every backend gets the same
behaviour."""

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
