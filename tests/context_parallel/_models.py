"""Modules for the context-parallel tests, built natively in each framework (the
framework branch lives here, in test support)."""

from __future__ import annotations

from typing import Any

import hyper_parallel as hp
from hyper_parallel.core.context_parallel.attention import local_attention


def core_attention(p: Any, *, causal: bool, cu_seqlens: Any = None, layout: str = "BSHD",
                   functional: bool = True) -> Any:
    """A module ``(q, k, v) -> attention`` computed by ``hp.scaled_dot_product_attention``
    (``functional``) or directly by ``local_attention`` (an "other" implementation,
    BSHD only)."""

    def forward(q: Any, k: Any, v: Any) -> Any:
        if functional:
            return hp.scaled_dot_product_attention(q, k, v, is_causal=causal, cu_seqlens=cu_seqlens, layout=layout)
        return local_attention(q, k, v, is_causal=causal)

    return _qkv_module(p, forward, "CoreAttention")


def _identity_module(p: Any) -> Any:
    """A torch Module / MindSpore Cell whose forward returns its one argument."""
    if p.framework == "torch":
        import torch

        return type("Handoff", (torch.nn.Module,), {"forward": lambda self, x: x})()
    from mindspore import nn

    return type("MSHandoff", (nn.Cell,), {"construct": lambda self, x: x})()


def _qkv_module(p: Any, forward: Any, name: str) -> Any:
    """A torch Module / MindSpore Cell named ``name`` whose forward is ``forward(q, k, v)``."""
    if p.framework == "torch":
        import torch

        return type(name, (torch.nn.Module,), {"forward": lambda self, q, k, v: forward(q, k, v)})()
    from mindspore import nn

    return type(f"MS{name}", (nn.Cell,), {"construct": lambda self, q, k, v: forward(q, k, v)})()


def keyword_attention(p: Any, *, causal: bool) -> Any:
    """A module ``forward(query, key=None, value=None, cu_seqlens=None)`` (q, k, v and the
    packed-document boundaries by keyword or position) computed by
    ``hp.scaled_dot_product_attention``."""

    def forward(query: Any, key: Any, value: Any, cu_seqlens: Any) -> Any:
        return hp.scaled_dot_product_attention(query, key, value, is_causal=causal, cu_seqlens=cu_seqlens)

    if p.framework == "torch":
        import torch

        class KeywordAttention(torch.nn.Module):
            def forward(self, query: Any, key: Any = None, value: Any = None, cu_seqlens: Any = None) -> Any:
                return forward(query, key, value, cu_seqlens)

        return KeywordAttention()
    from mindspore import nn

    class MSKeywordAttention(nn.Cell):
        def construct(self, query: Any, key: Any = None, value: Any = None, cu_seqlens: Any = None) -> Any:
            return forward(query, key, value, cu_seqlens)

    return MSKeywordAttention()


