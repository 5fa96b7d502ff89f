"""The Llama-style decoder of ``hyper-parallel train``, built natively in torch and in
MindSpore with the same architecture and parameter names, and initialised from one numpy
generator so that both frameworks start from bit-identical weights.

Architecture (Touvron et al., *LLaMA*, 2023; Ainslie et al., *GQA*, 2023): token embedding
``[vocab, dim]``; ``n_layers`` blocks of pre-norm attention and pre-norm SwiGLU MLP
(Shazeer, *GLU Variants Improve Transformer*, 2020) with residuals; RMSNorm (Zhang &
Sennrich, 2019); rotary position embeddings (Su et al., *RoFormer*, 2021) in the
rotate-half form; a final RMSNorm and an output head (or the embedding, tied).

Parameter names (both frameworks)::

    tok_embeddings.weight                       [vocab, dim]
    layers.{i}.attention_norm.weight            [dim]
    layers.{i}.attention.w{q,k,v,o}.weight      [heads*head_dim | kv_heads*head_dim | dim, ...]
    layers.{i}.ffn_norm.weight                  [dim]
    layers.{i}.feed_forward.w{1,3}.weight       [hidden, dim]
    layers.{i}.feed_forward.w2.weight           [dim, hidden]
    norm.weight                                 [dim]
    output.weight                               [vocab, dim]   (absent when tied)

The forward takes ``tokens`` ``[batch, seq]`` int, ``positions`` ``[batch, seq]`` int (the
position of each token in its document, which indexes the rotary tables) and ``targets``
``[batch, seq]`` int, and returns the mean next-byte cross-entropy, a float32 scalar in nats;
``logits(tokens, positions)`` returns the logits ``[batch, seq, vocab]`` (the forward's, before
the loss: what ``hyper-parallel export`` checks against Hugging Face's Llama).
Attention runs through ``scaled_dot_product_attention``: the platform's fused kernels, forward and backward.
Modules reshape by ``-1`` heads so tensor parallelism (which leaves ``heads / tp`` heads on
each rank) needs no change here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel import scaled_dot_product_attention
from hyper_parallel.platform import Platform
from hyper_parallel.train.config import ModelConfig


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name and shape, in the fixed order initialisation draws them."""
    hd = cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        shapes[pre + "attention_norm.weight"] = (cfg.dim,)
        shapes[pre + "attention.wq.weight"] = (cfg.n_heads * hd, cfg.dim)
        shapes[pre + "attention.wk.weight"] = (cfg.n_kv_heads * hd, cfg.dim)
        shapes[pre + "attention.wv.weight"] = (cfg.n_kv_heads * hd, cfg.dim)
        shapes[pre + "attention.wo.weight"] = (cfg.dim, cfg.n_heads * hd)
        shapes[pre + "ffn_norm.weight"] = (cfg.dim,)
        shapes[pre + "feed_forward.w1.weight"] = (cfg.hidden_dim, cfg.dim)
        shapes[pre + "feed_forward.w2.weight"] = (cfg.dim, cfg.hidden_dim)
        shapes[pre + "feed_forward.w3.weight"] = (cfg.hidden_dim, cfg.dim)
    shapes["norm.weight"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


def initial_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """float32 initial values from ``numpy.random.default_rng(seed)``, drawn in
    ``parameter_shapes`` order: norms 1; other matrices normal with std 0.02, the
    residual-branch outputs (``wo``, ``w2``) scaled by ``1/sqrt(2 n_layers)`` (GPT-2's
    scheme, which keeps the residual stream's variance from growing with depth)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in parameter_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
            continue
        std = 0.02 / np.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
        out[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return out


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each float32 ``[max_seq_len, head_dim / 2]``: angle ``pos * theta^(-2i/head_dim)``,
    computed in float64 by numpy so both frameworks use identical tables."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) * 2 / cfg.head_dim)
    angles = np.arange(cfg.max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def build_model(p: Platform, cfg: ModelConfig, seed: int) -> Any:
    """The decoder as a ``torch.nn.Module`` or ``mindspore.nn.Cell`` (``p.framework``),
    holding ``initial_weights(cfg, seed)``."""
    cos, sin = rope_tables(cfg)
    model = _build_torch(p, cfg, cos, sin) if p.framework == "torch" else _build_mindspore(p, cfg, cos, sin)
    for name, value in initial_weights(cfg, seed).items():
        p.set_parameter(model, name, p.make_parameter(p.from_numpy(value)))
    names = [name for name, _ in p.named_parameters(model)]
    if names != list(parameter_shapes(cfg)):
        raise RuntimeError(f"build_model: parameter names {names} differ from the declared {list(parameter_shapes(cfg))}")
    return model


def _apply_rope(p: Platform, x: Any, cos: Any, sin: Any) -> Any:
    """Rotate feature pairs ``(i, i + head_dim/2)`` of ``x`` ``[batch, seq, heads, head_dim]`` by
    the angles whose cos/sin are ``[batch, seq, 1, head_dim/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return p.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attention(p: Platform, m: Any, x: Any, cos: Any, sin: Any, head_dim: int) -> Any:
    b, s = x.shape[0], x.shape[1]
    q = _apply_rope(p, m.wq(x).reshape(b, s, -1, head_dim), cos, sin)
    k = _apply_rope(p, m.wk(x).reshape(b, s, -1, head_dim), cos, sin)
    v = m.wv(x).reshape(b, s, -1, head_dim)
    # the core attention is its own (parameter-free) module so that ContextParallel can hook it
    out = m.core(q, k, v)
    return m.wo(out.reshape(b, s, -1))


def _add_linears(module: Any, linear: type, cfg: ModelConfig, kind: str) -> None:
    """Give ``module`` its bias-free linear layers (``linear(in, out, bias=False)``, the
    framework's class), in parameter order: ``attention`` wq, wk, wv, wo; ``feed_forward`` w1, w2, w3."""
    hd = cfg.head_dim
    sizes = ({"wq": (cfg.dim, cfg.n_heads * hd), "wk": (cfg.dim, cfg.n_kv_heads * hd),
              "wv": (cfg.dim, cfg.n_kv_heads * hd), "wo": (cfg.n_heads * hd, cfg.dim)} if kind == "attention" else
             {"w1": (cfg.dim, cfg.hidden_dim), "w2": (cfg.hidden_dim, cfg.dim), "w3": (cfg.dim, cfg.hidden_dim)})
    for name, (in_features, out_features) in sizes.items():
        setattr(module, name, linear(in_features, out_features, bias=False))


def _block(m: Any, x: Any, cos: Any, sin: Any) -> Any:
    """Pre-norm residual block: attention, then the SwiGLU MLP."""
    h = x + m.attention(m.attention_norm(x), cos, sin)
    return h + m.feed_forward(m.ffn_norm(h))


def _build_torch(p: Platform, cfg: ModelConfig, cos_table: np.ndarray, sin_table: np.ndarray) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(cfg.dim))

        def forward(self, x: Any) -> Any:
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * self.weight

    class CoreAttention(nn.Module):
        """Causal softmax attention of ``[batch, seq, heads, head_dim]`` q/k/v (no parameters):
        the platform's fused kernels alone, sequence-parallel under ``ContextParallel``."""

        def forward(self, q: Any, k: Any, v: Any) -> Any:
            return scaled_dot_product_attention(q, k, v, is_causal=True)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            _add_linears(self, nn.Linear, cfg, "attention")
            self.core = CoreAttention()

        def forward(self, x: Any, cos: Any, sin: Any) -> Any:
            return _attention(p, self, x, cos, sin, cfg.head_dim)

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            _add_linears(self, nn.Linear, cfg, "feed_forward")

        def forward(self, x: Any) -> Any:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = RMSNorm()
            self.attention = Attention()
            self.ffn_norm = RMSNorm()
            self.feed_forward = FeedForward()

        def forward(self, x: Any, cos: Any, sin: Any) -> Any:
            return _block(self, x, cos, sin)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleList([Block() for _ in range(cfg.n_layers)])
            self.norm = RMSNorm()
            if not cfg.tie_embeddings:
                self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            # constants, not parameters: no gradient, not in named_parameters or checkpoints
            self.register_buffer("rope_cos", torch.from_numpy(cos_table), persistent=False)
            self.register_buffer("rope_sin", torch.from_numpy(sin_table), persistent=False)

        def logits(self, tokens: Any, positions: Any) -> Any:
            """``[batch, seq, vocab]`` float32 next-byte logits of int ``tokens`` at ``positions``."""
            b, s = tokens.shape
            cos = self.rope_cos[positions].reshape(b, s, 1, -1)
            sin = self.rope_sin[positions].reshape(b, s, 1, -1)
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h, cos, sin)
            h = self.norm(h)
            head = self.tok_embeddings.weight if cfg.tie_embeddings else self.output.weight
            return h @ head.t()

        def forward(self, tokens: Any, positions: Any, targets: Any) -> Any:
            return cross_entropy(p, self.logits(tokens, positions), targets)

    return Decoder()


