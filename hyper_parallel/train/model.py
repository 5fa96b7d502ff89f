"""The Llama-style decoder of ``hyper-parallel train``, defined once over the platform's
module classes (``Platform.module_types()``: a ``torch.nn.Module`` on torch, a
``mindspore.nn.Cell`` on MindSpore) and its ops, with the same parameter names on both, and
initialised from one counter-based stream computed by numpy, piece by piece, so that both
frameworks and every layout start from bit-identical weights ([Note: the job's initial weights]).

Architecture (Touvron et al., *LLaMA*, 2023; Ainslie et al., *GQA*, 2023): token embedding
``[vocab, dim]``; ``n_layers`` blocks of pre-norm attention and pre-norm SwiGLU MLP
(Shazeer, *GLU Variants Improve Transformer*, 2020) with residuals; RMSNorm (Zhang &
Sennrich, 2019); rotary position embeddings (Su et al., *RoFormer*, 2021) in the
rotate-half form; a final RMSNorm and an output head (or the embedding, tied).

[Note: per-head query/key norms]
With ``ModelConfig.qk_norm`` (Qwen3, Qwen3-MoE) each head's queries and keys ``[batch, seq,
heads, head_dim]`` are RMS-normalised over ``head_dim`` (``q_norm``, ``k_norm``: RMSNorm
weights ``[head_dim]``, epsilon ``norm_eps``, in float32 like the other norms) after the
projections and before the rotary embedding: ``transformers``' ``Qwen3MoeAttention``
order. They are norms (initial value 1, no draw: the other parameters' initial values
are unchanged). Under tensor parallelism each rank holds ``heads / tp`` whole heads and
the same whole ``[head_dim]`` weights; the weights' gradient on a rank sums over its own
heads only, so ``TP_PLAN`` places them as a sequence-parallel norm's (``SequenceParallel``:
``Replicate`` parameters whose gradient is all-reduced over ``tp``; the heads play the
sequence's part). Context parallelism and pipelines see no difference: the norm is per
token and per head.

Parameter names (both frameworks)::

    tok_embeddings.weight                       [vocab, dim]
    layers.{i}.attention_norm.weight            [dim]
    layers.{i}.attention.w{q,k,v,o}.weight      [heads*head_dim | kv_heads*head_dim | dim, ...]
    layers.{i}.attention.{q,k}_norm.weight      [head_dim]     (with ``qk_norm``: Qwen3's per-head norms)
    layers.{i}.ffn_norm.weight                  [dim]
    layers.{i}.feed_forward.w{1,3}.weight       [hidden, dim]
    layers.{i}.feed_forward.w2.weight           [dim, hidden]
    layers.{i}.moe....                          (instead of feed_forward in a mixture-of-experts
                                                block: ``moe_model.py``, ``--moe-experts``)
    norm.weight                                 [dim]
    output.weight                               [vocab, dim]   (absent when tied)

The forward takes ``tokens`` ``[batch, seq]`` int, ``positions`` ``[batch, seq]`` int (the
position of each token in its document, which indexes the rotary tables) and ``targets``
``[batch, seq]`` int, and returns the mean next-byte cross-entropy, a float32 scalar in nats;
``logits(tokens, positions)`` returns the logits ``[batch, seq, vocab]`` (the forward's, before
the loss: what ``hyper-parallel export`` checks against Hugging Face's Llama);
``logits(tokens, positions, cache)`` decodes incrementally (``KVCache``: ``hyper-parallel
generate``).
Attention runs through ``scaled_dot_product_attention``: the platform's fused kernels, forward and backward.
Modules reshape by ``-1`` heads so tensor parallelism (which leaves ``heads / tp`` heads on
each rank) needs no change here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hyper_parallel.core import tensor_ops
from hyper_parallel.core.context_parallel import scaled_dot_product_attention
from hyper_parallel.core.dtensor import philox
from hyper_parallel.core.fully_shard import Box, materialize
from hyper_parallel.platform import Activation, Platform
from hyper_parallel.train.model_config import ModelConfig
from hyper_parallel.train.moe_model import define_moe, moe_parameter_shapes


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
        if cfg.qk_norm:
            shapes[pre + "attention.q_norm.weight"] = (hd,)
            shapes[pre + "attention.k_norm.weight"] = (hd,)
        shapes[pre + "ffn_norm.weight"] = (cfg.dim,)
        if cfg.is_moe_block(i):
            shapes.update(moe_parameter_shapes(cfg, pre))
            continue
        shapes[pre + "feed_forward.w1.weight"] = (cfg.hidden_dim, cfg.dim)
        shapes[pre + "feed_forward.w2.weight"] = (cfg.dim, cfg.hidden_dim)
        shapes[pre + "feed_forward.w3.weight"] = (cfg.hidden_dim, cfg.dim)
    shapes["norm.weight"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


def _std(cfg: ModelConfig, name: str) -> float:
    """The initial normal's std of parameter ``name``: 0.02, the residual-branch outputs
    (``wo``, ``w2``, the experts' ``w2``) scaled by ``1/sqrt(2 n_layers)`` (GPT-2's scheme,
    which keeps the residual stream's variance from growing with depth)."""
    return 0.02 / np.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02


def _entry_points(cfg: ModelConfig, seed: int) -> dict[str, philox.RngState | None]:
    """Where each parameter's draw enters the stream of ``seed`` (``None``: a norm, all
    ones, no draw): the parameters in ``parameter_shapes`` order, each past the previous."""
    state = philox.RngState(seed)
    out: dict[str, philox.RngState | None] = {}
    for name, shape in parameter_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = None
            continue
        out[name] = state
        state = state.advanced("normal", int(np.prod(shape)))
    return out


def initial_piece(cfg: ModelConfig, seed: int, name: str, starts: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
    """The initial values of the box ``starts .. starts + lengths`` of parameter ``name``:
    float32 ``[*lengths]``, computed for that box alone (no other element is drawn).

    [Note: the job's initial weights] Norms are 1; every other matrix is normal with the
    std of ``_std``, drawn from one counter-based stream (core's ``philox``: [Note: random
    ops on DTensors]) in which each parameter has its own stretch, in ``parameter_shapes``
    order. Element ``i`` of a parameter takes its words at ``i``, so any rank's piece
    (a fully_shard chunk inside a tensor-parallel chunk, uneven ones included) is drawn in
    place and equals that box of the one-process weights bit for bit, on torch and
    MindSpore alike (numpy computes them).

    Raises:
        KeyError: ``name`` is not a parameter of ``cfg``'s decoder.
        ValueError: ``seed`` outside ``[0, 2**64)``.
    """
    entry = _entry_points(cfg, seed)[name]
    shape = parameter_shapes(cfg)[name]
    if entry is None:
        return np.ones(tuple(lengths), np.float32)
    return philox.draw("normal", {"mean": 0.0, "std": float(_std(cfg, name))}, entry, shape, tuple(starts),
                       tuple(lengths), np.dtype(np.float32))


#: Where the job's initial pieces come from: ``(name, starts, lengths)`` -> float32
#: ``[*lengths]``, the box ``starts .. starts + lengths`` of parameter ``name``. The seed's
#: draw (``initial_piece``) or an ``--hf-config`` folder's weights (``hf_weights``).
PieceSource = Callable[[str, Sequence[int], Sequence[int]], np.ndarray]


def initial_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Every parameter's whole float32 initial value ([Note: the job's initial weights])."""
    return {name: initial_piece(cfg, seed, name, (0,) * len(shape), shape)
            for name, shape in parameter_shapes(cfg).items()}


def initial_pieces(cfg: ModelConfig, seed: int, boxes: dict[str, Box], names: Sequence[str],
                   source: PieceSource | None = None) -> list[np.ndarray]:
    """This rank's piece of each parameter of ``names`` (``boxes``: ``local_boxes`` of the
    parallelized model), float32 of the box's lengths, in ``names`` order: what
    ``Optimizer.load_parameter_values`` writes in place. ``source``: where the pieces come
    from (``None``: the seed's draw, ``initial_piece``).

    Raises:
        ValueError: a box whose global shape is not the parameter's.
    """
    shapes = parameter_shapes(cfg)
    out = []
    for name in names:
        box = boxes[name]
        if tuple(box.shape) != shapes[name]:
            raise ValueError(f"initial_pieces: parameter {name} has global shape {tuple(box.shape)} on this rank, "
                             f"but the decoder declares {shapes[name]}")
        out.append(source(name, box.starts, box.lengths) if source is not None
                   else initial_piece(cfg, seed, name, box.starts, box.lengths))
    return out


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each float32 ``[max_seq_len, head_dim / 2]``: angle ``pos * theta^(-2i/head_dim)``,
    computed in float64 by numpy so both frameworks use identical tables."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) * 2 / cfg.head_dim)
    angles = np.arange(cfg.max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def build_model(p: Platform, cfg: ModelConfig, seed: int, *, values: bool = True, meta: bool = False) -> Any:
    """The decoder as the framework's module (``p.module_types().Module``: a
    ``torch.nn.Module`` or a ``mindspore.nn.Cell``), holding ``initial_weights(cfg, seed)``;
    with ``values=False`` its parameters keep the values the framework's constructors
    gave them (the job writes each rank's piece of the initial weights in place once the
    model is parallelized: ``initial_pieces``), and no whole initial value is computed.
    ``meta=True``: called inside ``p.module_types().meta_device()``, the parameters are
    the meta device's, holding no storage (``materialize_model`` gives them values once
    parallelized); implies ``values=False``."""
    model = _classes(p).Decoder(cfg)
    if values and not meta:
        for name, value in initial_weights(cfg, seed).items():
            p.set_parameter(model, name, p.make_parameter(p.from_numpy(value)))
    elif p.device_type != "cpu" and not meta:
        # the constructors made them in host memory: onto this platform's device, where
        # each rank's pieces are then written in place (seen on torch-cuda: an H200 run
        # failed in the first matmul with the weights left on the CPU)
        for name, param in list(p.named_parameters(model)):
            p.set_parameter(model, name, p.make_parameter(p.to_device(p.detach(param), p.device_type)))
    names = [name for name, _ in p.named_parameters(model)]
    if names != list(parameter_shapes(cfg)):
        raise RuntimeError(f"build_model: parameter names {names} differ from the declared {list(parameter_shapes(cfg))}")
    return model


def materialize_model(p: Platform, cfg: ModelConfig, seed: int, modules: Sequence[Any],
                      source: PieceSource | None = None) -> None:
    """The end of the job's meta-device build (``--init-device meta``): every parameter of
    ``modules`` (a ``build_model(meta=True)`` decoder or its pipeline stages, parallelized on
    the meta device) becomes a new parameter holding this rank's piece alone, computed by
    ``initial_piece`` for its box ([Note: the job's initial weights]: bit for bit the box of
    the one-process weights), through ``fully_shard.materialize``; no rank computes or holds
    a whole sharded parameter. The rotary tables are set again: constants, which
    MindSpore's factories made meta under the scope too. No communication. Build the
    optimizer after (the parameters are new objects). ``source``: the pieces' values
    (``None``: the seed's draw; ``initial_pieces``)."""
    classes = _classes(p)
    draw = source if source is not None else functools.partial(initial_piece, cfg, seed)
    for module in modules:
        materialize(module, lambda fqn, box: draw(fqn, box.starts, box.lengths))
        for _, sub in p.named_modules(module):
            if isinstance(sub, (classes.Decoder, classes.Stage)):
                classes.set_rope_tables(sub, cfg)


def _apply_rope(p: Platform, x: Any, cos: Any, sin: Any) -> Any:
    """Rotate feature pairs ``(i, i + head_dim/2)`` of ``x`` ``[batch, seq, heads, head_dim]`` by
    the angles whose cos/sin are ``[batch, seq, 1, head_dim/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x.narrow(-1, 0, half), x.narrow(-1, half, half)
    return p.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rms_norm(p: Platform, x: Any, weight: Any, eps: float) -> Any:
    """RMSNorm of ``x`` ``[..., width]`` times ``weight`` ``[width]``, normalized in float32
    whatever ``x``'s dtype (``--dtype bf16/fp16``: 1/rms of a float16 ``x`` overflows in the
    backward), then back to ``x``'s dtype (Llama's RMSNorm); for a float32 ``x`` both casts
    are no-ops."""
    x32 = x.float()
    return p.to_dtype(x32 * ((x32 * x32).mean(-1, True) + eps).rsqrt(), x.dtype) * weight


def _rope(module: Any, positions: Any) -> tuple[Any, Any]:
    """The rotary ``(cos, sin)`` ``[batch, seq, 1, head_dim/2]`` of int ``positions``
    ``[batch, seq]``, looked up in ``module``'s tables."""
    b, s = positions.shape
    return module.rope_cos[positions].reshape(b, s, 1, -1), module.rope_sin[positions].reshape(b, s, 1, -1)


