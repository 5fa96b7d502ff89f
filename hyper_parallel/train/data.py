"""Byte-level text data: a corpus of real text as one ``uint8`` token stream per split, and
the batches of a step, split over data-parallel ranks.

Tokens are bytes (vocabulary 256), so nothing is downloaded and no tokenizer is trained.
The default corpus is the ``.py`` source of the running interpreter's standard library.

[Note: deterministic batches]
The batch of step ``t`` depends only on ``(seed, t)``: its sequence start offsets come from
``numpy.random.default_rng([seed, t])``. Every rank draws the same global batch and keeps
its own share, a resumed run draws exactly the batches the uninterrupted run drew, and a
single-process reference sees the same tokens as an N-rank run.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: One validation file in this many (by sorted path) when the corpus has enough files.
VALIDATION_EVERY = 20

#: The validation batches are drawn with this stream id (the train batches with 0), see
#: ``global_batch``: the job's validation loss and ``hyper-parallel eval`` draw the same.
VALIDATION_STREAM = 1


def default_corpus_root() -> Path:
    """The standard library folder of this interpreter (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """The files of ``paths`` (files kept as given; folders walked for every file, recursively),
    each once, in sorted order. With no paths: every ``.py`` file of the standard library,
    outside ``site-packages``.

    Raises:
        ValueError: a path that does not exist, or no file found.
    """
    files: set[Path] = set()
    if not paths:
        root = default_corpus_root()
        files = {f for f in root.rglob("*.py") if "site-packages" not in f.parts and "dist-packages" not in f.parts}
        where = f"the standard library at {root}"
    else:
        for raw in paths:
            path = Path(raw)
            if path.is_file():
                files.add(path.resolve())
            elif path.is_dir():
                files.update(f.resolve() for f in path.rglob("*") if f.is_file())
            else:
                raise ValueError(f"--data {raw!r}: no such file or folder; give text files or folders of them")
        where = "--data " + " ".join(paths)
    if not files:
        raise ValueError(f"no text files found in {where}")
    return sorted(files)


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams, ``uint8`` ``[n_tokens]`` each; files are joined
    with a newline between them."""

    train: np.ndarray
    validation: np.ndarray
    n_files: int

    @classmethod
    def load(cls, paths: tuple[str, ...] | list[str], min_tokens: int) -> Corpus:
        """Read the files and split them: every ``VALIDATION_EVERY``-th file (in sorted path
        order) is validation, so both splits sample the whole corpus; with fewer files the
        last tenth of the stream is validation.

        Raises:
            ValueError: a split is shorter than ``min_tokens`` (one sequence plus its target).
        """
        files = list_files(paths)
        blobs = [f.read_bytes() for f in files]
        if len(files) >= 2 * VALIDATION_EVERY:
            train = b"\n".join(b for i, b in enumerate(blobs) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1)
            validation = b"\n".join(b for i, b in enumerate(blobs) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1)
        else:
            stream = b"\n".join(blobs)
            cut = len(stream) - len(stream) // 10
            train, validation = stream[:cut], stream[cut:]
        check_split_sizes(len(train), len(validation), min_tokens)
        return cls(np.frombuffer(train, np.uint8), np.frombuffer(validation, np.uint8), len(files))


def split_sizes(paths: tuple[str, ...] | list[str]) -> tuple[int, int]:
    """The bytes of the train and validation splits ``Corpus.load`` makes of ``paths``, from
    the files' sizes (nothing read): what the command line checks before any rank starts.

    Raises:
        ValueError: see ``list_files``.
    """
    sizes = [f.stat().st_size for f in list_files(paths)]
    if len(sizes) >= 2 * VALIDATION_EVERY:
        held = [i % VALIDATION_EVERY == VALIDATION_EVERY - 1 for i in range(len(sizes))]
        train = [s for s, h in zip(sizes, held) if not h]
        validation = [s for s, h in zip(sizes, held) if h]
        return sum(train) + len(train) - 1, sum(validation) + len(validation) - 1
    stream = sum(sizes) + len(sizes) - 1  # a newline between files
    return stream - stream // 10, stream // 10


def check_split_sizes(train: int, validation: int, min_tokens: int) -> None:
    """Refuse splits of ``train`` / ``validation`` bytes shorter than ``min_tokens`` (one
    sequence plus its target).

    Raises:
        ValueError: naming the split, its size, the need and the fix.
    """
    for name, size in (("train", train), ("validation", validation)):
        if size < min_tokens:
            raise ValueError(f"the {name} split of --data has {size} bytes but one sequence needs {min_tokens} "
                             f"(--seq-len + 1); give more text with --data or a smaller --seq-len")


@dataclass(frozen=True)
class Batch:
    """This rank's share of one step's batch, int64 ``[local_batch, seq_len]`` each:
    ``tokens``, ``targets`` (the next byte of each token) and ``positions`` (each token's
    offset in its sequence, which indexes the rotary tables)."""

    tokens: np.ndarray
    targets: np.ndarray
    positions: np.ndarray


def global_batch(stream: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int,
                 stream_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of ``step`` (see the note at the top): ``(tokens, targets)``, int64
    ``[batch_size, seq_len]``; ``stream_id`` separates the train (0) and validation (1) draws."""
    rng = np.random.default_rng([seed, stream_id, step])
    starts = rng.integers(0, len(stream) - seq_len, size=batch_size)
    windows = np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int64)
    return windows[:, :-1], windows[:, 1:]


def rank_batch(stream: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int, dp_rank: int,
               dp_size: int, stream_id: int = 0) -> Batch:
    """Data-parallel rank ``dp_rank``'s contiguous ``batch_size / dp_size`` sequences of the
    global batch of ``step``. (With context parallelism the loop then gives each cp rank its
    ``context_parallel_shard`` of this share's sequence dim, positions included.)

    Raises:
        ValueError: ``batch_size`` is not divisible by ``dp_size``.
    """
    if batch_size % dp_size:
        raise ValueError(f"batch_size={batch_size} must be divisible by the data-parallel degree {dp_size}")
    tokens, targets = global_batch(stream, seed, step, batch_size, seq_len, stream_id)
    share = batch_size // dp_size
    rows = slice(dp_rank * share, (dp_rank + 1) * share)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int64), (share, seq_len)).copy()
    return Batch(tokens[rows].copy(), targets[rows].copy(), positions)
