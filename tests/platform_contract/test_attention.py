"""Conformance: ``attention`` and ``attention_backward``, the fused kernels, on every backend,
against a float64 numpy reference: outputs, log-sum-exp and q/k/v gradients for every mask
form (none, top-left and bottom-right causal on square and non-square shapes, packed
documents with an empty side), grouped-query attention, a query that sees no key, and
the backward given the statistics of a larger key set (what ring attention does).
World size 1.

Tolerances: float64 inputs are computed in float64 end to end (the contract), so they
agree with the reference to float64 rounding of sums of O(1) values: 1e-10. float32:
one rounding per product of O(1) values over a few keys, 1e-5 (MindSpore's CPU ``exp`` is
approximate to ~3e-6 relative: 5e-5). bfloat16 (8 mantissa bits): 3e-2 against the
reference of the bfloat16-rounded inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.platform import AttentionMask, get_platform
from tests.platform_contract._attention_reference import allowed_pairs, reference
from hyper_parallel.core.tensor_ops import dtype_name

B, H, D = 2, 4, 8


#: (name, q_seq, kv_seq, mask)
CASES = [
    ("full", 7, 9, AttentionMask()),
    ("top_left_square", 9, 9, AttentionMask("top_left")),
    ("top_left_wide", 5, 9, AttentionMask("top_left")),
    ("top_left_tall", 9, 5, AttentionMask("top_left")),
    ("bottom_right_wide", 5, 9, AttentionMask("bottom_right")),
    ("bottom_right_tall", 9, 5, AttentionMask("bottom_right")),  # the first 4 queries see no key
    ("documents", 9, 9, AttentionMask("none", (0, 3, 9), (0, 4, 9))),
    ("documents_causal_empty", 9, 7, AttentionMask("bottom_right", (0, 2, 5, 5, 9), (0, 3, 3, 6, 7))),
    ("documents_top_left", 8, 8, AttentionMask("top_left", (0, 3, 8), (0, 3, 8))),
]


def _dtype_tol(p, dtype: str) -> dict[str, float]:
    """Tolerances per result (``out``, ``lse``, ``grad``) for ``dtype``."""
    if dtype == "float64":
        return dict.fromkeys(("out", "lse", "grad"), 1e-10)
    if dtype == "float32":
        return dict.fromkeys(("out", "lse", "grad"), 5e-5 if p.framework == "mindspore" else 1e-5)
    # Half inputs: the reference is fed the rounded inputs; what remains is the rounding
    # of the output (bfloat16: 8 mantissa bits, ~4e-3 relative; float16: 11 bits, ~5e-4)
    # and of the probabilities a kernel multiplies V by in the input dtype; gradients of
    # magnitude ~3 go through the rounded output and dout. The float32 lse sees only the
    # inputs' products: a few ulps of the inputs.
    if dtype == "bfloat16":
        return {"out": 3e-2, "lse": 1e-2, "grad": 5e-2}
    return {"out": 5e-3, "lse": 2e-3, "grad": 1e-2}


def check_kernels(dtype: str) -> int | str:
    """Every case on ``dtype``; the count of cases checked, or the backend's refusal of
    ``dtype`` (a kernel that does not take it, e.g. float64 on CUDA)."""
    p = get_platform()
    half = dtype in ("bfloat16", "float16")
    probe = p.to_dtype(p.from_numpy(np.zeros((1, 2, 1, D), np.float32)), p.dtype(dtype))
    try:
        p.check_attention(probe, probe, probe)
    except ValueError as err:
        return f"{p.name} does not take {dtype}: {err}"
    rng = np.random.default_rng(3)
    checked = 0
    for kv_heads in (H, 2, 1):
        for name, sq, sk, mask in CASES:
            label = f"{name} kv_heads={kv_heads} {dtype}"
            arrays = [rng.standard_normal((B, s, h, D)) for s, h in ((sq, H), (sk, kv_heads), (sk, kv_heads), (sq, H))]
            tq, tk, tv, tdo = (p.to_dtype(p.from_numpy(a.astype(np.float32 if half else np.float64)), p.dtype(dtype))
                               for a in arrays)
            q, k, v, dout = (p.to_numpy(t).astype(np.float64) for t in (tq, tk, tv, tdo))  # as rounded
            scale = 0.3
            allowed = allowed_pairs(sq, sk, mask)
            want = reference(q, k, v, dout, allowed, scale)
            out, lse = p.attention(tq, tk, tv, scale=scale, mask=mask)
            lse_dtype = "float32" if half else dtype
            assert dtype_name(out.dtype) == dtype and tuple(out.shape) == (B, sq, H, D), label
            assert dtype_name(lse.dtype) == lse_dtype and tuple(lse.shape) == (B, H, sq), label
            tol = _dtype_tol(p, dtype)
            got_lse = p.to_numpy(lse)
            dead = np.isneginf(want[1])
            assert (np.isneginf(got_lse) == dead).all(), f"lse -inf rows: {label}"
            np.testing.assert_allclose(got_lse[~dead], want[1][~dead], rtol=tol["lse"], atol=tol["lse"],
                                       err_msg=f"lse: {label}")
            np.testing.assert_allclose(p.to_numpy(out), want[0], rtol=tol["out"], atol=tol["out"],
                                       err_msg=f"out: {label}")
            grads = p.attention_backward(tdo, tq, tk, tv, out, lse, scale=scale, mask=mask)
            for what, got, ref, like in zip(("dq", "dk", "dv"), grads, want[2:], (q, k, v)):
                assert dtype_name(got.dtype) == dtype, f"{what} dtype: {label}"
                got = p.to_numpy(got)
                assert got.shape == like.shape and np.isfinite(got).all(), f"{what}: {label}"
                np.testing.assert_allclose(got, ref, rtol=tol["grad"], atol=tol["grad"], err_msg=f"{what}: {label}")
            checked += 1
    return checked


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_kernels_match_reference(run_on_ranks, dtype: str) -> None:
    result = run_on_ranks(check_kernels, dtype, world_size=1)[0]
    if isinstance(result, str):
        pytest.skip(result)
    assert result == 3 * len(CASES)


def check_bfloat16() -> None:
    p = get_platform()
    rng = np.random.default_rng(4)
    bf16 = p.dtype("bfloat16")
    q, k, v, dout = (p.to_dtype(p.from_numpy(rng.standard_normal((B, 12, h, D)).astype(np.float32)), bf16)
                     for h in (H, 2, 2, H))
    want = reference(*(p.to_numpy(t) for t in (q, k, v, dout)), allowed_pairs(12, 12, AttentionMask("top_left")),
                     D ** -0.5)
    out, lse = p.attention(q, k, v, mask=AttentionMask("top_left"))
    assert dtype_name(out.dtype) == "bfloat16" and dtype_name(lse.dtype) == "float32"
    # bfloat16 output: 8 mantissa bits, ~4e-3 relative per rounding of O(1) values; the
    # float32 lse is rounded only through its bfloat16 inputs' products: 1e-2.
    np.testing.assert_allclose(p.to_numpy(out), want[0], rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(p.to_numpy(lse), want[1], rtol=1e-2, atol=1e-2)
    grads = p.attention_backward(dout, q, k, v, out, lse, mask=AttentionMask("top_left"))
    for got, ref in zip(grads, want[2:]):
        assert dtype_name(got.dtype) == "bfloat16"
        # Gradients of magnitude ~3 through a bfloat16 output and dout: ~1e-2 absolute, 5e-2 bound.
        np.testing.assert_allclose(p.to_numpy(got), ref, rtol=5e-2, atol=5e-2)


def test_bfloat16(run_on_ranks) -> None:
    run_on_ranks(check_bfloat16, world_size=1)


def check_global_statistics() -> None:
    """The backward of calls over parts of the keys, given the output and log-sum-exp over
    all of them, returns each part's share: dq adds up, dk/dv concatenate (the ring's
    identity)."""
    p = get_platform()
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((B, 6, h, D)) for h in (H, 2, 2, H)]
    try:
        p.check_attention(*(p.from_numpy(a) for a in arrays[:3]))
        tol = 1e-10
    except ValueError:
        # A kernel without float64 (CUDA): float32 sums of a few O(1) terms in another
        # order, ~1e-6 apart.
        arrays, tol = [a.astype(np.float32) for a in arrays], 1e-5
    q, k, v, dout = (p.from_numpy(a) for a in arrays)
    out, lse = p.attention(q, k, v, mask=AttentionMask())
    whole = [p.to_numpy(g) for g in p.attention_backward(dout, q, k, v, out, lse)]
    parts = [p.attention_backward(dout, q, p.narrow(k, 1, s, n), p.narrow(v, 1, s, n), out, lse)
             for s, n in ((0, 2), (2, 4))]
    np.testing.assert_allclose(p.to_numpy(parts[0][0]) + p.to_numpy(parts[1][0]), whole[0], rtol=tol, atol=tol)
    for i in (1, 2):
        np.testing.assert_allclose(np.concatenate([p.to_numpy(parts[0][i]), p.to_numpy(parts[1][i])], 1), whole[i],
                                   rtol=tol, atol=tol)


def test_global_statistics(run_on_ranks) -> None:
    run_on_ranks(check_global_statistics, world_size=1)


def check_bad_input() -> dict[str, str]:
    p = get_platform()
    x = p.from_numpy(np.zeros((1, 4, 2, 8), np.float32))
    cases = {
        "rank": (lambda: p.attention(p.from_numpy(np.zeros((4, 2, 8), np.float32)), x, x), "[batch, seq, heads"),
        "heads": (lambda: p.attention(p.from_numpy(np.zeros((1, 4, 3, 8), np.float32)), x, x), "multiple"),
        "dtype": (lambda: p.attention(*(p.from_numpy(np.zeros((1, 4, 2, 8), np.int32)),) * 3), "int32"),
        "documents": (lambda: p.attention(x, x, x, mask=AttentionMask("none", (0, 3), (0, 3))), "cu_seqlens_q"),
        "causal form": (lambda: AttentionMask("causal"), "'top_left'"),
        "lse shape": (lambda: p.attention_backward(x, x, x, x, x, p.narrow(x, 3, 0, 1)), "lse"),
    }
    messages = {}
    for name, (call, needle) in cases.items():
        try:
            call()
        except (ValueError, TypeError) as err:
            assert needle in str(err), (name, str(err))
            messages[name] = str(err)
        else:
            raise AssertionError(f"{name}: accepted")
    return messages


def test_bad_input(run_on_ranks) -> None:
    assert len(run_on_ranks(check_bad_input, world_size=1)[0]) == 6
