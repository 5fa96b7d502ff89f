"""Fused attention kernels on torch: forward with log-sum-exp and the matching backward
(see [Note: attention kernels] in ``contract/attention``).

Which kernel runs:

| device | dtype | kernel | mask forms taken natively |
|---|---|---|---|
| cpu | float64, float32, bfloat16, float16 | ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``) | none, top-left causal of any shape |
| cuda | float16, bfloat16, head_dim <= 256 and a multiple of 8 | ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``; grouped-query natively) | none, square causal |
| cuda | float32 (or a head_dim flash does not take) | ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``; k/v heads repeated) | none, square causal |
| npu | float16, bfloat16, float32 | ``torch_npu.npu_fusion_attention`` (+ ``npu_fusion_attention_grad``) | none, top-left (``sparse_mode`` 2), bottom-right with ``kv_seq >= q_seq`` (3) |

Every other form (bottom-right where not native, packed documents) runs as pieces of the
native forms merged by log-sum-exp (``platform.attention_pieces``): never a score matrix.
Layouts: the contract is BSHD; torch's SDPA kernels take ``[batch, heads, seq, dim]``,
which is a transposed view here (no copy), and NPU takes BSND as it is.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hyper_parallel.platform import attention_pieces as pieces
from hyper_parallel.platform.contract.attention import AttentionMask
from hyper_parallel.platform.validation import check_attention_inputs

_CPU_DTYPES = ("float64", "float32", "bfloat16", "float16")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_CUDA_DTYPES = ("float32", "float16", "bfloat16")
_NPU_DTYPES = ("float32", "float16", "bfloat16")
#: The compressed causal mask ``npu_fusion_attention`` takes with sparse modes 2 and 3.
_NPU_MASK_SIZE = 2048


def check_inputs(backend: str, q: Any, k: Any, v: Any, mask: AttentionMask) -> None:
    """Raise unless ``q``/``k``/``v``/``mask`` fit ``Platform.attention`` and the kernel of
    ``backend`` (``validation.check_attention_inputs``)."""
    names = [str(x.dtype).removeprefix("torch.") for x in (q, k, v)]
    supported = {"torch-cpu": _CPU_DTYPES, "torch-cuda": _CUDA_DTYPES, "torch-npu": _NPU_DTYPES}[backend]
    kernel = {"torch-cpu": "_scaled_dot_product_flash_attention_for_cpu",
              "torch-cuda": "_scaled_dot_product_flash_attention / _efficient_attention",
              "torch-npu": "npu_fusion_attention"}[backend]
    check_attention_inputs(q, k, v, mask, names, supported, backend=backend, kernel=kernel)


def _bhsd(x: Any) -> Any:
    return x.transpose(1, 2)


def _dead_to_inf(lse: Any) -> Any:
    """Rows that see no key (``lse`` at or below the floor) get ``+inf``: the kernels
    compute ``exp(s - lse)``, which is then 0 where ``-inf`` would give NaN."""
    return torch.where(lse <= pieces.LSE_FLOOR, torch.full_like(lse, math.inf), lse).contiguous()


# -- CPU ------------------------------------------------------------------------------------

def _cpu_forward(scale: float) -> pieces.ForwardKernel:
    def kernel(q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Any]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale)
        return _bhsd(out), lse
    return kernel


def _cpu_backward(scale: float) -> pieces.BackwardKernel:
    def kernel(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool) -> tuple[Any, Any, Any]:
        lse = _dead_to_inf(lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale)
        return _bhsd(dq), _bhsd(dk), _bhsd(dv)
    return kernel


# -- CUDA -----------------------------------------------------------------------------------

def _use_flash(q: Any) -> bool:
    return q.dtype in _FLASH_DTYPES and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def _repeat_kv(x: Any, group: int) -> Any:
    """``[B, S, Hkv, D]`` -> ``[B, S, Hkv * group, D]``: the efficient kernel takes no
    grouped-query attention (an ``O(seq)`` copy, not a score matrix)."""
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _fold_kv(x: Any, group: int) -> Any:
    if group == 1:
        return x
    b, s, h, d = x.shape
    return x.reshape(b, s, h // group, group, d).sum(3)


def _cuda_forward(scale: float) -> pieces.ForwardKernel:
    def kernel(q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Any]:
        if _use_flash(q):
            res = torch.ops.aten._scaled_dot_product_flash_attention(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal,
                                                                      False, scale=scale)
            return _bhsd(res[0]), res[1]
        group = q.shape[2] // k.shape[2]
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bhsd(q), _bhsd(_repeat_kv(k, group)), _bhsd(_repeat_kv(v, group)), None, True, 0.0, causal, scale=scale)
        # The efficient kernel pads its log-sum-exp to a multiple of 32 queries.
        return _bhsd(res[0]), res[1][..., :q.shape[1]]
    return kernel


def _cuda_backward(scale: float) -> pieces.BackwardKernel:
    def kernel(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool) -> tuple[Any, Any, Any]:
        lse = _dead_to_inf(lse.float())
        sq, sk = q.shape[1], k.shape[1]
        if _use_flash(q):
            # No dropout: the kernel reads neither the RNG state nor (dense inputs) the
            # cumulative lengths, which torch's own ring passes as the forward returned them.
            seed = torch.empty(2, dtype=torch.uint64, device=q.device)
            offset = torch.empty((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, None, None, sq, sk, 0.0, causal,
                seed, offset, scale=scale)
            return _bhsd(dq), _bhsd(dk), _bhsd(dv)
        group = q.shape[2] // k.shape[2]
        padded = math.ceil(sq / 32) * 32
        lse = torch.nn.functional.pad(lse, (0, padded - sq), value=math.inf)
        seed = torch.empty((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(_repeat_kv(k, group)), _bhsd(_repeat_kv(v, group)), None, _bhsd(out), lse,
            seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return _bhsd(dq), _fold_kv(_bhsd(dk), group), _fold_kv(_bhsd(dv), group)
    return kernel


# -- NPU ------------------------------------------------------------------------------------

def _npu_mask(device: Any) -> Any:
    """The 2048 x 2048 compressed mask of sparse modes 2/3 (True above the diagonal:
    discarded), as ``npu_fusion_attention``'s documentation requires."""
    return torch.ones(_NPU_MASK_SIZE, _NPU_MASK_SIZE, dtype=torch.bool, device=device).triu(1)


