"""``hyper-parallel generate``: text from a checkpoint of the main job, on one rank.

The checkpoint is read whole in this process whatever layout wrote it (``export.find_checkpoint``
and ``export.decoder_state``: the pieces assembled by their boxes), the decoder is built on the
platform (``model.build_model``) with those values, and the bytes are generated one at a time
(tokens are bytes: ``prompt.encode("utf-8")``), with a key/value cache ([Note: incremental
decoding] in ``model.py``) or, with ``use_cache=False``, by running the whole sequence again
for each byte. No process group, no mesh::

    hyper-parallel generate runs/latest/checkpoints --prompt "def main():" --max-new-tokens 200
    hyper-parallel generate runs/latest/checkpoints --prompt "import " --top-k 20 --top-p 0.9 --seed 1

The next byte is picked from the last position's logits in numpy (float64), so both
frameworks pick the same bytes from the same logits: greedy (the argmax, the lowest id on a
tie) unless sampling is asked for (``Sampling``).
"""

from __future__ import annotations

import codecs
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.platform import Platform
from hyper_parallel.train.export import decoder_sizes, decoder_state, find_checkpoint, moe_biases
from hyper_parallel.train.model_config import ModelConfig

#: ``--max-new-tokens`` default.
MAX_NEW_TOKENS = 200


@dataclass(frozen=True)
class Sampling:
    """How the next byte is picked from the logits ``[vocab]`` of the last position.

    Attributes:
        sample: draw the byte (below); ``False``: greedy, the argmax (the others unused).
        temperature: the logits are divided by it before the softmax (> 0; below 1 sharper).
        top_k: keep the ``k`` most likely bytes (and any tied with the ``k``-th); ``None``: all.
        top_p: keep the fewest most likely bytes whose probabilities sum to at least ``p``
            (nucleus sampling, after ``top_k``), ``0 < p <= 1``; 1: all.
        seed: seeds ``numpy.random.default_rng``, which draws every byte of one generation.

    Raises:
        ValueError: a value outside the ranges above, named as its command-line flag.
    """

    sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"--temperature={self.temperature!r} must be a number > 0 (1: the model's own "
                             "distribution, below 1 sharper, above 1 flatter; for the most likely byte leave "
                             "sampling out: greedy is the default)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"--top-k={self.top_k!r} must be an integer >= 1 (the number of most likely bytes "
                             "kept); leave it out to keep all 256")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"--top-p={self.top_p!r} must be in (0, 1] (the probability mass of the most likely "
                             "bytes kept); 1 keeps all")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed={self.seed!r} must be an integer >= 0 (it seeds numpy.random.default_rng)")


def next_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next byte's id from ``logits`` ``[vocab]`` (any float dtype; computed in float64):
    the argmax (greedy), or a draw from ``rng`` of the tempered softmax restricted to
    ``top_k``, then ``top_p`` (renormalised)."""
    logits = np.asarray(logits, np.float64)
    if not sampling.sample:
        return int(np.argmax(logits))
    z = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < z.size:
        kth = np.sort(z)[-sampling.top_k]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if sampling.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        kept = order[:int(np.searchsorted(np.cumsum(probs[order]), sampling.top_p)) + 1]
        mask = np.zeros(probs.size, bool)
        mask[kept] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


def new_token_limit(cfg: ModelConfig, prompt_len: int) -> int:
    """The most bytes that can follow a prompt of ``prompt_len`` bytes: the last one is
    predicted at position ``max_seq_len - 1`` (the rotary tables end there)."""
    return cfg.max_seq_len - prompt_len + 1


def generate(p: Platform, model: Any, cfg: ModelConfig, prompt: bytes, max_new_tokens: int, sampling: Sampling,
             use_cache: bool = True) -> Iterator[int]:
    """Yield the ids of up to ``max_new_tokens`` bytes following ``prompt`` (at positions
    ``0 ..``), one at a time, fewer where ``new_token_limit`` stops them.

    Args:
        model: a decoder of ``cfg`` (``model.build_model``) on one rank, not parallelized.
        prompt: at least one byte, at most ``cfg.max_seq_len``.
        use_cache: feed only the new byte through a ``KVCache``; ``False``: run the whole
            sequence for each byte (the same bytes up to float rounding in the logits).

    Raises:
        ValueError: an empty prompt or one longer than ``cfg.max_seq_len``.
    """
    from hyper_parallel.train.model import KVCache

    check_prompt(prompt, cfg)
    tokens = list(prompt)
    rng = np.random.default_rng(sampling.seed)
    cache = KVCache(cfg.n_layers) if use_cache else None
    for _ in range(min(max_new_tokens, new_token_limit(cfg, len(prompt)))):
        start = 0 if cache is None else cache.length
        ids = np.asarray([tokens[start:]], np.int64)
        positions = np.arange(start, len(tokens), dtype=np.int64)[None]
        with p.no_grad():
            logits = model.logits(p.from_numpy(ids), p.from_numpy(positions), cache)
            last = p.to_numpy(logits[0, -1])
        token = next_token(last, sampling, rng)
        tokens.append(token)
        yield token


def check_prompt(prompt: bytes, cfg: ModelConfig) -> None:
    """``ValueError`` unless ``prompt`` has 1 to ``cfg.max_seq_len`` bytes."""
    if not prompt:
        raise ValueError("--prompt is empty; give at least one character to continue (the model has no "
                         "start-of-text token: it continues bytes)")
    if len(prompt) > cfg.max_seq_len:
        raise ValueError(f"--prompt is {len(prompt)} bytes (UTF-8) but the model's max_seq_len is "
                         f"{cfg.max_seq_len} (its rotary tables end there); give a prompt of at most "
                         f"{cfg.max_seq_len} bytes")


@dataclass
class LoadedDecoder:
    """A checkpoint's decoder, built on one rank."""

    path: Path         # the step folder read
    step: int
    cfg: ModelConfig
    model: Any         # model.build_model's module holding the checkpoint's values


