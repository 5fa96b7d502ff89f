"""Conformance: bad input raises a clear error on every rank before any communication.

Each rank provokes the error, catches it, then joins a healthy all-reduce: had any rank
issued the broken collective, its peers would be waiting inside it and the all-reduce
would fail or time out.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.platform import P2POp, get_platform
from tests.platform_contract._data import rank_data
from hyper_parallel.core.process_groups import split_group


def _cases(p):
    f32 = p.dtype("float32")
    n, r = p.world_size(), p.rank()
    x = p.from_numpy(rank_data(r, (5, 3)))
    cases = {
        "unknown reduce op": (lambda: p.all_reduce(x, "median"), ["op='median'", "'sum'"]),
        "avg of integers": (lambda: p.all_reduce(p.arange(0, 4, p.dtype("int64")), "avg"), ["avg", "floating"]),
        "reduce_scatter max": (lambda: p.reduce_scatter_tensor(p.zeros((2 * n, 3), f32), "max"),
                               ["op='max'", "'sum' or 'avg'"]),
        "split sizes do not add up": (lambda: p.all_to_all_single(x, [1] * n, [1] * n),
                                      ["input_split_sizes", f"sums to {n}", "5 rows"]),
        "split sizes wrong length": (lambda: p.all_to_all_single(x, [5], [5, 0, 0, 0, 0, 0]),
                                     ["6 entries", f"({n})"]),
        "negative split size": (lambda: p.all_to_all_single(x, [-1] + [0] * (n - 1), [5] + [0] * (n - 1)),
                                ["output_split_sizes", "-1"]),
        "broadcast src outside": (lambda: p.broadcast(x, n), [f"src={n}", f"[0, {n})"]),
        "send to self": (lambda: p.batch_isend_irecv([P2POp("isend", x, r)]), [f"peer={r}", "this rank itself"]),
        "recv from outside": (lambda: p.batch_isend_irecv([P2POp("irecv", x, n + 3)]),
                              [f"peer={n + 3}", "not a rank of the group"]),
        "batch peer outside": (lambda: p.batch_isend_irecv([P2POp("irecv", x, n)]), ["P2POp.peer", f"{n}"]),
        "bad p2p op": (lambda: P2POp("send", x, 0), ["P2POp.op='send'", "'isend' or 'irecv'"]),
        "group rank outside": (lambda: p.create_group([0, n]), [f"[0, {n}]", f"[0, {n})"]),
        "group repeats rank": (lambda: p.create_group([0, 0]), ["repeats"]),
        "partition misses rank": (lambda: split_group([[0]] if n > 1 else [[]]), ["partition"]),
        "differentiable all_reduce max": (lambda: p.differentiable_all_reduce(x, "max"), ["'max'", "no gradient"]),
        "dim out of range": (lambda: p.differentiable_all_gather(x, 2), ["dim=2", "2-D"]),
        "gather 0-d": (lambda: p.all_gather_into_tensor(p.zeros((), f32)), ["0-dimensional"]),
        "attention shapes": (lambda: p.attention(x, x, x), ["[batch, seq, heads, head_dim]"]),
    }
    if n > 1:  # with one rank every size divides and every split is even
        cases["reduce_scatter indivisible"] = (lambda: p.reduce_scatter_tensor(p.zeros((2 * n + 1, 3), f32)),
                                               [f"{2 * n + 1}", f"group size {n}"])
        cases["all_to_all indivisible"] = (lambda: p.differentiable_all_to_all(x, 0, 1), ["tensor.shape[0]", "5"])
        uneven = [2] + [0] * (n - 1)
        cases["uneven a2a across dims"] = (lambda: p.differentiable_all_to_all(
            p.zeros((2, n), f32), 0, 1, None, uneven, uneven), ["split_dim == concat_dim"])
    return cases


def check_bad_inputs() -> dict[str, str]:
    p = get_platform()
    messages: dict[str, str] = {}
    for name, (call, needles) in _cases(p).items():
        try:
            call()
        except (ValueError, TypeError) as err:
            message = str(err)
            missing = [needle for needle in needles if needle not in message]
            assert not missing, f"{name}: message {message!r} lacks {missing}"
            messages[name] = message
        else:
            raise AssertionError(f"{name}: no error raised")
    # Every rank is still in step: nothing was issued by the calls above.
    total = p.all_reduce(p.from_numpy(np.ones(1, np.float32))).wait()
    assert float(p.to_numpy(total)[0]) == p.world_size()
    return messages


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bad_input_raises_before_any_collective(run_on_ranks, world_size: int) -> None:
    results = run_on_ranks(check_bad_inputs, world_size=world_size)
    assert all(set(res) == set(results[0]) for res in results)
