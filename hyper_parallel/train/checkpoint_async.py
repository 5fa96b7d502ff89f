"""Asynchronous checkpoints (``--async-checkpoint``): the training thread snapshots the
state to host memory and makes the checkpoint's folder; a background thread writes the
files while training continues, as ``torch.distributed.checkpoint.async_save`` does.

[Note: asynchronous save]
``AsyncCheckpointer.save`` runs step 1 of [Note: atomic checkpoints] in ``checkpoint``
(the temporary folder) on the training thread, with the state already copied to numpy
(``loop.checkpoint_pieces``: host copies that training does not touch), then returns; a
writer thread per rank runs steps 2 and 3 (this rank's index file, the pieces it owns
from the lower ranks' index files, its safetensors file and its mark) and, on rank 0,
step 4 (it waits for every rank's mark, writes the index and renames the folder),
coordinating through files in the shared folder. So the background thread issues no
collective: the one collective below stays on the training thread, ordered with the
step's own collectives (no separate process group is needed), and a checkpoint becomes
complete as soon as the last rank's file is written, not at a later collective.
At most one save is in flight: ``save`` and ``wait`` first join the previous writer and
then agree, by one **all-reduce** (sum of failure flags) on the training thread, whether
it failed on any rank; if so every rank raises the same ``RuntimeError``. In ``save`` that
all-reduce is also step 1's collective (rank 0 makes the new folder just before it), so a
save costs the training thread one collective besides the host copy. The job waits
for the last save before it returns (``loop.train``). A writer that fails (or a process
killed mid-write) leaves its step's ``.tmp`` folder, never an index: the previous complete
checkpoint stays the newest one that loads.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.platform import Platform
from hyper_parallel.train import checkpoint


class AsyncCheckpointer:
    """One rank's background checkpoint writer (see [Note: asynchronous save]).

    Collectives: ``save`` and ``wait`` are collective over the ``world`` ranks (every rank
    calls them at the same steps): barriers and one all-reduce, on the calling thread."""

    def __init__(self, p: Platform | None, world: int, rank: int) -> None:
        self._p = p
        self._world = world
        self._rank = rank
        self._thread: threading.Thread | None = None  # the writer of the last save while it runs
        self._step: int | None = None                  # the last save's step
        self._error: BaseException | None = None       # what its writer raised on this rank
        self._agreed = True                            # whether the ranks agreed on its outcome
        #: seconds each ``save`` blocked the caller (the stall per checkpoint, without the host copy)
        self.stalls: list[float] = []
        #: seconds each background write took on this rank (file, mark, and on rank 0 the commit)
        self.write_seconds: list[float] = []

    @property
    def in_flight(self) -> bool:
        """Whether a writer is still running (this rank only)."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, root: Path, step: int, pieces: dict[str, checkpoint.Piece], meta: dict[str, Any],
             keep: int = checkpoint.KEEP) -> None:
        """Start the checkpoint of ``step`` (``checkpoint.save``'s arguments; ``pieces``:
        host copies the caller no longer changes) and return while it is written. Waits
        for the previous save first. Collective: one all-reduce, which both reports the
        previous save's outcome and ends step 1 (rank 0 made the folder before it).

        Raises:
            RuntimeError: the previous save failed on some rank (every rank raises).
        """
        began = time.perf_counter()
        self._join()
        pending = checkpoint.begin_save(self._p, root, step, pieces, meta, self._world, self._rank,
                                        agree=self._agree, keep=keep)
        self._error, self._step, self._agreed = None, step, False
        self._thread = threading.Thread(target=self._write, args=(pending,), name=f"checkpoint-step-{step}",
                                        daemon=True)  # a crashing job does not wait for it: its save stays .tmp
        self._thread.start()
        self.stalls.append(time.perf_counter() - began)

    def _write(self, pending: checkpoint.PendingSave) -> None:
        began = time.perf_counter()
        try:
            checkpoint.write_pending(pending)
            if pending.rank == 0:
                checkpoint.commit(pending)
            self.write_seconds.append(time.perf_counter() - began)
        except BaseException as err:  # re-raised on the training thread by _agree
            self._error = err

    def wait(self) -> None:
        """Block until the last save (if not waited for yet) is written on every rank and
        complete. Collective: one all-reduce when there is such a save.

        Raises:
            RuntimeError: the save failed on some rank: every rank raises, naming the
                ranks; this rank's own error is chained. The previous checkpoint stays
                the newest complete one.
        """
        if self._agreed:
            return
        self._join()
        self._agree()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _agree(self) -> None:
        """One all-reduce (sum) of per-rank failure flags of the last save (all zero before
        the first), after ``_join``; raises on every rank if any is set."""
        failed = np.zeros(self._world, np.float64)
        failed[self._rank] = self._error is not None
        if self._world > 1:
            assert self._p is not None
            failed = self._p.to_numpy(self._p.all_reduce(self._p.from_numpy(failed), "sum").wait())
        self._agreed = True
        error, self._error = self._error, None
        if failed.any():
            ranks = [r for r in range(self._world) if failed[r]]
            mine = f": {type(error).__name__}: {error}" if error is not None else " wrote its part"
            raise RuntimeError(f"--async-checkpoint: the checkpoint of step {self._step} failed on rank(s) {ranks} "
                               f"(rank {self._rank}{mine}); it was left incomplete and the previous checkpoint is "
                               "the newest complete one (resume from it with --resume)") from error
