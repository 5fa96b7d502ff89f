"""Contract section: process groups.

A process group is an opaque handle (``torch.distributed.ProcessGroup``, or a MindSpore
group name). ``None`` always means the world. Ranks passed to and returned by the
collectives are *group* ranks (0 .. group size - 1); ``group_ranks`` maps them to global
ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class GroupsSection(ABC):
    """Process-group lifetime, rank queries and sub-groups."""

    @abstractmethod
    def init_process_group(self, *, timeout_s: float = 300.0) -> None:
        """Join the world described by the launcher's environment.

        torch reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` (as set by
        torchrun); MindSpore reads ``MS_ROLE``, ``MS_SCHED_HOST``, ``MS_SCHED_PORT``,
        ``MS_WORKER_NUM``, ``MS_NODE_ID`` (as set by msrun). ``timeout_s`` (seconds)
        bounds every later collective where the framework supports a bound.

        Raises:
            RuntimeError: already initialised, or the environment lacks a variable
                (the message names it).
        """

    @abstractmethod
    def destroy_process_group(self) -> None:
        """Leave the world and drop every group this platform created."""

    @abstractmethod
    def rank(self, group: Any = None) -> int:
        """This process's rank within ``group`` (the world when ``None``)."""

    @abstractmethod
    def world_size(self, group: Any = None) -> int:
        """The number of ranks in ``group`` (the world when ``None``)."""

    @abstractmethod
    def create_group(self, ranks: Sequence[int]) -> Any:
        """The group of the given global ranks, created once per sorted rank tuple and
        cached on this platform object.

        Every rank of the world calls it with the same ``ranks`` in the same order
        (torch requires it), members or not; a non-member gets a handle it must not use.
        The full world returns the world group.

        Raises:
            ValueError: ``ranks`` is empty, has duplicates or a rank outside the world.
        """

    @abstractmethod
    def group_ranks(self, group: Any = None) -> list[int]:
        """The global ranks of ``group`` in group-rank order."""