def _npu_sparse_mode(causal: str) -> int:
    return {"none": 0, "top_left": 2, "bottom_right": 3}[causal]


def _npu_forward(scale: float, causal_form: str) -> pieces.ForwardKernel:
    def kernel(q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Any]:
        import torch_npu  # imported only on NPU: it needs Ascend CANN

        form = causal_form if causal else "none"
        mode = _npu_sparse_mode(form)
        res = torch_npu.npu_fusion_attention(
            q, k, v, q.shape[2], "BSND", atten_mask=_npu_mask(q.device) if mode else None, scale=scale,
            keep_prob=1.0, sparse_mode=mode)
        out, softmax_max, softmax_sum = res[0], res[1], res[2]  # max/sum: [B, N, Sq, 8], equal along the 8
        return out, softmax_max[..., 0] + torch.log(softmax_sum[..., 0])
    return kernel


def _npu_backward(scale: float, causal_form: str) -> pieces.BackwardKernel:
    def kernel(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool) -> tuple[Any, Any, Any]:
        import torch_npu  # imported only on NPU: it needs Ascend CANN

        form = causal_form if causal else "none"
        mode = _npu_sparse_mode(form)
        # max = lse, sum = 1 is the global softmax (MindSpeed's ring passes merged max/sum).
        softmax_max = _dead_to_inf(lse.float()).unsqueeze(-1).expand(*lse.shape, 8).contiguous()
        softmax_sum = torch.ones_like(softmax_max)
        dq, dk, dv = torch_npu.npu_fusion_attention_grad(
            q, k, v, dout, q.shape[2], "BSND", atten_mask=_npu_mask(q.device) if mode else None,
            softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, scale_value=scale, keep_prob=1.0,
            sparse_mode=mode)[:3]
        return dq, dk, dv
    return kernel


# -- dispatch --------------------------------------------------------------------------------

def _plan(device_type: str, q: Any, k: Any, mask: AttentionMask) -> tuple[list[pieces.Group], str]:
    """The pieces to run and the causal form a piece's ``causal`` flag means for the
    kernel (NPU takes bottom-right natively; the others run top-left pieces)."""
    sq, sk = int(q.shape[1]), int(k.shape[1])
    if device_type == "npu" and not mask.documents and mask.causal == "bottom_right" and sk >= sq:
        return [pieces.Group(0, sq, (pieces.Piece(0, sk, True),))], "bottom_right"
    return pieces.plan_pieces(sq, sk, mask, any_shape_top_left=device_type in ("cpu", "npu")), "top_left"


def forward(p: Any, q: Any, k: Any, v: Any, scale: float, mask: AttentionMask) -> tuple[Any, Any]:
    """``Platform.attention`` on ``p`` (a torch platform), inputs checked."""
    device_type = p.device_type
    groups, form = _plan(device_type, q, k, mask)
    kernel = {"cpu": lambda: _cpu_forward(scale), "cuda": lambda: _cuda_forward(scale),
              "npu": lambda: _npu_forward(scale, form)}[device_type]()
    with torch.no_grad():
        out, lse = pieces.run_forward(p, kernel, q, k, v, groups)
    return out, lse


def backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
             mask: AttentionMask) -> tuple[Any, Any, Any]:
    """``Platform.attention_backward`` on ``p`` (a torch platform), inputs checked."""
    device_type = p.device_type
    groups, form = _plan(device_type, q, k, mask)
    kernel = {"cpu": lambda: _cpu_backward(scale), "cuda": lambda: _cuda_backward(scale),
              "npu": lambda: _npu_backward(scale, form)}[device_type]()
    with torch.no_grad():
        return pieces.run_backward(p, kernel, dout, q, k, v, out, lse, groups)
