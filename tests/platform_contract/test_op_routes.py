"""One route per op: the same op on DTensors reaches the same rule of core on every
backend ([Note: recorded rules] in ``core/op_entry.py``). The backends differ in how they
intercept (torch below autograd, one aten op at a time; MindSpore above it, one primitive
at a time), but each only names the op and hands it over; core plans it. This test runs
the same user-level ops, written with each framework's own functions, on a DTensor sharded
over 2 ranks, records the rules core planned them with, and checks the list against one
table for every backend: a backend that planned an op itself, or routed it to another
rule, fails here on its own matrix run (``ci/run_matrix.py`` then also checks that the
test passes on every backend).

Where the frameworks themselves decompose a function differently before anything reaches
a DTensor class, the table says so per framework, with the reason.
"""

from __future__ import annotations

import numpy as np

from hyper_parallel.platform import get_platform

#: op -> the rules core plans it with, on every backend
ROUTES: dict[str, list[str]] = {
    "add": ["add"],
    "mul by a number": ["mul"],
    "sum over a dim": ["sum"],
    # the sum over the global count, an exact mean of uneven shards, on both backends
    "mean over a dim": ["sum"],
    "softmax": ["softmax"],
    "transpose": ["transpose"],
    "reshape": ["view"],
    "matmul": ["matmul"],
    "cat": ["cat"],
    "split": ["split"],
    "silu": ["silu"],
}

#: op -> {framework: rules}: where the framework decomposes the function before its
#: DTensor class sees it
FRAMEWORK_ROUTES: dict[str, dict[str, list[str]]] = {
    # torch's F.linear is a composite function: autograd sees t + mm; MindSpore calls
    # its fused Dense primitive, whose rule is linear
    "linear": {"torch": ["transpose", "matmul"], "mindspore": ["linear"]},
    # (a vector norm is not listed: MindSpore 2.10's CPU has no LinalgVectorNorm kernel)
}


def _ops(framework: str) -> dict:
    """op -> a function of (x [4, 6] Shard(0), y [4, 6] Shard(0), w [6, 8] Shard(1),
    v [8, 6] Shard(0): a linear layer's weight)."""
    if framework == "torch":
        import torch
        import torch.nn.functional as F

        return {
            "add": lambda x, y, w, v: x + y,
            "mul by a number": lambda x, y, w, v: x * 2.0,
            "sum over a dim": lambda x, y, w, v: x.sum(1),
            "mean over a dim": lambda x, y, w, v: x.mean(1),
            "softmax": lambda x, y, w, v: torch.softmax(x, -1),
            "transpose": lambda x, y, w, v: x.transpose(0, 1),
            "reshape": lambda x, y, w, v: x.reshape(4, 2, 3),
            "matmul": lambda x, y, w, v: torch.mm(x, w),
            "cat": lambda x, y, w, v: torch.cat([x, y], 1),
            "split": lambda x, y, w, v: torch.split(x, 3, 1),
            "silu": lambda x, y, w, v: F.silu(x),
            "linear": lambda x, y, w, v: F.linear(x, v),
        }
    from mindspore import mint

    return {
        "add": lambda x, y, w, v: x + y,
        "mul by a number": lambda x, y, w, v: x * 2.0,
        "sum over a dim": lambda x, y, w, v: mint.sum(x, 1),
        "mean over a dim": lambda x, y, w, v: mint.mean(x, 1),
        "softmax": lambda x, y, w, v: mint.nn.functional.softmax(x, -1),
        "transpose": lambda x, y, w, v: mint.transpose(x, 0, 1),
        "reshape": lambda x, y, w, v: mint.reshape(x, (4, 2, 3)),
        "matmul": lambda x, y, w, v: mint.matmul(x, w),
        "cat": lambda x, y, w, v: mint.cat([x, y], 1),
        "split": lambda x, y, w, v: mint.split(x, 3, 1),
        "silu": lambda x, y, w, v: mint.nn.functional.silu(x),
        "linear": lambda x, y, w, v: mint.nn.functional.linear(x, v),
    }


def check_routes() -> dict[str, list[str]]:
    """The rules each op reached on this rank (forward only: each framework records its
    backward differently, and the backward's rules follow the forward's)."""
    from hyper_parallel.core.dtensor import Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.core.op_entry import recorded_rules

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    rng = np.random.default_rng(0)
    x, y = (distribute_tensor(p.from_numpy(rng.standard_normal((4, 6)).astype(np.float32)), mesh, [Shard(0)])
            for _ in range(2))
    w = distribute_tensor(p.from_numpy(rng.standard_normal((6, 8)).astype(np.float32)), mesh, [Shard(1)])
    v = distribute_tensor(p.from_numpy(rng.standard_normal((8, 6)).astype(np.float32)), mesh, [Shard(0)])
    seen = {}
    for name, fn in _ops(p.framework).items():
        with recorded_rules() as rules:
            fn(x, y, w, v)
        seen[name] = list(rules)
    return seen


def test_each_op_reaches_one_rule_on_every_backend(run_on_ranks) -> None:
    framework = get_platform().framework
    for seen in run_on_ranks(check_routes, world_size=2):
        want = dict(ROUTES)
        want.update({name: routes[framework] for name, routes in FRAMEWORK_ROUTES.items()})
        assert seen == want, {name: (seen.get(name), want.get(name)) for name in want if seen.get(name) != want[name]}


def check_attention_route() -> list[str]:
    """The rules a fused attention on head-sharded q/k/v ``[batch, heads, seq, head_dim]``
    reached (tensor parallelism's attention): torch's SDPA below autograd, MindSpore's
    ``FlashAttentionScore`` primitive above it."""
    from hyper_parallel.core.dtensor import Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.core.op_entry import recorded_rules

    p = get_platform()
    mesh = init_device_mesh(p.device_type, (2,))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((2, 4, 8, 16)).astype(np.float32) for _ in range(3)]
    q, k, v = (distribute_tensor(p.from_numpy(a), mesh, [Shard(1)]) for a in arrays)
    with recorded_rules() as rules:
        if p.framework == "torch":
            import torch.nn.functional as F

            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            import mindspore as ms

            out = ms.ops.flash_attention_score(q, k, v, 4, input_layout="BNSD", scalar_value=0.25, sparse_mode=2,
                                               attn_mask=None)
    assert list(out.placements) == [Shard(1)], out.placements
    return list(rules)


def test_head_sharded_attention_reaches_the_attention_rule_on_every_backend(run_on_ranks) -> None:
    """issue 34 item 2: both frameworks' fused attention on head-sharded DTensors is planned by
    one rule of core, ``scaled_dot_product_attention`` (each rank attends its own heads)."""
    for seen in run_on_ranks(check_attention_route, world_size=2):
        assert seen == ["scaled_dot_product_attention"], seen
