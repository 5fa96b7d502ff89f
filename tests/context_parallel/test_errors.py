"""Bad input raises a clear error on every rank before any collective; a module that
computes attention on its own works under pure Ulysses and is refused elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

import hyper_parallel as hp
from hyper_parallel.core.context_parallel.attention import local_attention
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.platform import get_platform
from tests.context_parallel._models import core_attention, keyword_attention


def _message(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def check_errors() -> dict[str, str]:
    p = get_platform()
    cp = p.world_size()
    mesh = init_device_mesh(p.device_type, (cp,))
    rng = np.random.default_rng(0)

    def t(*shape: int):
        return p.from_numpy(rng.standard_normal(shape).astype(np.float32))

    def run(style, q, k, v, functional=True, **kw):
        return style.apply(core_attention(p, causal=True, functional=functional, **kw), mesh)(q, k, v)

    out = {
        "exchange": _message(lambda: hp.ContextParallel(kv_exchange="p2p")),
        "kwargs": _message(lambda: hp.ContextParallel(qkv_kwarg_names=("query",))),
        "ulysses_lb": _message(lambda: hp.ContextParallel(load_balance=True).apply(core_attention(p, causal=True),
                                                                                     mesh)),
        "heads": _message(lambda: run(hp.ContextParallel(), t(1, 4, 3, 2), t(1, 4, 3, 2), t(1, 4, 3, 2))),
        "kv_heads": _message(lambda: run(hp.ContextParallel(), t(1, 4, 6, 2), t(1, 4, 3, 2), t(1, 4, 3, 2))),
        "odd_lb": _message(lambda: run(hp.ContextParallel(ulysses_degree=1, load_balance=True), t(1, 3, 2, 2),
                                       t(1, 3, 2, 2), t(1, 3, 2, 2))),
        "cu_seqlens": _message(lambda: run(hp.ContextParallel(ulysses_degree=1), t(1, 4, 2, 2), t(1, 4, 2, 2),
                                           t(1, 4, 2, 2), cu_seqlens=[0, 5, 3])),
        "not_functional": _message(lambda: run(hp.ContextParallel(ulysses_degree=1, kv_exchange="ring"),
                                               t(1, 4, 2, 2), t(1, 4, 2, 2), t(1, 4, 2, 2), functional=False)),
        # The pre-hook checks a named q/k/v keyword and a cu_seqlens keyword before the
        # Ulysses all-to-all (the message names ContextParallel, not the functional).
        "kwarg_missing": _message(lambda: hp.ContextParallel(qkv_kwarg_names=("query", "key", "value")).apply(
            keyword_attention(p, causal=True), mesh)(t(1, 4, 2, 2), key=t(1, 4, 2, 2), value=t(1, 4, 2, 2))),
        "index_missing": _message(lambda: hp.ContextParallel(qkv_kwarg_names=(None, "key", "value")).apply(
            keyword_attention(p, causal=True), mesh)(key=t(1, 4, 2, 2), value=t(1, 4, 2, 2), query=t(1, 4, 2, 2))),
        "cu_seqlens_ulysses": _message(lambda: hp.ContextParallel().apply(keyword_attention(p, causal=True), mesh)(
            t(1, 4, 2, 2), t(1, 4, 2, 2), t(1, 4, 2, 2), cu_seqlens=[0, 5, 3])),
        # Taken from a closure, cu_seqlens reaches only the functional, after the Ulysses
        # all-to-all: every rank still raises the same error, and the collectives below
        # still work (nothing hangs or is left half-done).
        "cu_seqlens_closure_ulysses": _message(lambda: run(hp.ContextParallel(), t(1, 4, 2, 2), t(1, 4, 2, 2),
                                                           t(1, 4, 2, 2), cu_seqlens=[0, 5, 3])),
        "shard": _message(lambda: hp.context_parallel_shard([t(1, 6, 2)], [1], mesh, load_balance=True)),
        "layout": _message(lambda: hp.scaled_dot_product_attention(t(1, 4, 2, 2), t(1, 4, 2, 2), t(1, 4, 2, 2),
                                                                   layout="SBHD")),
    }
    # The forwards above raised inside hooked modules, skipping their post-hooks: their
    # frames must not capture a plain call of the functional.
    a = t(1, 5, 2, 2)
    np.testing.assert_array_equal(p.to_numpy(hp.scaled_dot_product_attention(a, a, a, is_causal=True)),
                                  p.to_numpy(local_attention(a, a, a, is_causal=True)))
    # A module computing attention by itself sees whole sequences under pure Ulysses.
    # Tolerance 1e-5 (float32): Ulysses runs each head's attention on the whole sequence like the
    # reference, but after the all-to-all the heads are laid out in other tensors, so the backend's
    # softmax/matmul may reduce in another order; the ring merges per-block partial outputs by an
    # fp32 log-sum-exp (a few ulps); MindSpore's CPU exp is approximate to ~2.7e-6 relative.
    q, k, v = (rng.standard_normal((2, 4 * cp, 2 * cp, 4)).astype(np.float32) for _ in range(3))
    ref = p.to_numpy(local_attention(p.from_numpy(q), p.from_numpy(k), p.from_numpy(v), is_causal=True))
    local = hp.context_parallel_shard([p.from_numpy(a) for a in (q, k, v)], [1, 1, 1], mesh)
    got = run(hp.ContextParallel(), *local, functional=False)
    np.testing.assert_allclose(p.to_numpy(got), np.array_split(ref, cp, axis=1)[p.rank()], rtol=1e-5, atol=1e-5)
    # A named 2-D (exchange, ulysses) mesh given directly: (1, cp) is Ulysses, (cp, 1) a ring.
    for shape in ((1, cp), (cp, 1)):
        mesh2d = init_device_mesh(p.device_type, shape, mesh_dim_names=("cp_kv", "cp_ulysses"))
        module = hp.ContextParallel(kv_exchange="ring").apply(core_attention(p, causal=True), mesh2d)
        got = module(*hp.context_parallel_shard([p.from_numpy(a) for a in (q, k, v)], [1, 1, 1], mesh2d))
        np.testing.assert_allclose(p.to_numpy(got), np.array_split(ref, cp, axis=1)[p.rank()], rtol=1e-5, atol=1e-5,
                                   err_msg=f"2-D mesh {shape}")
    out["mesh_degree"] = _message(lambda: hp.ContextParallel(ulysses_degree=2).resolve(
        init_device_mesh(p.device_type, (cp, 1))))
    return out


EXPECTED = {
    "exchange": "ValueError: ContextParallel: kv_exchange='p2p'; use 'allgather' or 'ring'",
    "kwargs": "qkv_kwarg_names=('query',) must be () or three entries (for q, k, v)",
    "kwarg_missing": "KeywordAttention: q is expected as keyword argument 'query' (qkv_kwarg_names=('query', 'key', "
                     "'value')) but the call passed keywords ['key', 'value']",
    "index_missing": "KeywordAttention: q is expected as positional argument 0 (qkv_indices=(0, 1, 2)) but forward got "
                     "0 positional arguments",
    # named after the module: raised by the pre-hook (the functional names itself)
    "cu_seqlens_ulysses": "KeywordAttention: cu_seqlens=[0, 5, 3] must be integers starting at 0",
    "ulysses_lb": "pure Ulysses (ulysses_degree=2 == cp) attends over whole sequences and is balanced already",
    "heads": "q has 3 heads, not divisible by the Ulysses degree 2",
    "kv_heads": "k/v have 3 heads and the Ulysses degree is 2; one must divide the other",
    "odd_lb": "sequence length 6 does not split into 2 * cp = 4 chunks (load_balance=True); pad the sequence",
    "cu_seqlens": "cu_seqlens=[0, 5, 3] must be integers starting at 0, strictly increasing and ending at the full "
                  "sequence length 8",
    "cu_seqlens_closure_ulysses": "scaled_dot_product_attention: cu_seqlens=[0, 5, 3] must be integers",
    "not_functional": "CoreAttention: the forward computed its attention without "
                      "hyper_parallel.scaled_dot_product_attention or a fused op the backend routes (MindSpore: "
                      "FlashAttentionScore), so this module's K/V exchange (kv_exchange='ring' over 2 ranks) never ran",
    "shard": "context_parallel_shard: sequence length 6 does not split into 2 * cp = 4 chunks",
    "layout": "layout='SBHD' is not supported",
    "mesh_degree": "ulysses_degree=2 but the 2-D mesh (2, 1) has 1 ranks on its Ulysses axis (the second)",
}


def test_errors(run_on_ranks) -> None:
    results = run_on_ranks(check_errors, world_size=2)
    for rank, messages in enumerate(results):
        for key, expected in EXPECTED.items():
            assert expected in messages[key], (rank, key, messages[key])


def test_async_falls_back_without_projections(run_on_ranks) -> None:
    assert run_on_ranks(check_async_fallback, world_size=2) == ["ContextParallel"] * 2


def check_async_fallback() -> str:
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (p.world_size(),))
    with pytest.warns(UserWarning, match="no q/k/v projection given; using synchronous ContextParallel"):
        hp.AsyncContextParallel().apply(core_attention(p, causal=True), mesh)
    return "ContextParallel"
