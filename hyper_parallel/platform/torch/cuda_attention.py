"""Fused attention kernels on CUDA: which of torch's three kernels runs a call, how each is
called with log-sum-exp in and out, and the packed-documents (variable-length) path.

[Note: CUDA attention kernels]
torch ships three fused attention kernels on CUDA that return the log-sum-exp and have a
backward taking it back: FlashAttention-2 (``aten._flash_attention_forward`` /
``_backward``; Dao 2023), the memory-efficient kernel (``aten._scaled_dot_product_efficient_attention``
/ ``_backward``; xFormers' cutlass kernel) and cuDNN's fused attention
(``aten._scaled_dot_product_cudnn_attention`` / ``_backward``). A call runs the kernel
torch's own ``scaled_dot_product_attention`` would pick for the same shapes and dtype
(``torch._fused_sdp_choice``): the same kernel as the framework, and the same levers to
choose another (``torch.nn.attention.sdpa_kernel``, ``torch.backends.cuda.enable_*_sdp``).
Where torch would fall back to its math path, flash runs if it takes the dtype and
head_dim (float16/bfloat16, head_dim a multiple of 8 up to 256), else the efficient kernel.

Mask forms each takes natively (every other form runs as pieces, ``attention_pieces``):

| kernel | causal | documents |
|---|---|---|
| flash | bottom-right (its own causal), any shape without rows that see nothing; top-left when square | one varlen call (``cum_seq_q`` / ``cum_seq_k``) when every document has queries and keys and its causal form is native per document |
| efficient | top-left (torch's ``is_causal``), any shape | pieces |
| cudnn | square, the call whole (its pieces run on flash or efficient) | pieces on flash or efficient |

Grouped-query attention is native to flash; the efficient and cuDNN calls repeat K/V
heads (an ``O(seq)`` copy) and fold their gradients back. The log-sum-exp of every kernel
is handed out as ``[batch, heads, q_seq]`` float32 (efficient pads it to a multiple of 32
queries, cuDNN keeps a trailing 1, varlen flash gives ``[heads, total_q]``); a row that
sees no key never reaches a kernel (the native forms above exclude them; pieces skip them).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hyper_parallel.platform import attention_pieces as pieces
from hyper_parallel.platform.contract.attention import AttentionMask
from hyper_parallel.platform.packed_documents import one_call_takes, packed_rows, row_offsets
from hyper_parallel.platform.torch.kernel_layout import bhsd

FLASH, EFFICIENT, CUDNN = "flash", "efficient", "cudnn"
KERNELS = (FLASH, EFFICIENT, CUDNN)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_takes(q: Any) -> bool:
    """True when FlashAttention-2 takes ``q``'s dtype and head_dim."""
    return q.dtype in _FLASH_DTYPES and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def choose_kernel(q: Any, k: Any, v: Any) -> str:
    """The kernel (``FLASH``, ``EFFICIENT`` or ``CUDNN``) for BSHD ``q``/``k``/``v``: the one
    ``torch.nn.functional.scaled_dot_product_attention`` would run for them, or flash /
    efficient by dtype where torch would run its math path (see [Note: CUDA attention kernels]).
    Asked without ``is_causal``: torch's causal is top-left only, so it declines flash for
    non-square causal calls, which flash takes bottom-right aligned (the form context
    parallelism's blocks need); the mask form is planned per kernel (``plan``)."""
    gqa = q.shape[2] != k.shape[2]
    try:
        choice = torch._fused_sdp_choice(bhsd(q), bhsd(k), bhsd(v), None, 0.0, False, enable_gqa=gqa)
    except RuntimeError:  # every kernel torch may use is disabled for these inputs (sdpa_kernel)
        choice = -1
    backends = torch.nn.attention.SDPBackend
    if choice == int(backends.CUDNN_ATTENTION):
        return CUDNN
    if choice == int(backends.FLASH_ATTENTION) and flash_takes(q):
        return FLASH
    if choice == int(backends.EFFICIENT_ATTENTION):
        return EFFICIENT
    return FLASH if flash_takes(q) else EFFICIENT


