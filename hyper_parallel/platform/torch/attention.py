"""Fused attention kernels on torch: forward with log-sum-exp and the matching backward
(see [Note: attention kernels] in ``contract/attention``).

Which kernel runs:

| device | dtype | kernel | mask forms taken natively |
|---|---|---|---|
| cpu | float64, float32, bfloat16, float16 | ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``; ``platform/torch/cpu_attention.py``) | none, top-left causal of any shape; square causal with fewer batch x heads than threads split over more ([Note: CPU causal thread balance]) |
| cuda | float16, bfloat16, float32 | the kernel torch's own SDPA picks: FlashAttention-2, memory-efficient or cuDNN (``platform/torch/cuda_attention.py``, [Note: CUDA attention kernels]) | per kernel; flash takes packed documents in one varlen call |
| npu | float16, bfloat16, float32 | ``torch_npu.npu_fusion_attention`` (+ ``npu_fusion_attention_grad``) | none, top-left (``sparse_mode`` 2), bottom-right with ``kv_seq >= q_seq`` (3); packed documents in one TND call (``actual_seq_qlen`` / ``actual_seq_kvlen``, ``packed_documents.one_call_takes``) |

Every other form (bottom-right where not native, packed documents a kernel does not take
in one call) runs as pieces of the
native forms merged by log-sum-exp (``platform.attention_pieces``): never a score matrix.
Layouts: the contract is BSHD; torch's SDPA kernels take ``[batch, heads, seq, dim]``,
which is a transposed view here (no copy), and NPU takes BSND as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.platform import attention_pieces as pieces
from hyper_parallel.platform.contract.attention import AttentionMask
from hyper_parallel.platform.packed_documents import TndCall, packed_rows, tnd_call
from hyper_parallel.platform.torch import cpu_attention as cpu
from hyper_parallel.platform.torch import cuda_attention as cuda
from hyper_parallel.platform.contract.validation import check_attention_inputs

_CPU_DTYPES = ("float64", "float32", "bfloat16", "float16")
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
              "torch-cuda": "_flash_attention_forward / _scaled_dot_product_efficient_attention / "
                            "_scaled_dot_product_cudnn_attention",
              "torch-npu": "npu_fusion_attention"}[backend]
    check_attention_inputs(q, k, v, mask, names, supported, backend=backend, kernel=kernel)


# -- CPU ------------------------------------------------------------------------------------

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
        softmax_max = lse.float().unsqueeze(-1).expand(*lse.shape, 8).contiguous()
        softmax_sum = torch.ones_like(softmax_max)
        dq, dk, dv = torch_npu.npu_fusion_attention_grad(
            q, k, v, dout, q.shape[2], "BSND", atten_mask=_npu_mask(q.device) if mode else None,
            softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, scale_value=scale, keep_prob=1.0,
            sparse_mode=mode)[:3]
        return dq, dk, dv
    return kernel


def _npu_tnd_forward(q: Any, k: Any, v: Any, scale: float, mask: AttentionMask,
                     call: TndCall) -> tuple[Any, Any]:
    """Packed documents in one ``npu_fusion_attention`` call, layout TND ([Note: packed rows]):
    ``sparse_mode`` 3 (bottom-right causal per sequence) or 0, ``actual_seq_qlen`` /
    ``actual_seq_kvlen`` the sequences' cumulative ends. Returns ``(out [batch, q_seq,
    heads, head_dim], lse [batch, heads, q_seq] float32)``, the statistics read back
    token-major ([Note: TND softmax statistics])."""
    import torch_npu  # imported only on NPU: it needs Ascend CANN

    b, sq, h, d = q.shape
    causal = mask.causal != "none"
    res = torch_npu.npu_fusion_attention(
        packed_rows(q), packed_rows(k), packed_rows(v), h, "TND",
        atten_mask=_npu_mask(q.device) if causal else None, scale=scale, keep_prob=1.0,
        sparse_mode=3 if causal else 0, actual_seq_qlen=list(call.actual_seq_qlen),
        actual_seq_kvlen=list(call.actual_seq_kvlen))
    out, softmax_max, softmax_sum = res[0], res[1], res[2]  # max/sum: [T, N, 8], per-sequence head-major
    stat = softmax_max.reshape(-1, 8)[:, 0] + torch.log(softmax_sum.reshape(-1, 8)[:, 0])
    lse = stat[torch.from_numpy(call.to_tokens).to(q.device)].reshape(b, sq, h).transpose(1, 2)
    return out.reshape(b, sq, h, d), lse.contiguous()


def _npu_tnd_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float, mask: AttentionMask,
                      call: TndCall) -> tuple[Any, Any, Any]:
    """``npu_fusion_attention_grad`` of ``_npu_tnd_forward``'s call, given ``lse``
    ``[batch, heads, q_seq]`` over every key the queries see (max = lse, sum = 1, laid out
    as the kernel's statistics)."""
    import torch_npu  # imported only on NPU: it needs Ascend CANN

    h = q.shape[2]
    causal = mask.causal != "none"
    tokens = lse.float().transpose(1, 2).reshape(-1)  # [T * N], token-major
    softmax_max = tokens[torch.from_numpy(call.to_kernel).to(q.device)].reshape(-1, h, 1).expand(-1, h, 8)
    softmax_max = softmax_max.contiguous()
    softmax_sum = torch.ones_like(softmax_max)
    dq, dk, dv = torch_npu.npu_fusion_attention_grad(
        packed_rows(q), packed_rows(k), packed_rows(v), packed_rows(dout), h, "TND",
        atten_mask=_npu_mask(q.device) if causal else None, softmax_max=softmax_max, softmax_sum=softmax_sum,
        attention_in=packed_rows(out), scale_value=scale, keep_prob=1.0, sparse_mode=3 if causal else 0,
        actual_seq_qlen=list(call.actual_seq_qlen), actual_seq_kvlen=list(call.actual_seq_kvlen))[:3]
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def _npu_tnd(q: Any, k: Any, mask: AttentionMask) -> TndCall | None:
    return tnd_call(mask, int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[2]))