def _build_mindspore(p: Platform, cfg: ModelConfig, cos_table: np.ndarray, sin_table: np.ndarray) -> Any:
    import mindspore as ms
    from mindspore import mint, nn

    class RMSNorm(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.weight = ms.Parameter(mint.ones(cfg.dim), name="weight")

        def construct(self, x: Any) -> Any:
            return x * mint.rsqrt(mint.mean(x * x, -1, True) + cfg.norm_eps) * self.weight

    class CoreAttention(nn.Cell):
        """Causal softmax attention of ``[batch, seq, heads, head_dim]`` q/k/v (no parameters):
        the platform's fused kernels alone, sequence-parallel under ``ContextParallel``."""

        def construct(self, q: Any, k: Any, v: Any) -> Any:
            return scaled_dot_product_attention(q, k, v, is_causal=True)

    class Attention(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            _add_linears(self, mint.nn.Linear, cfg, "attention")
            self.core = CoreAttention()

        def construct(self, x: Any, cos: Any, sin: Any) -> Any:
            return _attention(p, self, x, cos, sin, cfg.head_dim)

    class FeedForward(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            _add_linears(self, mint.nn.Linear, cfg, "feed_forward")

        def construct(self, x: Any) -> Any:
            return self.w2(mint.nn.functional.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = RMSNorm()
            self.attention = Attention()
            self.ffn_norm = RMSNorm()
            self.feed_forward = FeedForward()

        def construct(self, x: Any, cos: Any, sin: Any) -> Any:
            return _block(self, x, cos, sin)

    class Embedding(nn.Cell):
        # MindSpore 2.10 has no CPU kernel for mint's Embedding; indexing the table is
        # the same gather, with a scatter-add gradient.
        def __init__(self) -> None:
            super().__init__()
            self.weight = ms.Parameter(mint.zeros((cfg.vocab_size, cfg.dim)), name="weight")

        def construct(self, tokens: Any) -> Any:
            return self.weight[tokens]

    class Decoder(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = Embedding()
            self.layers = nn.CellList([Block() for _ in range(cfg.n_layers)])
            self.norm = RMSNorm()
            if not cfg.tie_embeddings:
                self.output = mint.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            self.rope_cos = ms.Tensor(cos_table)
            self.rope_sin = ms.Tensor(sin_table)

        def logits(self, tokens: Any, positions: Any) -> Any:
            """``[batch, seq, vocab]`` float32 next-byte logits of int ``tokens`` at ``positions``."""
            b, s = tokens.shape
            cos = self.rope_cos[positions].reshape(b, s, 1, -1)
            sin = self.rope_sin[positions].reshape(b, s, 1, -1)
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h, cos, sin)
            h = self.norm(h)
            head = self.tok_embeddings.weight if cfg.tie_embeddings else self.output.weight
            return mint.matmul(h, head.T)

        def construct(self, tokens: Any, positions: Any, targets: Any) -> Any:
            return cross_entropy(p, self.logits(tokens, positions), targets)

    return Decoder()


def cross_entropy(p: Platform, logits: Any, targets: Any) -> Any:
    """Mean next-byte cross-entropy (nats, float32 scalar) of ``logits`` ``[batch, seq,
    vocab]`` against int ``targets`` ``[batch, seq]``: the decoder's loss, and the loss of
    each pipeline microbatch on the last stage (the same arithmetic in both)."""
    flat = logits.reshape(-1, logits.shape[-1])
    if p.framework == "torch":
        import torch.nn.functional as F

        return F.cross_entropy(flat.float(), targets.reshape(-1))
    import mindspore as ms
    from mindspore import mint

    # cross-entropy by log-sum-exp: MindSpore 2.10 has no CPU kernel for log_softmax.
    # The max is a constant shift (its gradient cancels), taken for range only.
    shift = ms.ops.stop_gradient(flat.amax(-1, keepdims=True))
    lse = mint.log(mint.sum(mint.exp(flat - shift), -1)) + shift.reshape(-1)
    picked = mint.gather(flat, 1, targets.reshape(-1, 1)).reshape(-1)
    return mint.mean(lse - picked)


def stage_layers(n_layers: int, num_stages: int) -> list[range]:
    """The decoder blocks of each pipeline stage: contiguous, in order, as even as
    possible (the later stages take one more when ``num_stages`` does not divide
    ``n_layers``; the first also runs the embedding, the last the norm and head).

    Raises:
        ValueError: fewer blocks than stages (a stage needs at least one).
    """
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"{num_stages} pipeline stages for {n_layers} decoder layers: each stage needs at least "
                         "one layer; use fewer stages or more layers")
    bounds = [s * n_layers // num_stages for s in range(num_stages + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def _stage_forward(p: Platform, m: Any, inputs: tuple[Any, ...]) -> Any:
    """One pipeline stage of the decoder. Stage 0 takes ``(tokens, positions)`` (int
    ``[batch, seq]``) and embeds; later stages take ``(h, positions_f)``: the residual
    stream float32 ``[batch, seq, dim]`` and the positions as float32 ``[batch, seq]``
    (exact below 2^24; a stage boundary carries floating tensors only), so each stage
    indexes its own rotary tables. The last stage returns the logits ``[batch, seq,
    vocab]``, the others ``(h, positions_f)``."""
    if m.first:
        tokens, positions = inputs
        h = m.tok_embeddings(tokens)
        carried = p.to_dtype(positions, p.dtype("float32"))
    else:
        h, carried = inputs
        positions = p.to_dtype(carried, p.dtype("int64"))
    b, s = positions.shape
    cos = m.rope_cos[positions].reshape(b, s, 1, -1)
    sin = m.rope_sin[positions].reshape(b, s, 1, -1)
    for layer in m.layers.values():
        h = layer(h, cos, sin)
    if not m.last:
        return h, carried
    h = m.norm(h)
    head = m.output.weight
    return h @ head.t() if p.framework == "torch" else h @ head.T


def build_stage(p: Platform, cfg: ModelConfig, model: Any, layers: range, first: bool, last: bool) -> Any:
    """The pipeline stage module of ``model`` (a ``build_model`` decoder) that runs blocks
    ``layers``, with the embedding when ``first`` and the final norm and output head when
    ``last`` (see ``_stage_forward`` for what crosses a stage boundary). It holds
    ``model``'s own submodules, so its parameters are ``model``'s, under the decoder's
    names (``tok_embeddings.weight``, ``layers.{i}...`` keyed by the block's index in the
    decoder, ``norm.weight``, ``output.weight``): unique across a rank's stages, as
    MindSpore's optimizer requires.

    Raises:
        ValueError: a tied output head on a pipeline (the embedding and the head would sit
            on different stages, whose gradients would have to be summed across them).
    """
    if cfg.tie_embeddings and not (first and last):
        raise ValueError("--tie-embeddings cannot be pipelined: the embedding sits on the first stage and the output "
                         "head on the last, so the shared weight would need its gradient summed across stages; drop "
                         "--tie-embeddings or --pp")
    cos, sin = rope_tables(cfg)
    if p.framework == "torch":
        import torch
        from torch import nn

        class Stage(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("rope_cos", torch.from_numpy(cos), persistent=False)
                self.register_buffer("rope_sin", torch.from_numpy(sin), persistent=False)

            def forward(self, *inputs: Any) -> Any:
                return _stage_forward(p, self, inputs)

        stage, blocks = Stage(), nn.ModuleDict({str(i): model.layers[i] for i in layers})
    else:
        import mindspore as ms
        from mindspore import nn

        class Stage(nn.Cell):  # type: ignore[no-redef]
            def __init__(self) -> None:
                super().__init__()
                self.rope_cos = ms.Tensor(cos)
                self.rope_sin = ms.Tensor(sin)

            def construct(self, *inputs: Any) -> Any:
                return _stage_forward(p, self, inputs)

        stage, blocks = Stage(), nn.CellDict({str(i): model.layers[i] for i in layers})
    stage.first, stage.last = first, last
    if first:
        stage.tok_embeddings = model.tok_embeddings
    stage.layers = blocks
    if last:
        stage.norm, stage.output = model.norm, model.output
    return stage
