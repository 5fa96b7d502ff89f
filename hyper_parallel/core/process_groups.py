"""Process-group helpers written once over the contract's group and collective members.

``split_group`` partitions the world into groups (one per mesh line); ``barrier``
synchronises a group. Both were ``Platform`` members once; they compose
``create_group`` / ``rank`` / ``world_size`` and ``all_reduce``, so every backend gets the
same behaviour from one definition (issue 34: the contract keeps what a framework must
provide, not what can be built from it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform import ReduceOp, get_platform
from hyper_parallel.platform.contract.validation import check_partition


def split_group(partition: Sequence[Sequence[int]]) -> Any:
    """Create one group per part of ``partition`` (disjoint global rank lists that
    together cover the world) and return the one this rank belongs to.

    Called by every rank with the same partition (a collective over the world): each
    rank calls ``create_group`` for every part in partition order, because
    ``create_group`` is collective over the world on torch.

    Raises:
        ValueError: the parts overlap, miss a rank or name one outside the world (before
            any group is created).
    """
    p = get_platform()
    parts = check_partition(partition, p.world_size())
    own = p.rank()
    mine = None
    for part in parts:
        group = p.create_group(part)
        if own in part:
            mine = group
    return mine


def barrier(group: Any = None) -> None:
    """Block until every rank of ``group`` (default: the world) reached this call.

    Collective: an all-reduce (sum) of one int32 over ``group``, waited for and read back
    to the host. torch's own ``barrier`` on NCCL is the same all-reduce of one element;
    reading the result back is what blocks on every backend (MindSpore's PyNative
    collectives run asynchronously, and its own barrier calls ``runtime.synchronize``,
    which logs an error on CPU).
    """
    p = get_platform()
    token = p.zeros((1,), p.dtype("int32"))
    p.all_reduce(token, ReduceOp.SUM, group=group).wait()
    p.to_numpy(token)
