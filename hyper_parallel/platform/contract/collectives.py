"""Contract section: collectives and point-to-point operations.

Every operation is out-of-place: inputs are never modified, results come back through
``Work.wait()``. With ``async_op=False`` the returned Work is already complete. Inputs
may be non-contiguous; backends pass contiguous buffers to the framework. All ranks of
the group must call the same collective in the same order with matching shapes and
dtypes; each method validates what it can see locally (for example split sizes that do
not add up) and raises before issuing any communication.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.contract.common import P2POp, ReduceOp, Work


class CollectivesSection(ABC):
    """The communication primitives core is written against."""

    @abstractmethod
    def all_reduce(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Work:
        """All-reduce: every rank gets the element-wise reduction of all ranks' ``tensor``.

        Args:
            tensor: any shape and dtype (``AVG`` needs a floating dtype).
            op: ``SUM``, ``AVG``, ``MAX``, ``MIN`` or ``PRODUCT`` (enum or its value).

        Returns:
            Work whose ``wait()`` gives a new tensor of ``tensor``'s shape and dtype.

        Raises:
            ValueError: unknown ``op``; ``AVG`` of an integer tensor.
        """

    @abstractmethod
    def all_gather_into_tensor(self, tensor: Any, group: Any = None, async_op: bool = False,
                               out: Any = None) -> Work:
        """All-gather along dim 0: ``[d0, *rest]`` on each of ``n`` ranks gives
        ``[n * d0, *rest]``, rank ``r``'s block at rows ``r*d0 .. (r+1)*d0``.

        Every rank passes the same shape (uneven pieces are padded by the caller).

        Args:
            out: optional caller-owned output buffer ``[n * d0, *rest]`` of ``tensor``'s
                dtype, contiguous (a reusable buffer, e.g. a pool of gathered weights).
                The result is written into it (torch and Ascend: the collective's own
                output; MindSpore CPU: copied in when the gather completes) and
                ``wait()`` returns ``out`` itself. Its contents are undefined until
                ``wait()``; the caller must not reuse it while a reader still needs it.

        Raises:
            ValueError: ``tensor`` is 0-dimensional; ``out`` of another shape or dtype,
                or not contiguous.
        """

    @abstractmethod
    def reduce_scatter_tensor(self, tensor: Any, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
                              async_op: bool = False) -> Work:
        """Reduce-scatter along dim 0: ``[n * d0, *rest]`` on each of ``n`` ranks gives
        rank ``r`` the reduction over ranks of rows ``r*d0 .. (r+1)*d0``, ``[d0, *rest]``.

        Args:
            op: ``SUM`` or ``AVG``.

        Raises:
            ValueError: dim 0 not divisible by the group size; ``op`` not SUM/AVG.
        """

    @abstractmethod
    def all_to_all_single(self, tensor: Any, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, group: Any = None,
                          async_op: bool = False) -> Work:
        """All-to-all on dim 0 of an N-D ``tensor`` ``[d0, *rest]``.

        Rank ``r`` sends rows ``input_split_sizes[:s].sum() ..`` (``input_split_sizes[s]``
        rows) to rank ``s`` and receives ``output_split_sizes[s]`` rows from each rank
        ``s``, stacked in rank order: the result is ``[sum(output_split_sizes), *rest]``.
        ``None`` split sizes mean even splits (``d0 / n`` rows each).

        Raises:
            ValueError: ``input_split_sizes`` does not sum to ``d0``; a split list whose
                length is not the group size or holds a negative size; ``d0`` not
                divisible by ``n`` when splits are ``None``.
        """

    @abstractmethod
    def broadcast(self, tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Work:
        """Broadcast ``tensor`` from group rank ``src``; every rank gets a copy of it.

        Non-source ranks pass a tensor of the same shape and dtype (its values are unused).

        Raises:
            ValueError: ``src`` is not a rank of ``group``.
        """

    @abstractmethod
    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        """Start a batch of sends and receives so that no ordering of the batch among
        the peers deadlocks; returns one Work per op, in order: a send's ``wait()``
        returns ``None``, a receive's the received tensor (its buffer itself, filled,
        where the framework receives in place). A send reads its tensor itself (no copy,
        as the frameworks' own ``isend``) until its ``wait()``: the caller must not write
        it before then.

        Raises:
            ValueError: an op's peer is this rank or outside its group.
        """
