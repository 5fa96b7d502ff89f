"""torch's CPU flash kernel with log-sum-exp (``aten._scaled_dot_product_flash_attention_for_cpu``
and its ``_backward``), and a causal call split so that every thread of the kernel has work.

[Note: CPU causal thread balance]
The CPU kernel parallelizes its forward over ``batch x heads x query blocks`` in contiguous
ranges and its backward over ``batch x heads`` only. A causal call with fewer
``batch x heads`` than threads (Ulysses' local call: ``heads / cp`` heads over the whole
sequence) then idles threads in the backward, and in the forward gives the thread holding
a head's last query blocks most of the causal work. Measured on 4 threads (16-core host),
``[1, 16384, 2, 64]`` causal forward + backward: 1672 ms as one call, 917 ms split as below.

The split, for square causal ``S = 2h`` rows (``S`` a multiple of 4): the two halves of
the sequence, each top-left causal against itself, stacked as a batch of ``2 x batch``
(a reshape of BSHD, no copy); and the second half's queries against the first half's keys
without a mask, its rows cut in two and stacked likewise. Every stacked call has twice
the ``batch x heads``, and the same total work as the one call. The second half's two
partial results are merged by log-sum-exp ([Note: log-sum-exp merge]); the backward runs
both calls with the merged statistics and adds the shares (``dq`` of the second half,
``dk``/``dv`` of the first half's keys).
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.platform import attention_pieces as pieces
from hyper_parallel.platform.contract.attention import AttentionMask
from hyper_parallel.platform.torch.kernel_layout import bhsd

#: Shortest sequence the split runs on: below it a half holds too few of the kernel's
#: query blocks (256 rows from 768 queries up) for threads to gain.
BALANCE_MIN_SEQ = 1024


def forward_kernel(scale: float) -> pieces.ForwardKernel:
    """``kernel(q, k, v, causal) -> (out, lse)``: one CPU flash call on BSHD ``q``
    ``[batch, q_seq, heads, dim]``, ``k``/``v`` ``[batch, kv_seq, kv_heads, dim]`` (GQA
    native), top-left ``causal`` of any shape; ``out`` like ``q``, ``lse``
    ``[batch, heads, q_seq]`` in ``max(float32, dtype)``. Raises what the kernel raises."""
    def kernel(q: Any, k: Any, v: Any, causal: bool) -> tuple[Any, Any]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            bhsd(q), bhsd(k), bhsd(v), 0.0, causal, scale=scale)
        return bhsd(out), lse
    return kernel


def backward_kernel(scale: float) -> pieces.BackwardKernel:
    """``kernel(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)``: the CPU flash backward,
    shapes as ``forward_kernel``, given ``out``/``lse`` over every key the queries see
    (rows of this call's shares); gradients shaped and typed like ``q``, ``k``, ``v``."""
    def kernel(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool) -> tuple[Any, Any, Any]:
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse, 0.0, causal, scale=scale)
        return bhsd(dq), bhsd(dk), bhsd(dv)
    return kernel


def balanced(q: Any, k: Any, mask: AttentionMask) -> bool:
    """True when a call runs split ([Note: CPU causal thread balance]): square causal
    without documents, ``seq`` a multiple of 4 and at least ``BALANCE_MIN_SEQ``, and fewer
    ``batch x heads`` than the kernel's threads."""
    b, s, h = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    return (mask.causal != "none" and not mask.documents and s == int(k.shape[1]) and s % 4 == 0
            and s >= BALANCE_MIN_SEQ and b * h < torch.get_num_threads())


def _halves(x: Any) -> Any:
    """``[B, 2h, ...]`` -> ``[2B, h, ...]``: row ``j * h + i`` of batch ``b`` at ``(2b + j, i)``."""
    b, s = int(x.shape[0]), int(x.shape[1])
    return x.reshape(2 * b, s // 2, *x.shape[2:])


def _first_keys(x: Any) -> Any:
    """The first half's keys ``[B, h, ...]`` once per stacked quarter: ``[2B, h, ...]``."""
    b, h = int(x.shape[0]), int(x.shape[1]) // 2
    first = x[:, :h]
    return first.unsqueeze(1).expand(b, 2, *first.shape[1:]).reshape(2 * b, *first.shape[1:])


def _stat_halves(lse: Any) -> Any:
    """``[B, H, 2n]`` -> ``[2B, H, n]``, rows as ``_halves`` stacks them."""
    b, h, s = (int(n) for n in lse.shape)
    return lse.reshape(b, h, 2, s // 2).transpose(1, 2).reshape(2 * b, h, s // 2)


def _unstat_halves(lse: Any) -> Any:
    """The inverse of ``_stat_halves``."""
    b2, h, n = (int(x) for x in lse.shape)
    return lse.reshape(b2 // 2, 2, h, n).transpose(1, 2).reshape(b2 // 2, h, 2 * n)


def balanced_forward(p: Any, q: Any, k: Any, v: Any, scale: float) -> tuple[Any, Any]:
    """``Platform.attention`` of a square causal call split ([Note: CPU causal thread
    balance]): ``q``/``k``/``v`` BSHD with ``balanced``; ``(out [B, S, H, D], lse [B, H, S])``."""
    b, s, heads, d = (int(n) for n in q.shape)
    h = s // 2
    kernel = forward_kernel(scale)
    out_c, lse_c = kernel(_halves(q), _halves(k), _halves(v), True)  # [2B, h, H, D], [2B, H, h]
    out_f, lse_f = kernel(_halves(q[:, h:]), _first_keys(k), _first_keys(v), False)  # [2B, h/2, ...]
    out_c = out_c.reshape(b, 2, h, heads, d)
    lse_c = lse_c.reshape(b, 2, heads, h)
    tail = pieces.merge(p, (out_c[:, 1], lse_c[:, 1]), (out_f.reshape(b, h, heads, d), _unstat_halves(lse_f)))
    stat = pieces.stat_dtype(p, q.dtype)
    out = torch.cat([out_c[:, 0], tail[0].to(q.dtype)], 1)
    return out, torch.cat([lse_c[:, 0].to(stat), tail[1]], 2)


def balanced_backward(p: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                      scale: float) -> tuple[Any, Any, Any]:
    """``Platform.attention_backward`` of ``balanced_forward``'s split: both calls' kernel
    backwards with the merged ``out``/``lse``, their shares added in ``max(float32, dtype)``."""
    b, s = int(q.shape[0]), int(q.shape[1])
    h = s // 2
    kernel = backward_kernel(scale)
    dq_c, dk_c, dv_c = kernel(_halves(dout), _halves(q), _halves(k), _halves(v), _halves(out),
                              _stat_halves(lse), True)
    dq_f, dk_f, dv_f = kernel(_halves(dout[:, h:]), _halves(q[:, h:]), _first_keys(k), _first_keys(v),
                              _halves(out[:, h:]), _stat_halves(lse[:, :, h:]), False)
    acc = pieces.stat_dtype(p, q.dtype)
    dq = dq_c.reshape(q.shape).to(acc)
    dq[:, h:] += dq_f.reshape(b, h, *q.shape[2:]).to(acc)
    grads = []
    for whole, first, like in ((dk_c, dk_f, k), (dv_c, dv_f, v)):
        g = whole.reshape(like.shape).to(acc)
        g[:, :h] += first.reshape(b, 2, h, *like.shape[2:]).to(acc).sum(1)
        grads.append(g.to(like.dtype))
    return dq.to(q.dtype), grads[0], grads[1]
