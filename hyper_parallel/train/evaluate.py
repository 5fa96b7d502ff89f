"""``hyper-parallel eval``: a checkpoint's mean next-byte loss and bits per byte on text, on
one rank (the checkpoint read whole whatever layout wrote it: ``generate.load_decoder``)::

    hyper-parallel eval runs/latest/checkpoints --data my_text/               # the held-out split
    hyper-parallel eval runs/latest/checkpoints --data notes.txt --split all  # all of the text

The batches are the job's validation batches (``data.global_batch`` with
``data.VALIDATION_STREAM``: batch ``i`` of ``batches`` from ``default_rng([seed, 1, i])``), of
the validation split ``data.Corpus`` holds out of ``--data`` (``split="validation"``) or of
all of its text joined as the corpus joins files (``split="all"``). With the checkpoint's own
seed, batch size and sequence length (its data record, the defaults) and the data it was
trained on, the loss is the job's validation loss of that checkpoint (``--batches`` the job's
``eval_batches``, 2). Bits per byte = loss / ln 2 (a token is a byte).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.platform import Platform
from hyper_parallel.train.data import VALIDATION_STREAM, Corpus, list_files, rank_batch, split_sizes

#: ``--split`` values: the held-out split of the corpus, or all of the text.
SPLITS = ("validation", "all")
#: ``--batches`` default: the job's validation batches (``TrainConfig.eval_batches``).
BATCHES = 2
#: A checkpoint without a data record (and the job's defaults): seed, batch size, sequence length.
DEFAULT_DATA = {"seed": 0, "batch_size": 8, "seq_len": 128}


@dataclass(frozen=True)
class EvalConfig:
    """What ``evaluate`` averages over.

    Attributes:
        data: files or folders of text (empty: the standard library's ``.py`` files).
        split: ``"validation"`` or ``"all"`` (``SPLITS``).
        seq_len: bytes per sequence (the model predicts ``seq_len`` next bytes of each).
        batch_size: sequences per batch.
        batches: batches averaged (each batch's mean loss, then their mean, as the job).
        seed: the batches' seed (``data.global_batch``).

    Raises:
        ValueError: a value out of range, named as its flag.
    """

    data: tuple[str, ...]
    split: str = "validation"
    seq_len: int = 128
    batch_size: int = 8
    batches: int = BATCHES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"--split={self.split!r} is not a split; use validation (the held-out text the job "
                             "validates on) or all (every byte of --data)")
        for flag, value in (("--seq-len", self.seq_len), ("--batch-size", self.batch_size),
                            ("--batches", self.batches)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag}={value!r} must be an integer >= 1")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed={self.seed!r} must be an integer >= 0 (it seeds numpy.random.default_rng)")


def check_data(cfg: EvalConfig) -> None:
    """``ValueError`` if ``cfg.data`` is missing or its split is shorter than one sequence,
    from the files' sizes (nothing read)."""
    validation = split_sizes(cfg.data)[1]
    size = validation if cfg.split == "validation" else sum(f.stat().st_size + 1 for f in list_files(cfg.data)) - 1
    if size < cfg.seq_len + 1:
        raise ValueError(f"the {cfg.split} split of --data has {size} bytes but one sequence needs "
                         f"{cfg.seq_len + 1} (--seq-len + 1); give more text, --split all, or a smaller --seq-len")


def eval_stream(cfg: EvalConfig) -> np.ndarray:
    """The ``uint8`` bytes the batches are drawn from (see the module docstring)."""
    if cfg.split == "validation":
        return Corpus.load(cfg.data, 1).validation
    return np.frombuffer(b"\n".join(f.read_bytes() for f in list_files(cfg.data)), np.uint8)


def evaluate(p: Platform, model: Any, stream: np.ndarray, cfg: EvalConfig) -> float:
    """The mean next-byte cross-entropy (nats) of ``model`` (a ``model.build_model``
    decoder on one rank) over ``cfg.batches`` batches of ``stream``: each batch's mean, then
    their mean (the job's ``_validation_loss`` on one rank)."""
    losses = []
    with p.no_grad():
        for index in range(cfg.batches):
            batch = rank_batch(stream, cfg.seed, index, cfg.batch_size, cfg.seq_len, 0, 1,
                               stream_id=VALIDATION_STREAM)
            loss = model(p.from_numpy(batch.tokens), p.from_numpy(batch.positions), p.from_numpy(batch.targets))
            losses.append(float(p.to_numpy(loss)))
    return float(np.mean(losses))


def bits_per_byte(loss: float) -> float:
    """Bits per byte of a mean next-byte loss in nats (a token is a byte)."""
    return loss / math.log(2)


def run_eval(args: Any) -> None:
    """``hyper-parallel eval``: every argument checked before the model is built, then one
    line: the loss, bits per byte, and what they were measured on."""
    from hyper_parallel.train.export import decoder_sizes, find_checkpoint
    from hyper_parallel.train.generate import describe, init_platform, load_decoder

    path, manifest = find_checkpoint(args.checkpoint)
    model_cfg = decoder_sizes(path, manifest)
    recorded = {**DEFAULT_DATA, **(manifest.get("data") or {})}
    given = {"seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len}
    cfg = EvalConfig(data=tuple(args.data), split=args.split, batches=args.batches,
                     **{key: recorded[key] if value is None else value for key, value in given.items()})
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"--seq-len={cfg.seq_len} is longer than the model's max_seq_len {model_cfg.max_seq_len} "
                         f"(its rotary tables end there); give --seq-len {model_cfg.max_seq_len} or less")
    check_data(cfg)
    p = init_platform(args.platform)
    loaded = load_decoder(p, path, manifest)
    print(f"{describe(loaded)}, {p.name}")
    loss = evaluate(p, loaded.model, eval_stream(cfg), cfg)
    where = " ".join(cfg.data) if cfg.data else "the standard library"
    print(f"loss {loss:.4f} nats/byte, {bits_per_byte(loss):.4f} bits/byte: {cfg.batches} batches of "
          f"{cfg.batch_size} x {cfg.seq_len} bytes (seed {cfg.seed}) from the {cfg.split} split of {where}")
