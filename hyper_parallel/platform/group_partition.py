"""``split_group`` for every backend: one ``create_group`` per part, in partition order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.validation import check_partition


def split_group(platform: Any, partition: Sequence[Sequence[int]]) -> Any:
    """Create every part's group on every rank (``create_group`` is collective over the
    world on torch, so all ranks walk the parts in the same order) and return the group
    of the part holding this rank.

    Raises:
        ValueError: the parts overlap, miss a rank or name one outside the world.
    """
    parts = check_partition(partition, platform.world_size())
    own = platform.rank()
    mine = None
    for part in parts:
        group = platform.create_group(part)
        if own in part:
            mine = group
    return mine
