"""Placements: how a tensor lives along one mesh axis.

``Shard(dim)`` splits tensor dim ``dim`` over the axis with ``torch.chunk`` semantics
(chunks of ``ceil(size / n)``, the last ones shorter or empty; nothing is ever
truncated), ``Replicate()`` keeps a full copy on every rank of the axis, ``Partial(op)``
holds one term of a pending reduction. Placements are immutable and compare by value.

Each placement owns the local transforms of its transitions (the collectives they
need are named in each docstring); ``redistribute.py`` sequences them. Every transform
takes and returns *local* tensors and runs outside autograd: the DTensor-level backward
is the redistribution of the gradient (see ``redistribute.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.contract.layout import from_front, merge_leading, split_leading, to_front
from hyper_parallel.core.tensor_ops import dtype_name

PARTIAL_OPS = ("sum", "avg", "max", "min")


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` rows are split into
    ``num_chunks`` with ``torch.chunk`` semantics: ``ceil(size / num_chunks)`` rows per
    chunk, the tail short or empty (7 over 4: 2, 2, 2, 1; 5 over 4: 2, 2, 1, 0)."""
    chunk = -(-size // num_chunks)
    start = min(index * chunk, size)
    return start, min(chunk, size - start)


class Placement:
    """Base of ``Shard``, ``Replicate`` and ``Partial``."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dim ``dim`` split over the mesh axis (chunk semantics, uneven allowed)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim={self.dim!r}): dim must be an int")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def shard(self, local: Any, size: int, num: int, index: int) -> Any:
        """Replicate -> Shard: keep chunk ``index`` of ``num`` along ``self.dim`` (no communication)."""
        start, length = chunk_bounds(size, num, index)
        return get_platform().narrow(local, self.dim, start, length)

    def gather(self, local: Any, size: int, group: Any, num: int, index: int) -> Any:
        """Shard -> Replicate: **all-gather** over ``group``; pieces are padded to the
        chunk size first (dim-0 all-gather needs equal shapes) and the result trimmed
        to ``size``, which removes the padding because only tail chunks are short."""
        p = get_platform()
        chunk = -(-size // num)
        if num == 1 or chunk == 0:
            return local
        _, length = chunk_bounds(size, num, index)
        padded = p.pad(local, self.dim, 0, chunk - length) if length < chunk else local
        gathered = from_front(p.all_gather_into_tensor(to_front(padded, self.dim), group=group).wait(), self.dim)
        return p.narrow(gathered, self.dim, 0, size) if chunk * num != size else gathered

    def to_shard(self, local: Any, dst: Shard, size: int, dst_size: int, group: Any, num: int, index: int) -> Any:
        """Shard(i) -> Shard(j): **all-to-all** over ``group``: dim ``j`` is cut into one
        chunk per rank and the chunks of dim ``i`` are concatenated. Both dims are padded
        to whole chunks and trimmed afterwards (``size``/``dst_size``: the sizes of dims
        ``i``/``j`` on this axis)."""
        p = get_platform()
        if num == 1:
            return local
        i, j = self.dim, dst.dim
        chunk_i, chunk_j = -(-size // num), -(-dst_size // num)
        _, length_i = chunk_bounds(size, num, index)
        x = p.pad(local, i, 0, chunk_i - length_i) if length_i < chunk_i else local
        x = p.pad(x, j, 0, chunk_j * num - dst_size) if chunk_j * num != dst_size else x
        received = p.all_to_all_single(split_leading(x, j, num), group=group).wait()
        out = merge_leading(received, i)
        if chunk_i * num != size:
            out = p.narrow(out, i, 0, size)
        _, length_j = chunk_bounds(dst_size, num, index)
        return p.narrow(out, j, 0, length_j) if length_j != chunk_j else out


@dataclass(frozen=True)
class Replicate(Placement):
    """A full copy on every rank of the mesh axis."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """One term of a pending reduction over the mesh axis: the value is the ``reduce_op``
    (``"sum"``, ``"avg"``, ``"max"``, ``"min"``) of the local tensors of the axis."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in PARTIAL_OPS:
            raise ValueError(f"Partial(reduce_op={self.reduce_op!r}) is not supported; use one of {PARTIAL_OPS}")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})"

    def reduce(self, local: Any, group: Any) -> Any:
        """Partial -> Replicate: **all-reduce** with ``reduce_op`` over ``group``."""
        return get_platform().all_reduce(local, self.reduce_op, group=group).wait()

    def reduce_shard(self, local: Any, dst: Shard, size: int, group: Any, num: int, index: int) -> Any:
        """Partial -> Shard(d): **reduce-scatter** over ``group`` (sum/avg; the dim is
        padded to whole chunks, then trimmed); max/min all-reduce, then keep the chunk."""
        p = get_platform()
        if self.reduce_op in ("max", "min") or num == 1:
            return dst.shard(self.reduce(local, group), size, num, index)
        chunk = -(-size // num)
        padded = p.pad(local, dst.dim, 0, chunk * num - size) if chunk * num != size else local
        piece = from_front(p.reduce_scatter_tensor(to_front(padded, dst.dim), self.reduce_op, group=group).wait(),
                           dst.dim)
        _, length = chunk_bounds(size, num, index)
        return p.narrow(piece, dst.dim, 0, length) if length != chunk else piece

    def partition(self, local: Any, num: int, index: int) -> Any:
        """Replicate -> Partial (no communication): for ``sum`` a floating tensor becomes
        ``value / num`` on every rank (as torch's DTensor does) and an integer one stays
        on axis coordinate 0 with zeros elsewhere (exact); ``avg``/``max``/``min`` keep
        the value on every rank."""
        p = get_platform()
        if self.reduce_op != "sum" or num == 1:
            return local
        if dtype_name(local.dtype).startswith(("float", "bfloat")):
            return local / num
        return local if index == 0 else p.zeros(tuple(local.shape), local.dtype)


@dataclass(frozen=True, repr=False)
class NormPartial(Partial):
    """One term of a pending p-norm over the mesh axis: the value is
    ``(sum_r |local_r| ** p) ** (1 / p)`` over the axis's ranks (``max_r |local_r|`` for
    ``p = inf``). What a vector norm of a sharded tensor gives before its reduction; a
    norm of such norms (``clip_grad_norm_``'s norm of the per-gradient norms) stays one,
    so the global norm costs one all-reduce (torch's DTensor has ``_NormPartial`` for the
    same reason). Not differentiable: its transitions have no gradient.
    """

    norm_type: float = 2.0

    def __post_init__(self) -> None:
        if not (self.norm_type > 0):
            raise ValueError(f"NormPartial(norm_type={self.norm_type!r}): only p-norms with p > 0 (or inf) "
                             "have a partial form")

    def __repr__(self) -> str:
        return f"NormPartial({self.norm_type!r})"

    def reduce(self, local: Any, group: Any) -> Any:
        """NormPartial -> Replicate: **all-reduce** of ``|local| ** p`` (sum), then the
        p-th root; ``p = inf``: all-reduce max of ``|local|``."""
        p = get_platform()
        magnitude = local.abs()
        if self.norm_type == float("inf"):
            return p.all_reduce(magnitude, "max", group=group).wait()
        total = p.all_reduce(magnitude ** self.norm_type, "sum", group=group).wait()
        return total ** (1.0 / self.norm_type)

    def reduce_shard(self, local: Any, dst: Shard, size: int, group: Any, num: int, index: int) -> Any:
        """NormPartial -> Shard(d): the all-reduce of ``reduce``, then the local chunk."""
        return dst.shard(self.reduce(local, group), size, num, index)

    def partition(self, local: Any, num: int, index: int) -> Any:
        """Replicate -> NormPartial (no communication): the value on axis coordinate 0,
        zeros elsewhere (the norm of ``(v, 0, ..., 0)`` is ``|v|``; norms are >= 0)."""
        if num == 1 or index == 0:
            return local
        return get_platform().zeros(tuple(local.shape), local.dtype)
