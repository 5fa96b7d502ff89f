"""Point-to-point sends and receives on MindSpore.

[Note: calling the p2p primitives directly]
``mindspore.mint.distributed.isend``/``send`` check the destination with
``get_cache_group_rank()``, whose default group was bound to ``hccl_world_group`` when
MindSpore was imported; on CPU that group does not exist, so they always fail there. We
do not patch MindSpore. Instead this module calls the generated primitives
``dist_comm_isend_op``/``dist_comm_irecv_op`` and wraps their output into a
``CommHandle`` with ``_deal_comm_outputs``, exactly as ``mint.distributed.isend`` and
``irecv`` do internally. The primitives take *group* ranks, which is what the contract
passes, so no rank translation is needed. Both devices use this path.

[Note: CPU receives are posted at wait]
MindSpore runs PyNative operations, communication included, in program order on one
queue. On CPU a receive blocks that queue until its message arrives, while a send is
buffered and never waits for its receiver. A receive posted at once would therefore
hold back every send the program issues after it: ``irecv`` then ``isend`` on two peers
deadlocks, where gloo and HCCL allow it. So on CPU a receive is posted when its Work is
waited on, or when a later receive on the same (group, source) channel is, which keeps
messages matched to receives in program order. On Ascend receives are posted at once
(HCCL receives are asynchronous).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: (group name, source group rank): messages on one channel arrive in send order.
Channel = tuple[str, int]


def post_send(tensor: Any, dst: int, group: str) -> Any:
    """Issue a send of contiguous ``tensor`` to group rank ``dst``; returns its CommHandle.
    See [Note: calling the p2p primitives directly]."""
    from mindspore.communication.comm_func import _deal_comm_outputs
    from mindspore.ops.auto_generate.gen_ops_prim import dist_comm_isend_op

    _, handle = _deal_comm_outputs(dist_comm_isend_op(tensor, dst, group, 0), True)
    return handle


def post_recv(buffer: Any, src: int, group: str) -> Any:
    """Issue a receive from group rank ``src`` into contiguous ``buffer`` (filled in
    place); returns its CommHandle. See [Note: calling the p2p primitives directly]."""
    from mindspore.communication.comm_func import _deal_comm_outputs
    from mindspore.ops.auto_generate.gen_ops_prim import dist_comm_irecv_op

    _, handle = _deal_comm_outputs(dist_comm_irecv_op(buffer, 0, src, group), True)
    return handle


class PendingRecv:
    """A receive whose native operation is issued later, by ``RecvChannels``."""

    def __init__(self, channel: Channel, post: Callable[[], Any]) -> None:
        self.channel = channel
        self._post = post
        self.handle: Any = None  # the CommHandle, once posted

    def post(self) -> None:
        self.handle = self._post()


class RecvChannels:
    """The receives of one platform object not yet posted, in program order per channel.

    Guarded by a lock: the comm/compute overlap of pipeline parallelism issues
    communication from two threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Channel, list[PendingRecv]] = {}

    def add(self, recv: PendingRecv) -> None:
        with self._lock:
            self._pending.setdefault(recv.channel, []).append(recv)

    def post_through(self, recv: PendingRecv) -> None:
        """Post every pending receive of ``recv``'s channel up to and including ``recv``."""
        with self._lock:
            queue = self._pending.get(recv.channel, [])
            position = next((i for i, pending in enumerate(queue) if pending is recv), None)
            if position is None:
                return  # already posted by an earlier wait on its channel
            for pending in queue[:position + 1]:
                pending.post()
            del queue[:position + 1]
            if not queue:
                del self._pending[recv.channel]

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()


class DeferredRecvWork:
    """The Work of a CPU receive: ``wait()`` posts it (see [Note: CPU receives are posted
    at wait]) and returns the filled buffer."""

    def __init__(self, channels: RecvChannels, recv: PendingRecv, result: Any) -> None:
        self._channels = channels
        self._recv = recv
        self._result = result
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            self._channels.post_through(self._recv)
            self._recv.handle.wait()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done