def load_decoder(p: Platform, path: Path, manifest: dict[str, Any]) -> LoadedDecoder:
    """The decoder of the checkpoint ``path`` (``export.find_checkpoint``'s), on ``p``, with
    the checkpoint's values (read whole, whatever layout wrote them).

    Raises:
        ValueError: see ``export.decoder_state`` and ``export.moe_biases``.
    """
    from hyper_parallel.train.model import build_model
    from hyper_parallel.train.moe_model import moe_layers

    cfg, params = decoder_state(path, manifest)
    biases = moe_biases(path, manifest, cfg) if cfg.moe_experts else {}
    model = build_model(p, cfg, seed=0)  # initial values, each replaced below
    for name, value in params.items():
        p.set_parameter(model, name, p.make_parameter(p.from_numpy(np.ascontiguousarray(value))))
    for name, layer in moe_layers(p, model):  # the balance biases choose the experts as in training
        layer.expert_bias = biases[name].copy()
    return LoadedDecoder(path, int(manifest["step"]), cfg, model)


def describe(loaded: LoadedDecoder) -> str:
    cfg = loaded.cfg
    return (f"checkpoint {loaded.path} (step {loaded.step}; dim {cfg.dim}, {cfg.n_layers} layers, "
            f"max_seq_len {cfg.max_seq_len})")


def init_platform(name: str | None) -> Platform:
    """The platform of ``--platform`` (``None``: the selection rule), ``ValueError`` if it
    cannot run here."""
    from hyper_parallel.platform import backend_problem, init, requested_platform

    problem = backend_problem(name or requested_platform())
    if problem is not None:
        raise ValueError(f"--platform={name or requested_platform()!r} cannot run on this machine: {problem}; "
                         "choose another with --platform")
    return init(name)


def run_generate(args: Any) -> None:
    """``hyper-parallel generate``: every argument checked before the model is built, then
    the prompt and its continuation to stdout as they come (decoded with
    ``errors="replace"``), the checkpoint used to stderr."""
    sampling = Sampling(sample=args.sample or any(value is not None for value in (args.temperature, args.top_k,
                                                                                  args.top_p)),
                        temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k,
                        top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed)
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 0 (the bytes to generate)")
    prompt = args.prompt.encode("utf-8")
    path, manifest = find_checkpoint(args.checkpoint)
    cfg = decoder_sizes(path, manifest)
    check_prompt(prompt, cfg)
    p = init_platform(args.platform)
    loaded = load_decoder(p, path, manifest)
    limit = new_token_limit(cfg, len(prompt))
    stops = f"; stops after {limit} bytes (max_seq_len {cfg.max_seq_len})" if args.max_new_tokens > limit else ""
    how = (f"sampling (temperature {sampling.temperature}, top-k {sampling.top_k or 'all'}, top-p "
           f"{sampling.top_p}, seed {sampling.seed})" if sampling.sample else "greedy")
    print(f"{describe(loaded)}, {p.name}, {how}{'' if args.cache else ', no cache'}{stops}", file=sys.stderr,
          flush=True)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(decoder.decode(prompt))
    for token in generate(p, loaded.model, cfg, prompt, args.max_new_tokens, sampling, use_cache=args.cache):
        sys.stdout.write(decoder.decode(bytes([token])))
        sys.stdout.flush()
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    sys.stdout.flush()