def block_weights(dim: int, heads: int, kv_heads: int, head_dim: int, hidden: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(3)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    return {"q_proj.weight": w(heads * head_dim, dim), "k_proj.weight": w(kv_heads * head_dim, dim),
            "v_proj.weight": w(kv_heads * head_dim, dim), "o_proj.weight": w(dim, heads * head_dim),
            "fc1.weight": w(hidden, dim), "fc1.bias": w(hidden), "fc2.weight": w(dim, hidden), "fc2.bias": w(dim)}


#: q/k/v layouts of ``transformer_block(handoff_layout=...)``: from BSHD, and back
HANDOFF_LAYOUTS = {
    "BSHD": (lambda t: t, lambda t: t),
    "SBND": (lambda t: t.permute(1, 0, 2, 3), lambda t: t.permute(1, 0, 2, 3)),
    "TND": (lambda t: t[0], lambda t: t.unsqueeze(0)),  # batch 1
}


def transformer_block(p: Any, values: dict[str, Any], *, heads: int, head_dim: int, cu_seqlens: Any = None,
                      handoff_layout: str | None = None) -> Any:
    """``h = x + o_proj(attn(q_proj x, k_proj x, v_proj x)); out = h + fc2(relu(fc1(h)))``
    with causal attention through ``hp.scaled_dot_product_attention`` in the submodule
    ``attn`` (the one ContextParallel hooks). ``handoff_layout`` (``HANDOFF_LAYOUTS``): q, k,
    v pass through identity modules ``q_handoff`` / ``k_handoff`` / ``v_handoff`` in that
    layout, which ``attn`` takes and returns (MindFormers' multi-latent attention hands
    q/k/v to its core attention this way)."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")
    shapes = {n: values[f"{n}.weight"].shape for n in names}
    to, back = HANDOFF_LAYOUTS[handoff_layout or "BSHD"]

    def forward(m: Any, x: Any, relu: Any) -> Any:
        b, s = x.shape[0], x.shape[1]
        q = m.q_proj(x).reshape(b, s, heads, head_dim)
        k = m.k_proj(x).reshape(b, s, -1, head_dim)
        v = m.v_proj(x).reshape(b, s, -1, head_dim)
        if handoff_layout is not None:
            out = back(m.attn(m.q_handoff(to(q)), m.k_handoff(to(k)), m.v_handoff(to(v))))
        else:
            out = m.attn(q, k, v)
        h = x + m.o_proj(out.reshape(b, s, heads * head_dim))
        return h + m.fc2(relu(m.fc1(h)))

    if handoff_layout is None:
        attn = core_attention(p, causal=True, cu_seqlens=cu_seqlens)
    else:
        attn = _qkv_module(p, lambda q, k, v: to(hp.scaled_dot_product_attention(
            back(q), back(k), back(v), is_causal=True, cu_seqlens=cu_seqlens)), "HandoffAttention")
    handoffs = {} if handoff_layout is None else {f"{n}_handoff": _identity_module(p) for n in "qkv"}
    if p.framework == "torch":
        import torch

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                for n in names:
                    setattr(self, n, torch.nn.Linear(shapes[n][1], shapes[n][0], bias=n.startswith("fc")))
                self.attn = attn
                for n, module in handoffs.items():
                    setattr(self, n, module)

            def forward(self, x: Any) -> Any:
                return forward(self, x, torch.relu)

        model = Block()
    else:
        from mindspore import mint, nn

        class MSBlock(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                for n in names:
                    setattr(self, n, mint.nn.Linear(shapes[n][1], shapes[n][0], bias=n.startswith("fc")))
                self.attn = attn
                for n, module in handoffs.items():
                    setattr(self, n, module)

            def construct(self, x: Any) -> Any:
                return forward(self, x, mint.nn.functional.relu)

        model = MSBlock()
    for name, value in values.items():
        p.set_parameter(model, name, p.make_parameter(p.from_numpy(value)))
    return model


def bsh_attention(p: Any, *, heads: int, causal: bool) -> Any:
    """A module taking 3-D ``[batch, seq, heads * head_dim]`` q/k/v (BSH, MindFormers'
    colossal layout), viewing them as BSHD for ``hp.scaled_dot_product_attention`` and
    returning BSH."""

    def forward(q: Any, k: Any, v: Any) -> Any:
        b, s, hd = q.shape
        four = [t.reshape(b, s, heads if t is q else t.shape[-1] * heads // hd, hd // heads) for t in (q, k, v)]
        return hp.scaled_dot_product_attention(*four, is_causal=causal).reshape(b, s, hd)

    return _qkv_module(p, forward, "BSHAttention")


def tnd_attention(p: Any, *, causal: bool, cu_seqlens: Any) -> Any:
    """A module taking 3-D ``[tokens, heads, head_dim]`` q/k/v (TND, MindFormers' layout
    for packed documents), viewing them as BSHD with batch 1 for
    ``hp.scaled_dot_product_attention`` and returning TND."""

    def forward(q: Any, k: Any, v: Any) -> Any:
        four = [t.reshape(1, *t.shape) for t in (q, k, v)]
        out = hp.scaled_dot_product_attention(*four, is_causal=causal, cu_seqlens=cu_seqlens)
        return out.reshape(*out.shape[1:])

    return _qkv_module(p, forward, "TNDAttention")
