"""The decoder the job trains, as sizes: ``ModelConfig`` and the ``--model`` presets.
Plain data (no framework): the command line, the Hugging Face config reader
(``hf_config.py``) and the ranks all read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: Byte-level tokens: one token per byte.
VOCAB_SIZE = 256

#: ``--moe-balance`` values: how routed experts are kept evenly loaded. ``aux-free``: a
#: per-expert bias added to the router's scores for the top-k choice only, moved after
#: each step towards the mean load (DeepSeek-V3, arXiv 2412.19437, section 2.1.2);
#: ``aux-loss``: an auxiliary loss ``coef * E * sum_e f_e * P_e`` (Switch Transformer,
#: arXiv 2101.03961, eq. 4) per sequence (DeepSeek-V3's sequence-wise form, eq. 17-20);
#: ``none``: neither (the routing is the router's alone: how ``transformers`` trains
#: Mixtral by default, which ``--hf-config`` of a Mixtral maps to, ``hf_moe``).
MOE_BALANCES = ("aux-free", "aux-loss", "none")



@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder (Touvron et al., *LLaMA*, 2023): RMSNorm, rotary position
    embeddings, SwiGLU MLP, grouped-query attention, tied or untied output head.

    Attributes:
        dim: model width (features per token).
        n_layers: decoder blocks.
        n_heads: query heads; ``dim`` must be divisible by it.
        n_kv_heads: key/value heads (grouped-query attention); divides ``n_heads``.
        hidden_dim: SwiGLU inner width.
        max_seq_len: longest sequence the rotary tables cover.
        tie_embeddings: the output head reuses the token embedding matrix.
        rope_theta: rotary base frequency.
        norm_eps: RMSNorm epsilon.
        explicit_head_dim: each attention head's width where it is not ``dim / n_heads``
            (Qwen3-30B-A3B: dim 2048, 32 heads of 128); 0: ``dim / n_heads``. The
            projections are ``wq`` ``[n_heads * head_dim, dim]``, ``wk``/``wv``
            ``[n_kv_heads * head_dim, dim]``, ``wo`` ``[dim, n_heads * head_dim]``.
        qk_norm: each head's queries and keys are RMS-normalised over ``head_dim``
            (weights ``[head_dim]``, ``norm_eps``) before the rotary embedding, as
            Qwen3's ``q_norm``/``k_norm`` (``model.py``).
        moe_experts: routed experts of each mixture-of-experts block (0: a dense decoder;
            ``train/moe_model.py``).
        moe_top_k: routed experts per token, ``1 <= moe_top_k <= moe_experts``.
        moe_shared_experts: experts every token passes through besides the routed ones
            (DeepSeek-V3's shared experts; one SwiGLU of ``moe_shared_experts *
            moe_hidden_dim`` inner width).
        moe_every: every ``moe_every``-th block (blocks ``moe_every - 1``,
            ``2 * moe_every - 1``, ...) is a mixture of experts, the others dense.
        moe_hidden_dim: each expert's SwiGLU inner width (0: ``hidden_dim``).
        moe_norm_topk: with ``moe_top_k > 1`` the chosen experts' gates are renormalised
            to sum to 1 (Mixtral, DeepSeek-V3); false: the chosen probabilities as they are
            (Qwen3-MoE's ``norm_topk_prob: false``). Top-1 is never renormalised ([Note: the
            job's MoE routing]).
        moe_balance: ``MOE_BALANCES``.
        moe_aux_loss_coef: the auxiliary loss's weight (``aux-loss`` only).
        moe_bias_rate: the bias update speed gamma of ``aux-free`` (DeepSeek-V3: 0.001).
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    max_seq_len: int = 1024
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = VOCAB_SIZE
    explicit_head_dim: int = 0
    qk_norm: bool = False
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_every: int = 1
    moe_hidden_dim: int = 0
    moe_norm_topk: bool = True
    moe_balance: str = "aux-free"
    moe_aux_loss_coef: float = 0.01
    moe_bias_rate: float = 0.001

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model: {name}={value!r} must be a positive integer")
        explicit = self.explicit_head_dim
        if not isinstance(explicit, int) or isinstance(explicit, bool) or explicit < 0:
            raise ValueError(f"model: explicit_head_dim={explicit!r} must be an integer >= 0 (0: dim / n_heads)")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"model: qk_norm={self.qk_norm!r} must be true or false")
        if not explicit and self.dim % self.n_heads:
            raise ValueError(f"model: dim={self.dim} must be divisible by n_heads={self.n_heads} "
                             f"(head_dim = dim / n_heads); pick dim as a multiple of {self.n_heads}, or give "
                             "explicit_head_dim")
        if self.head_dim % 2:
            what = "explicit_head_dim" if explicit else "dim / n_heads"
            raise ValueError(f"model: head_dim={self.head_dim} ({what}) must be even for rotary embeddings, which "
                             "rotate pairs of features; change dim, n_heads or explicit_head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model: n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads} "
                             "(each key/value head serves n_heads / n_kv_heads query heads)")
        self._check_moe()

    def _check_moe(self) -> None:
        """The MoE fields (named by their flags: the command line sets them)."""
        for name in ("moe_experts", "moe_top_k", "moe_shared_experts", "moe_every", "moe_hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be an integer >= 0")
        if not isinstance(self.moe_norm_topk, bool):
            raise ValueError(f"--moe-norm-topk={self.moe_norm_topk!r} must be true or false")
        if not self.moe_experts:
            changed = [name for name, default in MOE_DEFAULTS.items() if getattr(self, name) != default]
            if changed:
                flags = ", ".join(f"--{name.replace('_', '-')}={getattr(self, name)!r}" for name in changed)
                raise ValueError(f"{flags} configure mixture-of-experts blocks, but --moe-experts is 0 (a dense "
                                 "decoder); give --moe-experts N (N >= 2) or drop them")
            return
        if self.moe_experts < 2:
            raise ValueError(f"--moe-experts={self.moe_experts} must be 0 (dense) or at least 2 (a router choosing "
                             "among one expert is a dense MLP); use --moe-experts 0 or a larger count")
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"--moe-top-k={self.moe_top_k} must be in [1, --moe-experts={self.moe_experts}] (each "
                             f"token goes to that many distinct experts); use a --moe-top-k of 1 to {self.moe_experts}")
        if not 1 <= self.moe_every <= self.n_layers:
            raise ValueError(f"--moe-every={self.moe_every} must be in [1, n_layers={self.n_layers}] (every L-th "
                             f"block is a mixture of experts, so L > n_layers leaves none); use 1 (all blocks) to "
                             f"{self.n_layers}")
        if self.moe_balance not in MOE_BALANCES:
            raise ValueError(f"--moe-balance={self.moe_balance!r} is not a balancing method; use one of "
                             f"{', '.join(MOE_BALANCES)}")
        for name in ("moe_aux_loss_coef", "moe_bias_rate"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a finite number >= 0")

    @property
    def head_dim(self) -> int:
        """Each attention head's width: ``explicit_head_dim``, or ``dim / n_heads``."""
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def expert_hidden_dim(self) -> int:
        """Each routed (and shared) expert's SwiGLU inner width."""
        return self.moe_hidden_dim or self.hidden_dim

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (0-based) is a mixture of experts: every ``moe_every``-th."""
        return self.moe_experts > 0 and (index + 1) % self.moe_every == 0


#: The MoE fields of ``ModelConfig`` and their values for a dense decoder (the fields'
#: defaults): a dense model's checkpoint record leaves them out (``records.model_record``),
#: so the checkpoints of dense runs written before MoE existed still resume.
MOE_DEFAULTS: dict[str, object] = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                                   if f.name.startswith("moe_")}

#: Fields added after checkpoints first recorded models (``records.model_record``), with the
#: value that means "as before": a record leaves such a field out at that value, so the
#: checkpoints written before it existed still resume and export.
LATER_DEFAULTS: dict[str, object] = {"explicit_head_dim": 0, "qk_norm": False, "moe_norm_topk": True}

#: ``--model`` presets. ``tiny`` is for tests (a few seconds per step on CPU); ``small`` is
#: the default job (about 0.8 M parameters, learns byte-level Python in minutes on CPU).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=64, max_seq_len=256),
    "small": ModelConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=352, max_seq_len=1024),
    "base": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, hidden_dim=1408, max_seq_len=2048),
    # Llama-style published shapes, for sharded runs. The names are the published sizes,
    # which count a 32k-50k-token embedding and head; with this job's 256 bytes the counts
    # are lower (parameter_shapes): 125m: GPT-3 Small's width and depth (Brown et al.,
    # 2020, table 2.1) with Llama's MLP (hidden = 8/3 dim, rounded up to 256) and 4
    # key/value heads, 76 M; 350m: GPT-3 Medium's (dim 1024, 24 layers, 16 heads), 271 M;
    # 1b: TinyLlama-1.1B's (Zhang et al., 2024: dim 2048, 22 layers, 32 heads, 4 key/value
    # heads, hidden 5632), 970 M.
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden_dim=2048, max_seq_len=2048),
    "350m": ModelConfig(dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, hidden_dim=2816, max_seq_len=2048),
    "1b": ModelConfig(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, hidden_dim=5632, max_seq_len=2048),
    # Mixtures of experts in DeepSeek-V3's shape (fine-grained routed experts narrower than
    # the dense MLP, one shared expert, top-2): moe-tiny for tests (block 1 of 2 is MoE, so
    # a run has a dense and an MoE block), moe-small for the job (every block MoE, 8 experts).
    "moe-tiny": ModelConfig(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=64, max_seq_len=256,
                            moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_every=2, moe_hidden_dim=32),
    "moe-small": ModelConfig(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=352, max_seq_len=1024,
                             moe_experts=8, moe_top_k=2, moe_shared_experts=1, moe_every=1, moe_hidden_dim=96),
}
