"""torch-cpu's causal split for threads ([Note: CPU causal thread balance] in
``platform/torch/cpu_attention``): forward and backward equal the float64 reference
exactly (float64 in, 1e-10) and the unsplit kernel call (bfloat16), over batch rows,
grouped-query heads and both causal alignments of a square call. World size 1; runs only
with HYPER_PARALLEL_PLATFORM=torch-cpu."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.contract.attention import AttentionMask
from tests.platform_contract._attention_reference import allowed_pairs, reference

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "torch-cpu") != "torch-cpu",
                                reason="torch CPU kernel test; set HYPER_PARALLEL_PLATFORM=torch-cpu")

S, D = 1024, 16
#: (batch, heads, kv_heads, causal form)
SHAPES = [(1, 1, 1, "top_left"), (2, 2, 1, "bottom_right"), (1, 3, 3, "top_left")]


def check_split(threads: int) -> list[bool]:
    """Every shape on ``threads`` threads; whether each ran split."""
    import torch

    from hyper_parallel.platform.torch import cpu_attention as cpu

    p = get_platform()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    split = []
    try:
        rng = np.random.default_rng(5)
        for b, h, kv, causal in SHAPES:
            mask = AttentionMask(causal)
            arrays = [rng.standard_normal((b, S, n, D)) for n in (h, kv, kv, h)]
            q, k, v, dout = (torch.from_numpy(a) for a in arrays)
            split.append(cpu.balanced(q, k, mask))
            out, lse = p.attention(q, k, v, scale=0.25, mask=mask)
            grads = p.attention_backward(dout, q, k, v, out, lse, scale=0.25, mask=mask)
            want = reference(*arrays, allowed_pairs(S, S, mask), 0.25)
            for what, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
                np.testing.assert_allclose(got.numpy(), ref, rtol=1e-10, atol=1e-10, err_msg=f"{what} {b, h, kv}")
            # bfloat16: the split equals one unsplit kernel call to bfloat16 rounding
            bq, bk, bv, bdo = (t.to(torch.bfloat16) for t in (q, k, v, dout))
            out, lse = p.attention(bq, bk, bv, scale=0.25, mask=mask)
            grads = p.attention_backward(bdo, bq, bk, bv, out, lse, scale=0.25, mask=mask)
            one_out, one_lse = cpu.forward_kernel(0.25)(bq, bk, bv, True)
            one = cpu.backward_kernel(0.25)(bdo, bq, bk, bv, one_out, one_lse, True)
            # The float32 log-sum-exps differ by summation order only (the split merges two
            # partial sums); outputs and gradients are bfloat16 (8 mantissa bits, ~4e-3
            # relative) rounded once more where the split adds shares (gradients ~3).
            np.testing.assert_allclose(lse.numpy(), one_lse.numpy(), rtol=1e-5, atol=1e-5)
            for got, ref in zip((out, *grads), (one_out, *one)):
                np.testing.assert_allclose(got.float().numpy(), ref.float().numpy(), rtol=3e-2, atol=3e-2)
    finally:
        torch.set_num_threads(before)
    return split


def check_split_global_statistics(threads: int) -> bool:
    """Ring attention's identity through the split: a square causal block's backward given
    the output and log-sum-exp over more keys (a full block before it) is that block's
    share: with the full block's share it adds up to the reference gradients (float64)."""
    import torch

    from hyper_parallel.platform.torch import cpu_attention as cpu

    p = get_platform()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(8)
        before_keys = 96
        q, dout = (rng.standard_normal((1, S, 2, D)) for _ in range(2))
        k, v = (rng.standard_normal((1, before_keys + S, 1, D)) for _ in range(2))
        allowed = np.concatenate([np.ones((S, before_keys), bool), allowed_pairs(S, S, AttentionMask("top_left"))], 1)
        out, lse, dq, dk, dv = reference(q, k, v, dout, allowed, 0.25)
        tq, tk, tv, tdo, tout, tlse = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v, dout, out, lse))
        own = AttentionMask("top_left")
        split = cpu.balanced(tq, tk[:, before_keys:], own)
        g_own = p.attention_backward(tdo, tq, tk[:, before_keys:], tv[:, before_keys:], tout, tlse, scale=0.25,
                                     mask=own)
        g_full = p.attention_backward(tdo, tq, tk[:, :before_keys], tv[:, :before_keys], tout, tlse, scale=0.25)
        np.testing.assert_allclose((g_own[0] + g_full[0]).numpy(), dq, rtol=1e-10, atol=1e-10)
        for got_own, got_full, ref in ((g_own[1], g_full[1], dk), (g_own[2], g_full[2], dv)):
            np.testing.assert_allclose(torch.cat([got_full, got_own], 1).numpy(), ref, rtol=1e-10, atol=1e-10)
    finally:
        torch.set_num_threads(before)
    return split


def test_split_takes_global_statistics(run_on_ranks) -> None:
    assert run_on_ranks(check_split_global_statistics, 8, world_size=1)[0]


def test_split_matches_reference(run_on_ranks) -> None:
    assert run_on_ranks(check_split, 8, world_size=1)[0] == [True, True, True]


def test_enough_heads_run_whole(run_on_ranks) -> None:
    assert run_on_ranks(check_split, 1, world_size=1)[0] == [False, False, False]


def check_local_attention() -> list[str]:
    """``Platform.local_attention``: torch's SDPA autograd where torch runs its flash
    kernel, the derived function where it would run math (forced here); both equal the
    float64 reference. Returns the autograd nodes."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = get_platform()
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal((2, 9, n, 8)) for n in (4, 2, 2, 4)]
    want = reference(*arrays, allowed_pairs(9, 9, AttentionMask("top_left")), 8 ** -0.5)
    nodes = []
    for backends in ([SDPBackend.FLASH_ATTENTION], [SDPBackend.MATH]):
        q, k, v = (torch.from_numpy(a).requires_grad_(True) for a in arrays[:3])
        with sdpa_kernel(backends):
            out = p.local_attention(q, k, v, is_causal=True)
        node = out.grad_fn
        if type(node).__name__.startswith("Transpose"):  # BSHD views of torch's BHSD result
            node = node.next_functions[0][0]
        nodes.append(type(node).__name__)
        out.backward(torch.from_numpy(arrays[3]))
        for what, got, ref in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (want[0], *want[2:])):
            np.testing.assert_allclose(got.detach().numpy(), ref, rtol=1e-10, atol=1e-10, err_msg=f"{what} {backends}")
    return nodes


def test_local_attention_runs_torch_sdpa(run_on_ranks) -> None:
    flash, math = run_on_ranks(check_local_attention, world_size=1)[0]
    assert flash.startswith("ScaledDotProductFlashAttentionForCpu"), flash
    assert "LocalAttention" in math, math