def _repeat_kv(x: Any, group: int) -> Any:
    """``[B, S, Hkv, D]`` -> ``[B, S, Hkv * group, D]`` for kernels without grouped-query
    attention (an ``O(seq)`` copy, not a score matrix)."""
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _fold_kv(x: Any, group: int) -> Any:
    if group == 1:
        return x
    b, s, h, d = x.shape
    return x.reshape(b, s, h // group, group, d).sum(3)


def _rng_placeholders(device: Any) -> tuple[Any, Any]:
    """Flash's RNG state (seed, offset) for its backward: never read without dropout, so
    left uninitialized (no fill kernel)."""
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def _philox_placeholder(device: Any) -> Any:
    """The philox seed / offset the efficient and cuDNN backwards take (a scalar int64):
    never read without dropout."""
    return torch.empty((), dtype=torch.int64, device=device)


# -- one dense call per kernel ------------------------------------------------------------

def forward_kernel(name: str, scale: float) -> pieces.ForwardKernel:
    """``kernel(q, k, v, causal) -> (out, lse)`` on BSHD pieces for kernel ``name``;
    ``causal`` is flash's bottom-right, the others' top-left (equal on square pieces)."""
    def flash(q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Any]:
        res = torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal,
                                                      False, scale=scale)
        return res[0], res[1]

    def efficient(q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Any]:
        group = q.shape[2] // k.shape[2]
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            bhsd(q), bhsd(_repeat_kv(k, group)), bhsd(_repeat_kv(v, group)), None, True, 0.0, causal, scale=scale)
        # The efficient kernel pads its log-sum-exp to a multiple of 32 queries.
        return bhsd(res[0]), res[1][..., :q.shape[1]]

    def cudnn(q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Any]:
        group = q.shape[2] // k.shape[2]
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            bhsd(q), bhsd(_repeat_kv(k, group)), bhsd(_repeat_kv(v, group)), None, True, 0.0, causal, False,
            scale=scale)
        lse = res[1]
        # cuDNN keeps a trailing 1 on its statistics ([B, H, S, 1]); torch's ring merger squeezes it too.
        return bhsd(res[0]), lse.squeeze(-1) if lse.dim() == 4 else lse

    return {FLASH: flash, EFFICIENT: efficient, CUDNN: cudnn}[name]