class LayerCache:
    """One decoder block's keys and values of the tokens fed so far, each ``[batch, length,
    kv_heads, head_dim]`` (keys after RoPE, at the positions they were fed with), or ``None``
    before the first token."""

    def __init__(self) -> None:
        self.keys: Any = None
        self.values: Any = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[1])

    def extend(self, p: Platform, k: Any, v: Any) -> tuple[Any, Any, bool]:
        """Append the new tokens' ``k``/``v`` ``[batch, new, kv_heads, head_dim]``; returns
        every cached key and value and whether the new queries attend causally (see
        [Note: incremental decoding]).

        Raises:
            ValueError: several new tokens after cached ones.
        """
        if self.keys is None:
            self.keys, self.values = k, v
            return k, v, True
        if int(k.shape[1]) != 1:
            raise ValueError(f"KVCache: {int(k.shape[1])} new tokens after {self.length} cached ones; feed the "
                             "prompt into an empty cache, then one token at a time")
        self.keys, self.values = p.cat([self.keys, k], dim=1), p.cat([self.values, v], dim=1)
        return self.keys, self.values, False


class KVCache:
    """[Note: incremental decoding]
    ``Decoder.logits(tokens, positions, cache)`` runs only the new tokens through the
    decoder: each block's attention rotates the new queries and keys at their own
    ``positions`` (the same rotary tables as the full forward), appends the keys and values
    to its ``LayerCache`` and attends over all of them. The first call feeds the prompt into
    the empty cache (queries and keys are the same tokens: causal, as the full forward);
    each later call feeds one token, whose query sees every cached key (the past only: no
    mask). So the logits of the last token equal the full forward's of the whole sequence
    up to float rounding (``tests/train/test_generate.py`` checks greedy generation token
    for token). Without a cache the forward is the training forward, unchanged. The cache
    holds no parameters and is not part of the model's state."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        """Tokens fed so far (the position of the next one, when the first was at 0)."""
        return self.layers[0].length


def _head(h: Any, module: Any, tied: bool) -> Any:
    """``[batch, seq, vocab]`` logits of the normed residual stream ``h`` ``[batch, seq, dim]``:
    ``h @ W^T`` with ``W`` the output head (or the embedding, ``tied``)."""
    head = module.tok_embeddings.weight if tied else module.output.weight
    return h @ head.transpose(0, 1)


class _Classes:
    """The decoder's module classes on one platform, defined once over its
    ``module_types()`` (the framework's Module base and dense linear layer)."""

    def __init__(self, p: Platform) -> None:
        types = p.module_types()
        Module, Linear = types.Module, types.Linear
        float32 = p.dtype("float32")

        class RMSNorm(Module):
            """RMSNorm over the last dim, ``width`` features (``cfg.dim``; ``head_dim`` for
            the per-head query/key norms)."""

            def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
                super().__init__()
                self.eps = cfg.norm_eps
                self.weight = p.make_parameter(p.full((width or cfg.dim,), 1.0, float32))

            def forward(self, x: Any) -> Any:
                return _rms_norm(p, x, self.weight, self.eps)

        class Embedding(Module):
            """Rows of ``weight`` ``[vocab, dim]`` for int ids (the platform's embedding op)."""

            def __init__(self, cfg: ModelConfig) -> None:
                super().__init__()
                self.weight = p.make_parameter(p.zeros((cfg.vocab_size, cfg.dim), float32))

            def forward(self, tokens: Any) -> Any:
                return tensor_ops.embedding(tokens, self.weight)

        class CoreAttention(Module):
            """Causal softmax attention of ``[batch, seq, heads, head_dim]`` q/k/v (no parameters):
            the platform's fused kernels alone, sequence-parallel under ``ContextParallel``."""

            def forward(self, q: Any, k: Any, v: Any) -> Any:
                return scaled_dot_product_attention(q, k, v, is_causal=True)

        class Attention(Module):
            def __init__(self, cfg: ModelConfig) -> None:
                super().__init__()
                hd = self.head_dim = cfg.head_dim
                # in parameter order: wq, wk, wv, wo (bias-free)
                self.wq = Linear(cfg.dim, cfg.n_heads * hd, bias=False)
                self.wk = Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
                self.wv = Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
                self.wo = Linear(cfg.n_heads * hd, cfg.dim, bias=False)
                self.qk_norm = cfg.qk_norm
                if cfg.qk_norm:  # then q_norm, k_norm: [head_dim] each, Qwen3's order
                    self.q_norm = RMSNorm(cfg, hd)
                    self.k_norm = RMSNorm(cfg, hd)
                # the core attention is its own (parameter-free) module so that ContextParallel can hook it
                self.core = CoreAttention()

            def forward(self, x: Any, cos: Any, sin: Any, cache: LayerCache | None = None) -> Any:
                b, s, hd = x.shape[0], x.shape[1], self.head_dim
                q, k = self.wq(x).reshape(b, s, -1, hd), self.wk(x).reshape(b, s, -1, hd)
                if self.qk_norm:  # [Note: per-head query/key norms]
                    q, k = self.q_norm(q), self.k_norm(k)
                q, k = _apply_rope(p, q, cos, sin), _apply_rope(p, k, cos, sin)
                v = self.wv(x).reshape(b, s, -1, hd)
                if cache is None:
                    return self.wo(self.core(q, k, v).reshape(b, s, -1))
                # [Note: incremental decoding]; one rank: no ContextParallel hooks to bypass
                k, v, causal = cache.extend(p, k, v)
                return self.wo(scaled_dot_product_attention(q, k, v, is_causal=causal).reshape(b, s, -1))

        class FeedForward(Module):
            def __init__(self, cfg: ModelConfig) -> None:
                super().__init__()
                # in parameter order: w1, w2, w3 (bias-free)
                self.w1 = Linear(cfg.dim, cfg.hidden_dim, bias=False)
                self.w2 = Linear(cfg.hidden_dim, cfg.dim, bias=False)
                self.w3 = Linear(cfg.dim, cfg.hidden_dim, bias=False)

            def forward(self, x: Any) -> Any:
                return self.w2(p.activation(self.w1(x), Activation.SILU) * self.w3(x))

        class AttentionInputs(Module):
            """A dense block's math up to the core attention as a function of its weights,
            parameter-free: ``attention_norm``, the q/k/v projections, the per-head norms
            (``qk_norm``) and RoPE, as ``Attention.forward`` computes them.
            ``forward(x, cos, sin, norm, wq, wk, wv, *qk_norms)``: ``x`` ``[batch, seq,
            dim]``, ``cos``/``sin`` ``[batch, seq, 1, head_dim/2]``, ``norm`` ``[dim]``,
            ``wq`` ``[heads*head_dim, dim]``, ``wk``/``wv`` ``[kv_heads*head_dim, dim]``,
            ``qk_norms``: the per-head norms' ``[head_dim]`` weights with ``qk_norm``;
            returns ``(q, k, v)``, BSHD. The eager forward calls the modules (their hooks
            run); ``--compile`` on a compiler that traces hooks compiles this and
            ``BlockOutputs`` instead, the weights read outside them ([Note: what --compile
            compiles] in ``compile.py``, which says why this is straight-line code)."""

            def __init__(self, cfg: ModelConfig) -> None:
                super().__init__()
                self.eps, self.head_dim = cfg.norm_eps, cfg.head_dim

            def forward(self, x: Any, cos: Any, sin: Any, norm: Any, wq: Any, wk: Any, wv: Any, *qk_norms: Any) -> Any:
                b, s, hd = x.shape[0], x.shape[1], self.head_dim
                x = _rms_norm(p, x, norm, self.eps)
                # transpose(1, 0): a swap of the two dims on both frameworks (MindSpore's
                # Tensor.transpose takes a permutation; its jit bakes ``.T`` in as a constant)
                q = (x @ wq.transpose(1, 0)).reshape(b, s, -1, hd)
                k = (x @ wk.transpose(1, 0)).reshape(b, s, -1, hd)
                if qk_norms:
                    q, k = _rms_norm(p, q, qk_norms[0], self.eps), _rms_norm(p, k, qk_norms[1], self.eps)
                v = (x @ wv.transpose(1, 0)).reshape(b, s, -1, hd)
                return _apply_rope(p, q, cos, sin), _apply_rope(p, k, cos, sin), v

        class BlockOutputs(Module):
            """A dense block's math after the core attention as a function of its weights,
            parameter-free (see ``AttentionInputs``): ``forward(x, attended, wo, norm, w1,
            w2, w3)`` with the block's input ``x`` ``[batch, seq, dim]``, the core
            attention's output ``attended`` ``[batch, seq, heads, head_dim]``, ``wo`` ``[dim,
            heads*head_dim]``, ``ffn_norm``'s ``norm`` ``[dim]``, ``w1``/``w3`` ``[hidden,
            dim]``, ``w2`` ``[dim, hidden]``; returns the block's output ``[batch, seq,
            dim]``: the output projection and residual, ``ffn_norm``, the SwiGLU
            ``w2(silu(w1 x) * w3 x)`` and residual."""

            def __init__(self, cfg: ModelConfig) -> None:
                super().__init__()
                self.eps = cfg.norm_eps

            def forward(self, x: Any, attended: Any, wo: Any, norm: Any, w1: Any, w2: Any, w3: Any) -> Any:
                h = x + attended.reshape(x.shape[0], x.shape[1], -1) @ wo.transpose(1, 0)
                y = _rms_norm(p, h, norm, self.eps)
                gate = p.activation(y @ w1.transpose(1, 0), Activation.SILU)
                return h + (gate * (y @ w3.transpose(1, 0))) @ w2.transpose(1, 0)

        MoE = define_moe(p)

        class Block(Module):
            """Pre-norm residual block: attention, then the SwiGLU MLP (block ``index``) or,
            where ``cfg.is_moe_block(index)``, the mixture of experts (``moe_model``)."""

            def __init__(self, cfg: ModelConfig, index: int) -> None:
                super().__init__()
                self.attention_norm = RMSNorm(cfg)
                self.attention = Attention(cfg)
                self.ffn_norm = RMSNorm(cfg)
                self.is_moe = cfg.is_moe_block(index)
                if self.is_moe:
                    self.moe = MoE(cfg)
                else:
                    self.feed_forward = FeedForward(cfg)
                    # parameter-free: the math --compile compiles where hooks are traced
                    self.attention_inputs, self.block_outputs = AttentionInputs(cfg), BlockOutputs(cfg)

            def forward(self, x: Any, cos: Any, sin: Any, cache: LayerCache | None = None) -> Any:
                attended = self.attention(self.attention_norm(x), cos, sin) if cache is None else \
                    self.attention(self.attention_norm(x), cos, sin, cache)
                h = x + attended
                return h + (self.moe if self.is_moe else self.feed_forward)(self.ffn_norm(h))

        def set_rope_tables(module: Any, cfg: ModelConfig) -> None:
            # constants, not parameters: no gradient, not in named_parameters or checkpoints
            cos, sin = rope_tables(cfg)
            module.rope_cos, module.rope_sin = p.from_numpy(cos), p.from_numpy(sin)

        class Decoder(Module):
            def __init__(self, cfg: ModelConfig) -> None:
                super().__init__()
                self.tied = cfg.tie_embeddings
                self.tok_embeddings = Embedding(cfg)
                self.layers = types.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
                self.norm = RMSNorm(cfg)
                if not cfg.tie_embeddings:
                    self.output = Linear(cfg.dim, cfg.vocab_size, bias=False)
                set_rope_tables(self, cfg)

            def logits(self, tokens: Any, positions: Any, cache: KVCache | None = None) -> Any:
                """``[batch, seq, vocab]`` float32 next-byte logits of int ``tokens`` at ``positions``;
                with ``cache``, of the new ``tokens`` after the cached ones ([Note: incremental
                decoding]; one rank, not under ``parallelize``)."""
                cos, sin = _rope(self, positions)
                h = self.tok_embeddings(tokens)
                for i, layer in enumerate(self.layers):
                    h = layer(h, cos, sin) if cache is None else layer(h, cos, sin, cache.layers[i])
                return _head(self.norm(h), self, self.tied)

            def forward(self, tokens: Any, positions: Any, targets: Any) -> Any:
                """The mean next-byte cross-entropy, plus each MoE block's auxiliary balance
                loss with ``--moe-balance aux-loss`` ([Note: balance across layouts])."""
                loss = cross_entropy(p, self.logits(tokens, positions), targets)
                for layer in self.layers:
                    if layer.is_moe and layer.moe.aux_loss is not None:
                        loss = loss + layer.moe.aux_loss
                return loss

        class Stage(Module):
            """One pipeline stage of the decoder (``build_stage``)."""

            def __init__(self, cfg: ModelConfig) -> None:
                super().__init__()
                set_rope_tables(self, cfg)

            def forward(self, *inputs: Any) -> Any:
                return _stage_forward(p, self, inputs)

        self.Decoder, self.Stage, self.ModuleDict = Decoder, Stage, types.ModuleDict
        self.set_rope_tables = set_rope_tables


@functools.cache
def _classes(p: Platform) -> _Classes:
    """``p``'s decoder classes, defined on first use (one class identity per platform)."""
    return _Classes(p)


def cross_entropy(p: Platform, logits: Any, targets: Any) -> Any:
    """Mean next-byte cross-entropy (nats, float32 scalar) of ``logits`` ``[batch, seq,
    vocab]`` against int ``targets`` ``[batch, seq]``: the decoder's loss, and the loss of
    each pipeline microbatch on the last stage (the same arithmetic in both)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return p.cross_entropy(flat.float(), targets.reshape(-1), "mean")


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
    cos, sin = _rope(m, positions)
    for layer in m.layers.values():
        h = layer(h, cos, sin)
    if not m.last:
        return h, carried
    return _head(m.norm(h), m, tied=False)


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
    classes = _classes(p)
    stage = classes.Stage(cfg)
    blocks = classes.ModuleDict({str(i): model.layers[i] for i in layers})
    stage.first, stage.last = first, last
    if first:
        stage.tok_embeddings = model.tok_embeddings
    stage.layers = blocks
    if last:
        stage.norm, stage.output = model.norm, model.output
    return stage
