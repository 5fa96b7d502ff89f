"""The torch-cuda attention kernels, each of torch's three forced in turn with torch's own
``torch.nn.attention.sdpa_kernel``: FlashAttention-2 (dense and the packed-documents varlen
call), the memory-efficient kernel and cuDNN, on every mask case of the conformance test
and head_dim 64 (cuDNN's smallest usual size), against the float64 reference. Also which
kernel the default choice runs: the one ``F.scaled_dot_product_attention`` runs.
World size 1; runs only with HYPER_PARALLEL_PLATFORM=torch-cuda (needs a GPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from tests.platform_contract._attention_reference import allowed_pairs, reference
from tests.platform_contract.test_attention import CASES, _dtype_tol

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM") != "torch-cuda",
                                reason="torch CUDA kernel test; needs a GPU and HYPER_PARALLEL_PLATFORM=torch-cuda")

B, H, D = 2, 4, 64
#: (kernel, dtype) pairs each kernel takes.
PAIRS = [("flash", "bfloat16"), ("flash", "float16"), ("efficient", "float32"), ("efficient", "bfloat16"),
         ("cudnn", "bfloat16"), ("cudnn", "float16")]


def check_forced(kernel: str, dtype: str) -> dict[str, object]:
    """Every case with ``kernel`` forced; which kernel each call ran (torch may decline a
    kernel for grouped-query heads, and then another runs)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hyper_parallel.platform.torch import attention as attn
    from hyper_parallel.platform.torch import cuda_attention

    p = get_platform()
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}[kernel]
    tol = _dtype_tol(p, dtype)
    rng = np.random.default_rng(7)
    ran: dict[str, str] = {}
    varlen = []
    for kv_heads in (H, 2, 1):
        for name, sq, sk, mask in CASES:
            label = f"{name} kv_heads={kv_heads} {kernel} {dtype}"
            arrays = [rng.standard_normal((B, s, h, D)) for s, h in ((sq, H), (sk, kv_heads), (sk, kv_heads), (sq, H))]
            tq, tk, tv, tdo = (p.to_dtype(p.from_numpy(a.astype(np.float32)), p.dtype(dtype)) for a in arrays)
            q, k, v, dout = (p.to_numpy(t).astype(np.float64) for t in (tq, tk, tv, tdo))
            want = reference(q, k, v, dout, allowed_pairs(sq, sk, mask), 0.125)
            with sdpa_kernel([backend]):
                ran[label] = attn.cuda_kernel(tq, tk, tv, mask)
                if cuda_attention.varlen_takes(ran[label], mask):
                    varlen.append(label)
                out, lse = p.attention(tq, tk, tv, scale=0.125, mask=mask)
                grads = p.attention_backward(tdo, tq, tk, tv, out, lse, scale=0.125, mask=mask)
            torch.cuda.synchronize()
            dead = np.isneginf(want[1])
            got_lse = p.to_numpy(lse)
            assert (np.isneginf(got_lse) == dead).all(), f"lse -inf rows: {label}"
            np.testing.assert_allclose(got_lse[~dead], want[1][~dead], rtol=tol["lse"], atol=tol["lse"],
                                       err_msg=f"lse: {label}")
            np.testing.assert_allclose(p.to_numpy(out), want[0], rtol=tol["out"], atol=tol["out"],
                                       err_msg=f"out: {label}")
            for what, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
                got = p.to_numpy(got)
                assert np.isfinite(got).all(), f"{what}: {label}"
                np.testing.assert_allclose(got, ref, rtol=tol["grad"], atol=tol["grad"], err_msg=f"{what}: {label}")
    return {"ran": ran, "varlen": varlen}


@pytest.mark.parametrize("kernel, dtype", PAIRS)
def test_forced_kernel_matches_reference(run_on_ranks, kernel: str, dtype: str) -> None:
    result = run_on_ranks(check_forced, kernel, dtype, world_size=1)[0]
    # cuDNN runs the calls it takes whole (no mask, square causal); the pieces of the rest
    # run on flash (cuda_attention.plan).
    whole = ("full ", "top_left_square ")
    expected = {label: kernel for label in result["ran"] if f"kv_heads={H} " in label
                and (kernel != "cudnn" or label.startswith(whole))}
    wrong = {label: result["ran"][label] for label in expected if result["ran"][label] != kernel}
    assert not wrong, f"the forced kernel {kernel} did not run MHA calls: {wrong}"
    if kernel == "flash":
        # Packed documents without empty sides run as one varlen call.
        assert any(label.startswith("documents ") for label in result["varlen"]), result["varlen"]


def check_forced_global_statistics(kernel: str, dtype: str) -> list[str]:
    """Ring attention's identity with ``kernel`` forced: the backward of two calls over
    parts of the keys, each given the output and log-sum-exp over all of them, adds up to
    the backward of the whole (dq summed, dk/dv concatenated). Returns the kernels run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hyper_parallel.platform.contract.attention import FULL
    from hyper_parallel.platform.torch import attention as attn

    p = get_platform()
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}[kernel]
    rng = np.random.default_rng(9)
    q, k, v, dout = (p.to_dtype(p.from_numpy(rng.standard_normal((B, n, H, D)).astype(np.float32)), p.dtype(dtype))
                     for n in (48, 40, 40, 48))
    ran = []
    with sdpa_kernel([backend]):
        out, lse = p.attention(q, k, v)
        whole = [p.to_numpy(g) for g in p.attention_backward(dout, q, k, v, out, lse)]
        parts = []
        for start, n in ((0, 24), (24, 16)):
            kp, vp = p.narrow(k, 1, start, n), p.narrow(v, 1, start, n)
            ran.append(attn.cuda_kernel(q, kp, vp, FULL))
            parts.append([p.to_numpy(g) for g in p.attention_backward(dout, q, kp, vp, out, lse)])
    # Each part's gradients are rounded to the input dtype once more than the whole's.
    tol = _dtype_tol(p, dtype)["grad"]
    np.testing.assert_allclose(parts[0][0] + parts[1][0], whole[0], rtol=tol, atol=tol)
    for i in (1, 2):
        np.testing.assert_allclose(np.concatenate([parts[0][i], parts[1][i]], 1), whole[i], rtol=tol, atol=tol)
    return ran


@pytest.mark.parametrize("kernel, dtype", PAIRS)
def test_forced_kernel_global_statistics(run_on_ranks, kernel: str, dtype: str) -> None:
    assert run_on_ranks(check_forced_global_statistics, kernel, dtype, world_size=1)[0] == [kernel, kernel]


def check_default_choice() -> list[tuple[str, str, str]]:
    """The kernel a default call runs, beside the one torch's SDPA runs for the same inputs."""
    import torch

    from hyper_parallel.platform.torch import attention as attn
    from hyper_parallel.platform.contract.attention import AttentionMask

    seen = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.randn(1, 1024, 8, 64, device="cuda", dtype=dtype)
        choice = torch._fused_sdp_choice(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), None, 0.0, True)
        seen.append((str(dtype), attn.cuda_kernel(q, q, q, AttentionMask("top_left")),
                     torch.nn.attention.SDPBackend(choice).name))
    return seen


def test_default_choice_is_torchs(run_on_ranks) -> None:
    names = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn"}
    for dtype, ours, torchs in run_on_ranks(check_default_choice, world_size=1)[0]:
        assert names.get(torchs, ours) == ours, (dtype, ours, torchs)
