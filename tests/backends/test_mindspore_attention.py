"""The MindSpore CPU attention kernels (tiled FlashAttention-2 forward and recomputing
backward) against a dense float64 numpy reference: every mask form, packed documents
(with empty sides), grouped-query heads, sizes that are not multiples of the tile,
float64/float32/bfloat16, and the backward given the output and log-sum-exp of a larger
key set. World size 1; runs only with HYPER_PARALLEL_PLATFORM=mindspore-cpu."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.contract.attention import AttentionMask
from tests.platform_contract._attention_reference import allowed_pairs, reference
from hyper_parallel.core.tensor_ops import dtype_name

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM") != "mindspore-cpu",
                                reason="MindSpore CPU kernel test; set HYPER_PARALLEL_PLATFORM=mindspore-cpu")

#: Small tiles so that 37 queries x 29 keys cross many tile boundaries and diagonals.
TILES = {"q_tile": 8, "k_tile": 8}
#: Tiles that hold every sequence here: the call is one graph each way
#: ([Note: MindSpore CPU attention in one graph]).
ONE_TILE = {"q_tile": 64, "k_tile": 64}
#: float64 is float64 end to end: only summation order differs from numpy.
TOL64 = 1e-10
#: float32 math against a float64 reference over at most 37 keys: ~1e-6 relative, with
#: MindSpore's approximate CPU Exp (~2e-6 relative, measured) inside; passes at 1e-5.
TOL32 = 1e-5
#: bfloat16/float16 inputs are computed in float32 and the results rounded back (bfloat16:
#: 8 bits of mantissa, ~4e-3 relative; gradients of magnitude ~3 are off by ~1e-2); the
#: reference is fed the same rounded inputs.
TOL_HALF = 2e-2


def inputs(shape_q: tuple[int, ...], kv_seq: int, kv_heads: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    b, _, _, d = shape_q
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal((b, kv_seq, kv_heads, d))
    v = rng.standard_normal((b, kv_seq, kv_heads, d))
    dout = rng.standard_normal(shape_q)
    return q, k, v, dout


def _tol(dtype: str) -> float:
    return {"float64": TOL64, "float32": TOL32, "bfloat16": TOL_HALF, "float16": TOL_HALF}[dtype]


def run_kernels(arrays: tuple[np.ndarray, ...], dtype: str, mask: AttentionMask, scale: float | None,
                tiles: dict[str, int] | None) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, ...]]:
    """The platform's forward and backward on ``arrays`` cast to ``dtype``; returns the
    results as float64 numpy and the inputs as the kernel saw them (rounded)."""
    from hyper_parallel.platform.mindspore import attention as kernels

    p = get_platform()
    kw = dict(tiles or {})
    q, k, v, dout = (p.to_dtype(p.from_numpy(x), p.dtype(dtype)) for x in arrays)
    if tiles is None:
        out, lse = p.attention(q, k, v, scale=scale, mask=mask)
        dq, dk, dv = p.attention_backward(dout, q, k, v, out, lse, scale=scale, mask=mask)
    else:
        out, lse = kernels.attention(p, q, k, v, scale=scale, mask=mask, **kw)
        dq, dk, dv = kernels.attention_backward(p, dout, q, k, v, out, lse, scale=scale, mask=mask, **kw)
    assert dtype_name(out.dtype) == dtype and tuple(out.shape) == tuple(arrays[0].shape)
    assert dtype_name(lse.dtype) == ("float64" if dtype == "float64" else "float32")
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert dtype_name(grad.dtype) == dtype and tuple(grad.shape) == tuple(like.shape)
    got = {name: p.to_numpy(x).astype(np.float64) for name, x in
           (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}
    seen = tuple(p.to_numpy(x).astype(np.float64) for x in (q, k, v, dout))
    return got, seen


def compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol: float) -> None:
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert np.isfinite(got[name][np.isfinite(want[name])]).all(), f"{name} has NaN/inf"
        np.testing.assert_array_equal(np.isneginf(got[name]), np.isneginf(want[name]), err_msg=name)
        finite = np.isfinite(want[name])
        np.testing.assert_allclose(got[name][finite], want[name][finite], rtol=tol, atol=tol, err_msg=name)


# -- checks (run in a rank process) -------------------------------------------------------


def check_against_reference(q_seq: int, kv_seq: int, heads: int, kv_heads: int, dtype: str, causal: str,
                            cu: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                            tiles: dict[str, int] | None = TILES) -> None:
    mask = AttentionMask(causal, *(cu or (None, None)))
    arrays = inputs((2, q_seq, heads, 16), kv_seq, kv_heads)
    scale = 0.3
    got, seen = run_kernels(arrays, dtype, mask, scale, tiles)
    want = dict(zip(("out", "lse", "dq", "dk", "dv"),
                    reference(*seen, allowed_pairs(q_seq, kv_seq, mask), scale)))
    compare(got, want, _tol(dtype))


def check_one_tile(q_seq: int, kv_seq: int, kv_heads: int, dtype: str, causal: str, whole: bool) -> None:
    """``check_against_reference`` with ``ONE_TILE``, after checking which path the call
    takes: the one-graph path (``whole``) unless some rows see no key."""
    from hyper_parallel.platform.mindspore import attention as kernels

    p = get_platform()
    q, k, _, _ = (p.from_numpy(x) for x in inputs((2, q_seq, 4, 16), kv_seq, kv_heads))
    assert kernels._one_graph(p, q, k, (q, k), kernels._offset(causal, q_seq, kv_seq), **ONE_TILE) is whole
    check_against_reference(q_seq, kv_seq, 4, kv_heads, dtype, causal, tiles=ONE_TILE)


def check_split_keys(dtype: str, tiles: dict[str, int]) -> None:
    """The backward of keys [0, 10) and [10, 20), each given the output and log-sum-exp
    over all 20 keys, adds up to the whole call's gradients ([Note: attention kernels])."""
    from hyper_parallel.platform.mindspore import attention as kernels

    p = get_platform()
    q, k, v, dout = (p.to_dtype(p.from_numpy(x), p.dtype(dtype)) for x in inputs((2, 13, 4, 16), 20, 2, seed=1))
    out, lse = kernels.attention(p, q, k, v, **tiles)
    whole = [p.to_numpy(g) for g in kernels.attention_backward(p, dout, q, k, v, out, lse, **tiles)]
    parts = []
    for start in (0, 10):
        k_part, v_part = p.narrow(k, 1, start, 10), p.narrow(v, 1, start, 10)
        parts.append([p.to_numpy(g) for g in kernels.attention_backward(p, dout, q, k_part, v_part, out, lse,
                                                                         **tiles)])
    tol = _tol(dtype)
    np.testing.assert_allclose(parts[0][0] + parts[1][0], whole[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.concatenate([parts[0][1], parts[1][1]], 1), whole[1], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.concatenate([parts[0][2], parts[1][2]], 1), whole[2], rtol=tol, atol=tol)


def check_floored_lse() -> None:
    """A row whose lse is the merge floor (-1e30) rather than -inf also gets zero,
    finite gradients."""
    from hyper_parallel.platform.attention_pieces import LSE_FLOOR
    from hyper_parallel.platform.mindspore import attention as kernels

    p = get_platform()
    mask = AttentionMask("bottom_right")  # 9 queries, 5 keys: queries 0..3 see nothing
    q, k, v, dout = (p.from_numpy(x) for x in inputs((1, 9, 2, 16), 5, 2, seed=2))
    out, lse = kernels.attention(p, q, k, v, mask=mask, **TILES)
    lse_np = p.to_numpy(lse)
    assert np.isneginf(lse_np[:, :, :4]).all() and np.isfinite(lse_np[:, :, 4:]).all()
    floored = p.from_numpy(np.maximum(lse_np, LSE_FLOOR))
    for given in (lse, floored):
        dq, dk, dv = (p.to_numpy(g) for g in kernels.attention_backward(p, dout, q, k, v, out, given, mask=mask,
                                                                         **TILES))
        assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        assert (dq[:, :4] == 0).all()


def check_bad_input() -> None:
    p = get_platform()
    x = p.from_numpy(np.zeros((1, 4, 2, 8)))
    cases = [
        (lambda: p.attention(p.from_numpy(np.zeros((4, 2, 8))), x, x), "[batch, seq, heads, head_dim]"),
        (lambda: p.attention(x, x, p.from_numpy(np.zeros((1, 5, 2, 8)))), "same shape"),
        (lambda: p.attention(x, p.from_numpy(np.zeros((1, 4, 2, 4))), p.from_numpy(np.zeros((1, 4, 2, 4)))),
         "head_dim"),
        (lambda: p.attention(p.from_numpy(np.zeros((1, 4, 3, 8))), x, x), "divisible by kv_heads"),
        (lambda: p.attention(p.to_dtype(x, p.dtype("float32")), x, x), "one dtype"),
        (lambda: p.attention(x, x, x, mask=AttentionMask("none", (0, 3), (0, 4))), "cu_seqlens_q ends at 3"),
        (lambda: p.attention_backward(x, x, x, x, x, p.from_numpy(np.zeros((1, 4, 2)))), "lse has shape"),
    ]
    for call, words in cases:
        try:
            call()
        except ValueError as err:
            assert words in str(err), (words, str(err))
        else:
            raise AssertionError(f"accepted: {words}")
    # The queue still works after the refusals (nothing reached an op without a CPU kernel).
    out, _ = p.attention(x, x, x)
    assert p.to_numpy(out).shape == (1, 4, 2, 8)


# -- tests ----------------------------------------------------------------------------------

SHAPES = [(37, 37), (23, 37), (37, 29)]  # square, q_seq < kv_seq, q_seq > kv_seq


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=["square", "short_q", "long_q"])
def test_masks(run_on_ranks, dtype: str, causal: str, shape: tuple[int, int]) -> None:
    run_on_ranks(check_against_reference, *shape, 4, 2, dtype, causal, world_size=1)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_grouped_heads(run_on_ranks, kv_heads: int, causal: str) -> None:
    run_on_ranks(check_against_reference, 37, 29, 4, kv_heads, "float64", causal, world_size=1)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=["square", "short_q", "long_q"])