def backward_kernel(name: str, scale: float) -> pieces.BackwardKernel:
    """``kernel(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)`` for kernel ``name``,
    given the output and log-sum-exp over every key the queries see."""
    def flash(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool) -> tuple[Any, Any, Any]:
        seed, offset = _rng_placeholders(q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, q.shape[1], k.shape[1], 0.0, causal, seed,
            offset, scale=scale)
        return dq, dk, dv

    def efficient(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool) -> tuple[Any, Any, Any]:
        group = q.shape[2] // k.shape[2]
        sq = q.shape[1]
        padded = math.ceil(sq / 32) * 32
        lse = torch.nn.functional.pad(lse.float(), (0, padded - sq), value=math.inf)
        seed = _philox_placeholder(q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            bhsd(dout), bhsd(q), bhsd(_repeat_kv(k, group)), bhsd(_repeat_kv(v, group)), None, bhsd(out), lse,
            seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return bhsd(dq), _fold_kv(bhsd(dk), group), _fold_kv(bhsd(dv), group)

    def cudnn(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool) -> tuple[Any, Any, Any]:
        group = q.shape[2] // k.shape[2]
        # Dense inputs: no cumulative lengths (an undefined tensor, None here, as torch's
        # own autograd passes them).
        seed = _philox_placeholder(q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            bhsd(dout), bhsd(q), bhsd(_repeat_kv(k, group)), bhsd(_repeat_kv(v, group)), bhsd(out),
            lse.float().contiguous().unsqueeze(-1), seed, seed, None, None, None, q.shape[1], k.shape[1], 0.0,
            causal, scale=scale)
        return bhsd(dq), _fold_kv(bhsd(dk), group), _fold_kv(bhsd(dv), group)

    return {FLASH: flash, EFFICIENT: efficient, CUDNN: cudnn}[name]


# -- planning -------------------------------------------------------------------------------

def plan(q: Any, k: Any, v: Any, mask: AttentionMask) -> tuple[str, list[pieces.Group] | None]:
    """The kernel a call runs and its groups (``None``: packed documents in one varlen call);
    a piece's ``causal`` is in the kernel's own alignment ([Note: CUDA attention kernels]).
    cuDNN runs only calls it takes whole (its frontend refuses some shapes, one query
    against one key among them); their pieces run on flash, or the efficient kernel.
    ``q`` ``[batch, q_seq, heads, head_dim]``, ``k``/``v`` ``[batch, kv_seq, kv_heads,
    head_dim]`` on CUDA; raises nothing itself (a kernel torch declines for every choice
    falls back to flash or efficient by dtype, whose own errors surface at the call)."""
    name = choose_kernel(q, k, v)
    q_seq, kv_seq = int(q.shape[1]), int(k.shape[1])
    if varlen_takes(name, mask):
        return name, None
    if name == CUDNN:
        groups = pieces.plan_pieces(q_seq, kv_seq, mask)
        if pieces.is_whole(groups, q_seq, kv_seq) and (q_seq, kv_seq) != (1, 1):
            return name, groups
        name = FLASH if flash_takes(q) else EFFICIENT
        if varlen_takes(name, mask):
            return name, None
    if not mask.documents and name == FLASH and mask.causal == "bottom_right" and kv_seq >= q_seq:
        return name, [pieces.Group(0, q_seq, (pieces.Piece(0, kv_seq, True),))]
    return name, pieces.plan_pieces(q_seq, kv_seq, mask, any_shape_top_left=name == EFFICIENT)


def varlen_takes(name: str, mask: AttentionMask) -> bool:
    """True when kernel ``name`` runs ``mask``'s packed documents in one variable-length
    call: flash, and ``packed_documents.one_call_takes`` (every document with queries and
    keys, its causal form native per document)."""
    return name == FLASH and one_call_takes(mask)


# -- packed documents: one variable-length flash call ------------------------------------------

def _cumulative(cu: tuple[int, ...], batch: int, seq: int, device: Any) -> tuple[Any, int]:
    """The document offsets of every batch row packed one after another (``[batch * docs + 1]``
    int32, [Note: packed rows]) and the longest document."""
    offsets = torch.from_numpy(row_offsets(cu, batch, seq).astype("int32"))
    return offsets.to(device), max(b - a for a, b in zip(cu, cu[1:]))


def _lse_rows(lse: Any, batch: int, seq: int) -> Any:
    """varlen flash's ``[heads, batch * seq]`` log-sum-exp -> ``[batch, heads, seq]``."""
    h = lse.shape[0]
    return lse.reshape(h, batch, seq).transpose(0, 1)


def varlen_forward(q: Any, k: Any, v: Any, scale: float, mask: AttentionMask) -> tuple[Any, Any]:
    """``Platform.attention`` of packed documents in one ``aten._flash_attention_forward`` call
    (the documents of every batch row packed as one ``[batch * q_seq, heads, head_dim]``).

    Args:
        q: ``[batch, q_seq, heads, head_dim]`` float16 / bfloat16; k, v:
            ``[batch, kv_seq, kv_heads, head_dim]``; ``mask`` with ``varlen_takes(FLASH, mask)``.

    Returns:
        ``(out [batch, q_seq, heads, head_dim] in q's dtype, lse [batch, heads, q_seq] float32)``.

    Raises:
        RuntimeError: this torch build's varlen flash returns its log-sum-exp in another
            layout than ``[heads, total_q]`` (refused rather than misread).
    """
    assert mask.cu_seqlens_q is not None and mask.cu_seqlens_kv is not None
    b, sq, h, d = q.shape
    sk = k.shape[1]
    cu_q, max_q = _cumulative(mask.cu_seqlens_q, b, sq, q.device)
    cu_k, max_k = _cumulative(mask.cu_seqlens_kv, b, sk, q.device)
    res = torch.ops.aten._flash_attention_forward(packed_rows(q), packed_rows(k), packed_rows(v), cu_q, cu_k, max_q,
                                                  max_k, 0.0, mask.causal != "none", False, scale=scale)
    lse = res[1]
    if lse.dim() != 2:
        raise RuntimeError(f"attention on torch-cuda: varlen flash returned a log-sum-exp of shape {tuple(lse.shape)}, "
                           "not [heads, total_q]; this torch build's flash kernel is not supported for packed "
                           "documents")
    return res[0].reshape(b, sq, h, d), _lse_rows(lse, b, sq).contiguous()


def varlen_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float,
                    mask: AttentionMask) -> tuple[Any, Any, Any]:
    """``Platform.attention_backward`` of packed documents in one
    ``aten._flash_attention_backward`` call, given ``out`` ``[batch, q_seq, heads, head_dim]``
    and ``lse`` ``[batch, heads, q_seq]`` over every key the queries see; returns
    ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``. Raises what torch's kernel
    raises (the inputs are checked by ``Platform.attention_backward`` before)."""
    assert mask.cu_seqlens_q is not None and mask.cu_seqlens_kv is not None
    b, sq, h, d = q.shape
    sk = k.shape[1]
    cu_q, max_q = _cumulative(mask.cu_seqlens_q, b, sq, q.device)
    cu_k, max_k = _cumulative(mask.cu_seqlens_kv, b, sk, q.device)
    lse_packed = lse.float().transpose(0, 1).reshape(h, b * sq).contiguous()
    seed, offset = _rng_placeholders(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        packed_rows(dout), packed_rows(q), packed_rows(k), packed_rows(v), packed_rows(out), lse_packed, cu_q, cu_k,
        max_q, max_k, 0.0, mask.causal != "none", seed, offset, scale=scale)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
