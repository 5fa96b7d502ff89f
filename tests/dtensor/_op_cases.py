"""Op cases for the DTensor sharding-rule tests: each op of ``OP_RULES`` (and the
functional wrappers built on them) with input shapes that exercise broadcasting, even
shards (the ``_even`` cases, sizes 4 and 8), uneven ones (7 rows over 2 and 4 ranks) and
empty ones (3 rows over 4 ranks)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor import Partial, Placement, Replicate, Shard
from hyper_parallel.core.dtensor import functional as F


@dataclass(frozen=True)
class OpCase:
    """``fn(*tensors)`` on inputs of ``shapes``; ``ints`` marks integer inputs (values
    in ``[0, high)``); ``positive`` makes float inputs positive (log, sqrt, divisors)."""

    name: str
    fn: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    ints: tuple[int, ...] = ()
    high: int = 9
    positive: bool = False


CASES: tuple[OpCase, ...] = (
    OpCase("add", lambda a, b: a + b, ((7, 5), (7, 5))),
    OpCase("mul_even", lambda a, b: a * b, ((8, 4), (8, 4))),
    OpCase("add_broadcast", lambda a, b: F.add(a, b), ((7, 1, 5), (3, 1))),
    OpCase("add_scalar", lambda a: 1.5 + a, ((7, 5),)),
    OpCase("sub", lambda a, b: a - b, ((7, 5), (5,))),
    OpCase("rsub_scalar", lambda a: 2.0 - a, ((7, 5),)),
    OpCase("mul", lambda a, b: a * b, ((3, 7), (7,))),
    OpCase("mul_scalar", lambda a: a * 3.0, ((7, 5),)),
    OpCase("div", lambda a, b: a / b, ((7, 5), (7, 1)), positive=True),
    OpCase("rdiv_scalar", lambda a: 2.0 / a, ((7, 5),), positive=True),
    OpCase("neg", lambda a: -a, ((7, 5),)),
    OpCase("pow", lambda a: a ** 2, ((7, 5),)),
    OpCase("exp_log", lambda a: F.log(a) + F.exp(a * 0.5), ((7, 5),), positive=True),
    OpCase("rsqrt_sqrt", lambda a: F.rsqrt(a) * F.sqrt(a + 1.0), ((7, 5),), positive=True),
    OpCase("activations", lambda a: F.silu(a) + F.gelu(a) + F.relu(a) + F.sigmoid(a) + F.tanh(a), ((7, 5),)),
    OpCase("matmul", lambda a, b: a @ b, ((7, 5), (5, 6))),
    OpCase("matmul_even", lambda a, b: a @ b, ((8, 4), (4, 8))),
    OpCase("matmul_batched", lambda a, b: F.matmul(a, b), ((3, 7, 5), (5, 6))),
    OpCase("bmm", lambda a, b: F.bmm(a, b), ((3, 7, 5), (3, 5, 6))),
    OpCase("linear", lambda x, w, b: F.linear(x, w, b), ((3, 7, 5), (6, 5), (6,))),
    OpCase("linear_no_bias", lambda x, w: F.linear(x, w), ((7, 5), (6, 5))),
    OpCase("linear_even", lambda x, w, b: F.linear(x, w, b), ((2, 4, 8), (4, 8), (4,))),
    OpCase("embedding", lambda i, w: F.embedding(i, w), ((3, 7), (9, 5)), ints=(0,)),
    OpCase("sum_all", lambda a: a.sum(), ((7, 5),)),
    OpCase("sum_dim", lambda a: F.sum(a, 1), ((3, 7, 5),)),
    OpCase("sum_keepdim", lambda a: a.sum((0, 2), keepdim=True), ((3, 7, 5),)),
    OpCase("mean", lambda a: a.mean(-1, keepdim=True), ((7, 5),)),
    OpCase("mean_all", lambda a: a.mean(), ((7, 5),)),
    OpCase("amax", lambda a: a.amax(1), ((7, 5),)),
    OpCase("softmax", lambda a: F.softmax(a, -1), ((3, 7, 5),)),
    OpCase("softmax_even", lambda a: F.softmax(a, 0), ((4, 8),)),
    OpCase("log_softmax", lambda a: F.log_softmax(a, 0), ((7, 5),)),
    OpCase("cross_entropy_mean", lambda x, t: F.cross_entropy(x, t), ((7, 5), (7,)), ints=(1,), high=5),
    OpCase("cross_entropy_sum", lambda x, t: F.cross_entropy(x, t, "sum"), ((7, 5), (7,)), ints=(1,), high=5),
    OpCase("cross_entropy_none", lambda x, t: F.cross_entropy(x, t, "none"), ((7, 5), (7,)), ints=(1,), high=5),
    OpCase("transpose", lambda a: a.transpose(0, 2), ((3, 7, 5),)),
    OpCase("permute", lambda a: a.permute(2, 0, 1), ((3, 7, 5),)),
    OpCase("reshape_merge", lambda a: a.reshape(7, 12), ((7, 4, 3),)),
    OpCase("reshape_split", lambda a: a.view(2, -1, 3), ((8, 6),)),
    OpCase("reshape_heads", lambda a: a.reshape(3, 4, 2, 5), ((3, 4, 10),)),
    OpCase("reshape_ones", lambda a: a.reshape(7, 1, 5), ((7, 5),)),
)


def input_values(case: OpCase, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    values = []
    for i, shape in enumerate(case.shapes):
        if i in case.ints:
            values.append(rng.integers(0, case.high, shape).astype(np.int64))
        else:
            value = rng.standard_normal(shape)
            values.append(np.abs(value) + 0.5 if case.positive else value)
    return values


def placement_options(ndim: int, integer: bool) -> list[Placement]:
    """Per mesh axis: each Shard, Replicate, and (for float inputs) Partial('sum')."""
    options: list[Placement] = [Shard(d) for d in range(ndim)] + [Replicate()]
    return options if integer else options + [Partial("sum")]


def placement_combos(case: OpCase, mesh_ndim: int) -> list[tuple[tuple[Placement, ...], ...]]:
    """Every assignment of per-axis placements to every input."""
    per_input = [list(itertools.product(placement_options(len(s), i in case.ints), repeat=mesh_ndim))
                 for i, s in enumerate(case.shapes)]
    return list(itertools.product(*per_input))


def sample(combos: Sequence[Any], count: int, seed: int) -> list[Any]:
    if len(combos) <= count:
        return list(combos)
    picks = np.random.default_rng(seed).choice(len(combos), count, replace=False)
    return [combos[i] for i in sorted(picks)]