def test_one_tile(run_on_ranks, dtype: str, causal: str, shape: tuple[int, int]) -> None:
    """Sequences that fit one tile run as one graph each way; bottom-right causal with
    more queries than keys (rows that see no key) runs tile by tile."""
    whole = not (causal == "bottom_right" and shape[0] > shape[1])
    run_on_ranks(check_one_tile, *shape, 2, dtype, causal, whole, world_size=1)


def check_one_graph_cap() -> None:
    """A one-tile call above ``ONE_GRAPH_MAX_SCORES``, or on a DTensor, runs tile by tile."""
    import hyper_parallel as hp
    from hyper_parallel.platform.mindspore import attention as kernels

    p = get_platform()
    seq = 1024
    heads = kernels.ONE_GRAPH_MAX_SCORES // (seq * seq)  # exactly at the cap
    q = p.from_numpy(np.zeros((1, seq, heads, 8), dtype=np.float32))
    assert kernels._one_graph(p, q, q, (q,), 0, kernels.Q_TILE, kernels.K_TILE)
    dq = hp.DTensor.from_local(q, hp.init_device_mesh(p.device_type, (1,)), [hp.Replicate()])
    assert not kernels._one_graph(p, dq, dq, (dq,), 0, kernels.Q_TILE, kernels.K_TILE)
    q = p.from_numpy(np.zeros((1, seq, heads + 1, 8), dtype=np.float32))
    assert not kernels._one_graph(p, q, q, (q,), 0, kernels.Q_TILE, kernels.K_TILE)


