"""The decoder the job trains, as sizes: ``ModelConfig`` and the ``--model`` presets.
Plain data (no framework): the command line, the Hugging Face config reader
(``hf_config.py``) and the ranks all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Byte-level tokens: one token per byte.
VOCAB_SIZE = 256


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

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model: {name}={value!r} must be a positive integer")
        if self.dim % self.n_heads:
            raise ValueError(f"model: dim={self.dim} must be divisible by n_heads={self.n_heads} "
                             f"(head_dim = dim / n_heads); pick dim as a multiple of {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"model: head_dim={self.dim // self.n_heads} (dim / n_heads) must be even for rotary "
                             "embeddings, which rotate pairs of features; change dim or n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model: n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads} "
                             "(each key/value head serves n_heads / n_kv_heads query heads)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


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
}
