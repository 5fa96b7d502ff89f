"""Local attention for the torch backend, returning the output and its log-sum-exp."""

from __future__ import annotations

from typing import Any

import torch


def check_attention_shapes(q: Any, k: Any, v: Any) -> tuple[int, int]:
    """Validate BSHD shapes; return ``(heads, kv_heads)``."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention: q, k, v must be [batch, seq, heads, head_dim]; got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads, kv_heads = q.shape[2], k.shape[2]
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or heads % kv_heads:
        raise ValueError(
            f"attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} do not fit; k and v need "
            "the same shape, batch and head_dim must match q, and q's heads must be a multiple of kv heads"
        )
    return heads, kv_heads


def allowed_mask(sq: int, sk: int, causal: bool, mask: Any, device: Any) -> Any:
    """The boolean mask of allowed (query, key) pairs, or None when all are allowed."""
    allowed = None
    if causal:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    if mask is not None:
        mask = mask.to(device=device, dtype=torch.bool)
        allowed = mask if allowed is None else allowed & mask
    return allowed


def scores_lse(q: Any, k: Any, scale: float, allowed: Any) -> tuple[Any, Any]:
    """fp32 scores ``[B, H, Sq, Sk]`` (masked entries ``-inf``) and their log-sum-exp
    ``[B, H, Sq]``; a row with no allowed key gets ``-inf`` and clean (zero) gradients."""
    qf = q.transpose(1, 2).float()
    kf = k.transpose(1, 2).float()
    if kf.shape[1] != qf.shape[1]:
        kf = kf.repeat_interleave(qf.shape[1] // kf.shape[1], dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    # Rows that see no key have max -inf; shift them by 0 so exp gives 0, not NaN.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    total = torch.exp(scores - row_max).sum(dim=-1)
    seen = total > 0
    lse = torch.where(seen, torch.log(torch.where(seen, total, torch.ones_like(total))) + row_max.squeeze(-1),
                      torch.full_like(total, float("-inf")))
    return scores, lse


def plain_attention(q: Any, k: Any, v: Any, scale: float, allowed: Any) -> tuple[Any, Any]:
    """Attention with plain ops; softmax statistics in fp32."""
    scores, lse = scores_lse(q, k, scale, allowed)
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1)
    probs = torch.exp(scores - shift)
    vf = v.transpose(1, 2).float()
    if vf.shape[1] != probs.shape[1]:
        vf = vf.repeat_interleave(probs.shape[1] // vf.shape[1], dim=1)
    out = (probs @ vf).transpose(1, 2).to(q.dtype)
    return out, lse


def fused_attention(device_type: str, q: Any, k: Any, v: Any, scale: float, allowed: Any) -> tuple[Any, Any]:
    """Output from the device's fused kernel (SDPA on CUDA, ``npu_fusion_attention`` on
    Ascend); the log-sum-exp from plain fp32 ops so that its gradient is exact (the fused
    kernels do not differentiate their softmax statistics)."""
    _, lse = scores_lse(q, k, scale, allowed)
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers torch.ops.npu; imported only on NPU)

        atten_mask = None if allowed is None else ~allowed
        out = torch_npu.npu_fusion_attention(
            q, k, v, q.shape[2], input_layout="BSND", atten_mask=atten_mask, scale=scale,
            sparse_mode=0,
        )[0]
    else:
        heads, kv_heads = q.shape[2], k.shape[2]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed, scale=scale,
            enable_gqa=heads != kv_heads,
        ).transpose(1, 2)
    # A query that sees no key: the kernels return NaN there; the contract says 0.
    dead = torch.isinf(lse).transpose(1, 2).unsqueeze(-1)
    return torch.where(dead, torch.zeros_like(out), out), lse
