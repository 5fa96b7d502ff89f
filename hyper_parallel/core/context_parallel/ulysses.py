"""Ulysses sequence parallelism: all-to-all from sequence-sharded to head-sharded q/k/v
before attention and back after (Jacobs et al., "DeepSpeed Ulysses", 2023).

With ``n`` ranks, ``[batch, seq/n, heads, head_dim]`` becomes ``[batch, seq, heads/n,
head_dim]``: each rank attends over whole sequences for ``heads/n`` heads. Grouped-query
attention with fewer key/value heads than ranks replicates each key/value head
``n / kv_heads`` times first, so that rank ``u`` receives the key/value head its query
heads use (query head ``h`` uses key/value head ``h // (heads / kv_heads)``); the
gradients of the replicas are summed by autograd.
"""

from __future__ import annotations

from typing import Any
from hyper_parallel.core.tensor_ops import stack


def check_heads(heads: int, kv_heads: int, n: int, where: str) -> None:
    """Raise ValueError unless ``heads`` and ``kv_heads`` can be split over ``n`` ranks."""
    if heads % n:
        raise ValueError(f"{where}: q has {heads} heads, not divisible by the Ulysses degree {n}; choose "
                         f"ulysses_degree dividing {heads} (or use kv_exchange without Ulysses: ulysses_degree=1)")
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"{where}: q has {heads} heads and k/v {kv_heads}; q's heads must be a multiple of k/v's")
    if kv_heads % n and n % kv_heads:
        raise ValueError(f"{where}: k/v have {kv_heads} heads and the Ulysses degree is {n}; one must divide the "
                         f"other (k/v heads are split over ranks, or replicated {n} / kv_heads times); choose "
                         "ulysses_degree accordingly")


def replicate_heads(p: Any, x: Any, head_dim: int, n: int) -> Any:
    """Repeat each head of ``x`` in place until there are ``n`` (``n`` a multiple of the
    head count): heads ``[a, b]`` with ``n = 4`` become ``[a, a, b, b]``."""
    heads = x.shape[head_dim]
    if heads >= n:
        return x
    reps = n // heads
    stacked = stack([x] * reps, head_dim + 1)
    shape = list(x.shape)
    return stacked.reshape(*(shape[:head_dim] + [heads * reps] + shape[head_dim + 1:]))


def seq_to_heads(p: Any, x: Any, seq_dim: int, head_dim: int, group: Any) -> Any:
    """``[.., seq/n, .., heads, ..]`` -> ``[.., seq, .., heads/n, ..]``: one differentiable
    all-to-all over ``group`` (backward: the reverse all-to-all)."""
    return p.differentiable_all_to_all(x.contiguous(), head_dim, seq_dim, group=group)


def heads_to_seq(p: Any, x: Any, seq_dim: int, head_dim: int, group: Any) -> Any:
    """Inverse of ``seq_to_heads``."""
    return p.differentiable_all_to_all(x.contiguous(), seq_dim, head_dim, group=group)
