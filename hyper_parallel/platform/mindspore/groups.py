"""Process groups on MindSpore: joining the world, rank queries, sub-groups.

A group handle is a MindSpore group name (``str``). The world is
``GlobalComm.WORLD_COMM_GROUP`` once the world is up (``mccl_world_group`` on CPU,
``hccl_world_group`` on Ascend); sub-groups get a name derived from their sorted
global ranks, so every process computes the same name without communicating.

[Note: MindSpore sub-groups and non-members]
MindSpore creates a group only on its members: ``create_group`` on a non-member fails,
and that failure is re-raised later by an unrelated operation of the process. So only
members call it; a non-member just records the name and ranks and gets the name as a
handle it must not use (collectives check membership before communicating).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.contract.groups import GroupsSection
from hyper_parallel.platform.contract.validation import check_group_ranks

#: Environment variables a MindSpore worker is launched with (msrun sets them all).
LAUNCH_ENV = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID")


def run_scheduler(device: str | None = None) -> None:
    """Run this process as the scheduler of a MindSpore cluster; return when it ends.

    A cluster launched without msrun is one process with ``MS_ROLE=MS_SCHED`` plus the
    workers; the scheduler runs ``mindspore.communication.init()``, which returns once
    every worker has left.

    Args:
        device: ``"cpu"`` or ``"ascend"``; ``None`` takes the framework's device target.

    Raises:
        RuntimeError: ``MS_ROLE`` is not ``MS_SCHED`` (a worker calls
            ``init_process_group`` instead).
    """
    import mindspore
    from mindspore.communication import init

    role = os.environ.get("MS_ROLE")
    if role != "MS_SCHED":
        raise RuntimeError(f"run_scheduler: MS_ROLE={role!r}; the scheduler process is launched with MS_ROLE=MS_SCHED")
    target = device or mindspore.get_context("device_target")
    mindspore.set_device("Ascend" if str(target).lower() == "ascend" else "CPU")
    init()


def group_name(ranks: Sequence[int]) -> str:
    """The MindSpore name of the group of sorted global ``ranks`` (same on every process)."""
    digest = hashlib.sha1(",".join(map(str, ranks)).encode("ascii")).hexdigest()[:16]
    return f"hyper_parallel_{len(ranks)}_{digest}"


class MindSporeGroups(GroupsSection):
    """Process-group members of ``MindSporePlatform``.

    Uses the platform's ``_ms``/``_comm``/``_dist`` modules, ``_device_type``, ``_device_id`` and
    its group state: ``_initialized``, ``_groups`` (sorted ranks -> name) and
    ``_group_ranks`` (name -> sorted ranks).
    """

    _ms: Any
    _comm: Any
    _dist: Any
    _device_type: str
    _device_id: int | None
    _initialized: bool
    _groups: dict[tuple[int, ...], str]
    _group_ranks: dict[str, tuple[int, ...]]

    def init_process_group(self, *, timeout_s: float = 300.0) -> None:
        """Join the world: ``mindspore.set_device`` then ``mindspore.communication.init()``.

        On CPU, operations are launched in the calling thread
        (``mindspore.runtime.launch_blocking()``) unless ``MS_DEV_LAUNCH_BLOCKING`` is set
        ([Note: MindSpore CPU ranks launch blocking] in ``platform/launch.py``).
        On Ascend ``timeout_s`` becomes ``HCCL_EXEC_TIMEOUT`` unless the variable is set;
        MindSpore's CPU collectives (MCCL) take no bound (``MS_NODE_TIMEOUT`` of the
        launcher governs failure detection there). A world already up in this process (a
        platform object that left it with ``destroy_process_group``) is joined again
        without a new ``init()``: MCCL cannot be released and initialised twice.
        """
        if self._initialized:
            raise RuntimeError("init_process_group: this platform already joined the world; call it once per process")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"init_process_group: timeout_s={timeout_s!r} must be a positive number of seconds")
        if not self._comm.GlobalComm.INITED:
            missing = [name for name in LAUNCH_ENV if not os.environ.get(name)]
            if missing:
                raise RuntimeError(
                    f"init_process_group: the environment lacks {', '.join(missing)}; launch with msrun or set "
                    f"{', '.join(LAUNCH_ENV)} (MS_ROLE=MS_WORKER for a worker)"
                )
            if os.environ["MS_ROLE"] != "MS_WORKER":
                raise RuntimeError(
                    f"init_process_group: MS_ROLE={os.environ['MS_ROLE']!r}; workers use MS_WORKER "
                    "(the scheduler process calls hyper_parallel.platform.mindspore.run_scheduler())"
                )
            if self._device_type == "ascend":
                os.environ.setdefault("HCCL_EXEC_TIMEOUT", str(max(1, int(timeout_s))))
                if self._device_id is None:
                    self._ms.set_device("Ascend")
                else:
                    self._ms.set_device("Ascend", self._device_id)
            else:
                self._ms.set_device("CPU")
                if "MS_DEV_LAUNCH_BLOCKING" not in os.environ:
                    # [Note: MindSpore CPU ranks launch blocking] in platform/launch.py: N
                    # ranks on a few cores run 10x faster with operations launched in the
                    # calling thread, the same results (launch_plan sets the variable; under
                    # msrun this does). Not on Ascend, where the asynchronous launch is
                    # what keeps the device busy.
                    self._ms.runtime.launch_blocking()
            self._comm.init()
        self._initialized = True

    def destroy_process_group(self) -> None:
        """Drop every group this platform created and leave the world.

        On Ascend the member groups are destroyed and HCCL released. On CPU MindSpore
        2.10 can neither destroy an MCCL group (it logs an error) nor initialise the
        world again after ``release()`` (the process crashes), so leaving is logical:
        the groups are forgotten, the connection stays until the process exits, and a
        later ``init_process_group`` joins the same world again.
        """
        if not self._initialized:
            return
        if self._device_type == "ascend":
            me = self._comm.get_rank()
            for name, ranks in self._group_ranks.items():
                if me in ranks:
                    self._comm.destroy_group(name)
            self._comm.release()
        self._groups.clear()
        self._group_ranks.clear()
        self._initialized = False

    def rank(self, group: Any = None) -> int:
        """This process's group rank; ``-1`` in a group it is not a member of."""
        me = self._world_rank()
        if group is None:
            return me
        ranks = self.group_ranks(group)
        return ranks.index(me) if me in ranks else -1

    def world_size(self, group: Any = None) -> int:
        if group is None:
            self._require_world("world_size")
            return int(self._comm.get_group_size())
        return len(self.group_ranks(group))

    def create_group(self, ranks: Sequence[int]) -> Any:
        """The group name for ``ranks``; members create it with
        ``mindspore.communication.create_group`` (see [Note: MindSpore sub-groups and
        non-members])."""
        members = check_group_ranks(ranks, self.world_size())
        if len(members) == self.world_size():
            return self._world_name()
        name = self._groups.get(members)
        if name is None:
            name = group_name(members)
            if self._world_rank() in members:
                # Creating a name that exists with the same ranks (a group made by an
                # earlier platform object in this process) only logs a warning.
                self._comm.create_group(name, list(members))
            self._groups[members] = name
            self._group_ranks[name] = members
        return name

    def group_ranks(self, group: Any = None) -> list[int]:
        if group is None or group == self._world_name():
            return list(range(self.world_size()))
        if not isinstance(group, str):
            raise TypeError(f"group={group!r} is not a MindSpore group; pass None or a name from create_group")
        known = self._group_ranks.get(group)
        if known is not None:
            return list(known)
        # A group created outside this platform: only its members can ask MindSpore.
        return [int(r) for r in self._dist.get_process_group_ranks(group)]

    # -- helpers used by the other sections -------------------------------------------

    def _require_world(self, member: str) -> None:
        if not self._initialized:
            raise RuntimeError(f"{member}: the process group is not initialised; call init_process_group() first")

    def _world_rank(self) -> int:
        self._require_world("rank")
        return int(self._comm.get_rank())

    def _world_name(self) -> str:
        return str(self._comm.GlobalComm.WORLD_COMM_GROUP)

    def _member_group(self, group: Any, member: str) -> tuple[str, list[int], int]:
        """``(name, global ranks, this process's group rank)`` of a group this process
        belongs to; raises before any communication otherwise."""
        self._require_world(member)
        name = self._world_name() if group is None else group
        ranks = self.group_ranks(group)
        me = self._world_rank()
        if me not in ranks:
            raise ValueError(
                f"{member}: global rank {me} is not a member of group {name!r} (ranks {ranks}); "
                "only members may communicate on a group"
            )
        return name, ranks, ranks.index(me)