# -- local attention: torch's own SDPA -------------------------------------------------------

def local(p: Any, q: Any, k: Any, v: Any, is_causal: bool, scale: float | None) -> Any | None:
    """``Platform.local_attention`` through ``torch.nn.functional.scaled_dot_product_attention``
    (BSHD in and out, transposed views), or None where torch would run its math path (a
    score matrix: the derived function runs this module's kernels instead) and on NPU.
    The kernel torch runs is the one ``attention`` runs (CPU: the same flash kernel; CUDA:
    the same choice, [Note: CUDA attention kernels]); torch's autograd saves and runs its
    backward in C++, which a Python autograd function cannot match in host time.

    Args:
        q: ``[batch, q_seq, heads, head_dim]``; k, v: ``[batch, kv_seq, kv_heads,
            head_dim]`` (grouped-query attention through SDPA's ``enable_gqa``), checked by
            ``check_inputs`` before; ``is_causal`` top-left, as torch's.

    Returns:
        ``[batch, q_seq, heads, head_dim]`` in ``q``'s dtype (a transposed view of SDPA's
        output), or None (the caller runs the derived function).

    Raises:
        RuntimeError: what torch's SDPA raises for inputs its chosen kernel refuses.
    """
    if p.device_type == "npu":
        return None
    gqa = q.shape[2] != k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # Traced by torch.compile, the compiler lowers SDPA itself (a fused kernel or its
    # attention pattern), and the kernel choice, an int, would break the graph.
    if not torch.compiler.is_compiling():
        try:
            choice = torch._fused_sdp_choice(qt, kt, vt, None, 0.0, is_causal, scale=scale, enable_gqa=gqa)
        except RuntimeError:  # every kernel torch may use is disabled for these inputs (sdpa_kernel)
            return None
        if choice == int(torch.nn.attention.SDPBackend.MATH):
            return None
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=is_causal, scale=scale,
                                                           enable_gqa=gqa)
    return out.transpose(1, 2)


# -- dispatch --------------------------------------------------------------------------------

def _plan(device_type: str, q: Any, k: Any, mask: AttentionMask) -> tuple[list[pieces.Group], str]:
    """The pieces to run and the causal form a piece's ``causal`` flag means for the
    kernel (NPU takes bottom-right natively; the CPU kernel runs top-left pieces)."""
    sq, sk = int(q.shape[1]), int(k.shape[1])
    if device_type == "npu" and not mask.documents and mask.causal == "bottom_right" and sk >= sq:
        return [pieces.Group(0, sq, (pieces.Piece(0, sk, True),))], "bottom_right"
    return pieces.plan_pieces(sq, sk, mask, any_shape_top_left=True), "top_left"


def cuda_kernel(q: Any, k: Any, v: Any, mask: AttentionMask) -> str:
    """The CUDA kernel a call on these inputs runs (one of ``cuda_attention.KERNELS``)."""
    return cuda.plan(q, k, v, mask)[0]


def forward(p: Any, q: Any, k: Any, v: Any, scale: float, mask: AttentionMask) -> tuple[Any, Any]:
    """``Platform.attention`` on ``p`` (a torch platform), inputs checked."""
    device_type = p.device_type
    with torch.no_grad():
        if device_type == "cuda":
            name, cuda_groups = cuda.plan(q, k, v, mask)
            if cuda_groups is None:
                return cuda.varlen_forward(q, k, v, scale, mask)
            return pieces.run_forward(p, cuda.forward_kernel(name, scale), q, k, v, cuda_groups)
        if device_type == "npu" and (tnd := _npu_tnd(q, k, mask)) is not None:
            return _npu_tnd_forward(q, k, v, scale, mask, tnd)
        if device_type == "cpu" and cpu.balanced(q, k, mask):
            return cpu.balanced_forward(p, q, k, v, scale)
        groups, form = _plan(device_type, q, k, mask)
        kernel = cpu.forward_kernel(scale) if device_type == "cpu" else _npu_forward(scale, form)
        return pieces.run_forward(p, kernel, q, k, v, groups)


def backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
             mask: AttentionMask) -> tuple[Any, Any, Any]:
    """``Platform.attention_backward`` on ``p`` (a torch platform), inputs checked."""
    device_type = p.device_type
    with torch.no_grad():
        if device_type == "cuda":
            name, cuda_groups = cuda.plan(q, k, v, mask)
            if cuda_groups is None:
                return cuda.varlen_backward(dout, q, k, v, out, lse, scale, mask)
            return pieces.run_backward(p, cuda.backward_kernel(name, scale), dout, q, k, v, out, lse, cuda_groups)
        if device_type == "npu" and (tnd := _npu_tnd(q, k, mask)) is not None:
            return _npu_tnd_backward(dout, q, k, v, out, lse, scale, mask, tnd)
        if device_type == "cpu" and cpu.balanced(q, k, mask):
            return cpu.balanced_backward(p, dout, q, k, v, out, lse, scale)
        groups, form = _plan(device_type, q, k, mask)
        kernel = cpu.backward_kernel(scale) if device_type == "cpu" else _npu_backward(scale, form)
        return pieces.run_backward(p, kernel, dout, q, k, v, out, lse, groups)
