"""The global gradient norm of a model laid out over ranks, and clipping by it
(``--max-norm``; Pascanu et al., "On the difficulty of training recurrent neural
networks", 2013, as every LLM recipe uses it: torchtitan's default ``max_norm`` is 1.0).

[Note: the global gradient norm of pieces]
Each rank holds, for each parameter, one piece of the gradient: its box in the global
tensor (``local_boxes``: the fully_shard chunk inside the tensor-parallel chunk; the whole
tensor when neither shards; pipeline stages hold only their own parameters). Several ranks
hold the same box (replicas: data-parallel replicate, context parallelism, a parameter
that tensor parallelism replicates). The squared global norm is the sum over distinct
pieces of their squared norms, so each rank adds ``|piece|^2 / holders`` (``holders``: the
ranks holding that same box) and one **all-reduce** (sum) over the world gives it. The
holders are counted once, when the run starts (an all-gather of a hash of each
``(name, box)``). Each local gradient is exactly its piece (fully_shard's chunks carry
no padding). The same arithmetic runs on both frameworks, and on one
rank (the single-process reference) it is the plain norm.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from hyper_parallel.core.fully_shard import Box
from hyper_parallel.platform import Platform
from hyper_parallel.core.tensor_ops import stack


def _piece_id(name: str, box: Box) -> float:
    """A 48-bit hash of ``(name, box)``, exact in float64 (what the all-gather moves)."""
    digest = hashlib.blake2b(repr((name, box.shape, box.starts, box.lengths)).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


class GlobalGradNorm:
    """The L2 norm over every parameter's whole gradient, from this rank's pieces.

    Args:
        p: the platform.
        names: the name of each parameter, in the order gradients will be given.
        boxes: ``{name: Box}`` of this rank's piece of each parameter.
        world: the number of ranks of the run (1: no communication at all).

    Collectives: at construction an **all-reduce** (max) and an **all-gather** over the
    world; per call one **all-reduce** (sum) of a float32 scalar.
    """

    def __init__(self, p: Platform, names: Sequence[str], boxes: dict[str, Box], world: int) -> None:
        self._p = p
        self._world = world
        ids = [_piece_id(name, boxes[name]) for name in names]
        self._holders = [1] * len(ids)
        if world > 1:
            count = p.all_reduce(p.from_numpy(np.asarray([len(ids)], np.float64)), "max").wait()
            width = int(p.to_numpy(count)[0])
            mine = np.full(max(width, 1), -1.0, np.float64)
            mine[:len(ids)] = ids
            everyone = Counter(p.to_numpy(p.all_gather_into_tensor(p.from_numpy(mine)).wait()).tolist())
            self._holders = [everyone[i] for i in ids]

    def __call__(self, grads: Sequence[Any]) -> float:
        """The global norm of ``grads`` (one per name, local pieces; float32 arithmetic)."""
        p = self._p
        float32 = p.dtype("float32")
        terms = []
        for grad, holders in zip(grads, self._holders):
            g = p.to_dtype(grad, float32)
            terms.append((g * g).sum() * (1.0 / holders))
        total = stack(terms).sum() if terms else p.zeros((), float32)
        if self._world > 1:
            total = p.all_reduce(total, "sum").wait()
        return float(np.sqrt(max(float(p.to_numpy(total)), 0.0)))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor gradients are scaled by: ``max_norm / (norm + 1e-6)`` when that is
    below 1 (torch's ``clip_grad_norm_`` rule), else 1; ``max_norm = 0`` never clips."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
