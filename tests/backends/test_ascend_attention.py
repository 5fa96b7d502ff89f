"""Packed documents on Ascend run as one TND call of the fused kernel
(``torch_npu.npu_fusion_attention`` on torch-npu, ``FlashAttentionScore`` on
mindspore-ascend) and match the float64 reference, forward and backward, over batch rows
and grouped-query heads. The conformance test (``tests/platform_contract/test_attention``)
checks every mask case there too; this one checks that the one-call path is the one that
ran. World size 1; runs only with HYPER_PARALLEL_PLATFORM=torch-npu or mindspore-ascend
(needs an Ascend NPU and CANN)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.contract.attention import AttentionMask
from tests.platform_contract._attention_reference import allowed_pairs, reference
from tests.platform_contract.test_attention import _dtype_tol

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM") not in ("torch-npu", "mindspore-ascend"),
                                reason="Ascend kernel test; needs an NPU, CANN and HYPER_PARALLEL_PLATFORM=torch-npu "
                                       "or mindspore-ascend")

B, H, D = 2, 4, 64
#: (name, q_seq, kv_seq, mask, one TND call expected); mindspore-ascend's TND takes causal
#: masks only, so its non-causal documents run as pieces.
CASES = [
    ("documents_causal", 12, 12, AttentionMask("top_left", (0, 5, 9, 12), (0, 5, 9, 12))),
    ("documents_bottom_right", 9, 13, AttentionMask("bottom_right", (0, 3, 9), (0, 4, 13))),
    ("documents_full", 9, 11, AttentionMask("none", (0, 3, 9), (0, 6, 11))),
]


def check_documents(dtype: str) -> list[str]:
    """Every case against the reference; the names of the cases that ran as one TND call."""
    p = get_platform()
    if p.framework == "torch":
        from hyper_parallel.platform.torch import attention as module
        name = "_npu_tnd_forward"
    else:
        from hyper_parallel.platform.mindspore import attention as module
        name = "_ascend_tnd_forward"
    original = getattr(module, name)
    ran: list[str] = []
    label = ""

    def counted(*args, **kwargs):
        ran.append(label)
        return original(*args, **kwargs)

    tol = _dtype_tol(p, dtype)
    rng = np.random.default_rng(3)
    setattr(module, name, counted)
    try:
        for kv_heads in (H, 2):
            for case, sq, sk, mask in CASES:
                label = f"{case} kv_heads={kv_heads}"
                arrays = [rng.standard_normal((B, s, h, D)) for s, h in ((sq, H), (sk, kv_heads), (sk, kv_heads),
                                                                          (sq, H))]
                tq, tk, tv, tdo = (p.to_dtype(p.from_numpy(a.astype(np.float32)), p.dtype(dtype)) for a in arrays)
                q, k, v, dout = (p.to_numpy(p.to_dtype(t, p.dtype("float32"))).astype(np.float64)
                                 for t in (tq, tk, tv, tdo))
                want = reference(q, k, v, dout, allowed_pairs(sq, sk, mask), 0.125)
                out, lse = p.attention(tq, tk, tv, scale=0.125, mask=mask)
                grads = p.attention_backward(tdo, tq, tk, tv, out, lse, scale=0.125, mask=mask)
                as64 = [p.to_numpy(p.to_dtype(t, p.dtype("float32"))).astype(np.float64) for t in (out, lse, *grads)]
                np.testing.assert_allclose(as64[1], want[1], rtol=tol["lse"], atol=tol["lse"], err_msg=f"lse: {label}")
                np.testing.assert_allclose(as64[0], want[0], rtol=tol["out"], atol=tol["out"], err_msg=f"out: {label}")
                for what, got, ref in zip(("dq", "dk", "dv"), as64[2:], want[2:]):
                    np.testing.assert_allclose(got, ref, rtol=tol["grad"], atol=tol["grad"],
                                               err_msg=f"{what}: {label}")
    finally:
        setattr(module, name, original)
    return ran


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_documents_run_as_one_tnd_call(run_on_ranks, dtype: str) -> None:
    ran = run_on_ranks(check_documents, dtype, world_size=1)[0]
    causal_only = os.environ.get("HYPER_PARALLEL_PLATFORM") == "mindspore-ascend"
    expected = [f"{case} kv_heads={kv}" for kv in (H, 2) for case, *_, mask in CASES
                if not (causal_only and mask.causal == "none")]
    assert ran == expected
