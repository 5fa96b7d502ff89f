"""``Platform.local_attention``'s derived form: one ``attention`` forward and one
``attention_backward`` in a backend-neutral autograd function (a backend whose framework
ships fused attention with its own autograd, torch, overrides the member with it)."""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform.contract.attention import AttentionMask
from hyper_parallel.platform.contract.common import CustomFunction


class LocalAttention(CustomFunction):
    """``forward(ctx, p, q, k, v, scale, mask)``: BSHD ``q`` ``[batch, q_seq, heads, dim]``
    over ``k``/``v`` ``[batch, kv_seq, kv_heads, dim]`` -> ``[batch, q_seq, heads, dim]``
    in ``q``'s dtype; saves ``q``, ``k``, ``v``, the output and the log-sum-exp, as a
    fused kernel's own autograd does."""

    @staticmethod
    def forward(ctx: Any, p: Any, q: Any, k: Any, v: Any, scale: float | None, mask: AttentionMask) -> Any:
        out, lse = p.attention(q, k, v, scale=scale, mask=mask)
        # A detached alias: ``out`` itself on ctx would be a cycle through the autograd node.
        ctx.p, ctx.scale, ctx.mask, ctx.saved = p, scale, mask, (q, k, v, p.detach(out), lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Any) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved
        dq, dk, dv = ctx.p.attention_backward(dout, q, k, v, out, lse, scale=ctx.scale, mask=ctx.mask)
        return None, dq, dk, dv, None, None