def test_one_graph_cap(run_on_ranks) -> None:
    run_on_ranks(check_one_graph_cap, world_size=1)


# Documents: lengths q (10, 0, 15, 12), kv (8, 7, 0, 14): document 1 has keys but no
# queries, document 2 queries but no keys (output 0, lse -inf, zero gradients).
DOCS = ((0, 10, 10, 25, 37), (0, 8, 15, 15, 29))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_documents(run_on_ranks, dtype: str, causal: str) -> None:
    run_on_ranks(check_against_reference, 37, 29, 4, 2, dtype, causal, DOCS, world_size=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(run_on_ranks, dtype: str) -> None:
    """Computed in float32 (no bfloat16 MatMul on CPU), output and gradients cast back."""
    run_on_ranks(check_against_reference, 37, 29, 4, 2, dtype, "bottom_right", world_size=1)


@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_default_tiles_via_platform(run_on_ranks, causal: str) -> None:
    """``Platform.attention``/``attention_backward`` with the default tiles (one tile
    here, and two key tiles at 1100 keys)."""
    run_on_ranks(check_against_reference, 37, 29, 4, 2, "float64", causal, None, None, world_size=1)
    run_on_ranks(check_against_reference, 40, 1100, 2, 1, "float32", causal, None, None, world_size=1)


@pytest.mark.parametrize("tiles", [TILES, ONE_TILE], ids=["tiles", "one_tile"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_backward_with_global_statistics(run_on_ranks, dtype: str, tiles: dict[str, int]) -> None:
    run_on_ranks(check_split_keys, dtype, tiles, world_size=1)


def test_floored_lse(run_on_ranks) -> None:
    run_on_ranks(check_floored_lse, world_size=1)


def test_bad_input(run_on_ranks) -> None:
    run_on_ranks(check_bad_input, world_size=1)
