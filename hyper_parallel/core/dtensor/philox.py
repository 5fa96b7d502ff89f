"""A counter-based random stream that any piece of a tensor can enter at its own elements.

[Note: random ops on DTensors]
A random op on a DTensor (``normal_``, ``uniform_``, ``bernoulli_``, dropout's mask) gives
each element of the *global* tensor the values that element would get on one device
drawing the whole tensor: element ``i`` (its row-major index in the global shape) takes
the raw 64-bit words ``offset + k*i .. offset + k*i + k - 1`` of one Philox-4x64 stream
(Salmon et al., *Parallel random numbers: as easy as 1, 2, 3*, SC 2011), ``k`` words per
element (two for a normal, one otherwise). A Philox word is a function of its position
(the counter) and the key (the seed) alone, so a rank computes its piece without drawing
the others' ("entering the stream" at each contiguous run of its piece): the values are
the same whatever the placements (``Shard`` on any dim, uneven, nested on a 2-D mesh,
``Replicate``), the world size, and equal to a one-rank run of the same code on a plain
tensor. Torch's DTensor (``OffsetBasedRNGTracker`` in ``torch/distributed/tensor/_random.py``)
instead gives each shard a contiguous range of its framework generator's stream, so its
values depend on the layout.

Why numpy's ``Philox`` and not the frameworks' own Philox generators: torch's CPU
generator is a Mersenne twister (not counter-based), its CUDA Philox rounds offsets to
its kernel's launch shape, and MindSpore's Philox kernels use another layout of
counters per element, so no framework call gives both frameworks the same bits at an
arbitrary element offset. numpy's ``Philox`` (``numpy.random.Philox(key=seed,
counter=c)``: position ``4c`` of the stream) is the same on every host, and the words
become values in float64 by numpy (``uniform``: the top 53 bits; ``normal``: Box-Muller
of two words), cast to the tensor's dtype and copied in with ``Platform.from_numpy``:
torch and MindSpore get the same bits. numpy's float64 ``log``/``cos`` may use SIMD
kernels that differ by one unit in the last place between CPU generations, so values
are bitwise equal on one host and within one float64 ulp (before the cast) across hosts.

Each op advances the stream past the whole tensor (``k * numel`` words, rounded up to a
multiple of 4, Philox's block), the same on every rank, so the next op starts where a
one-device run would. ``RngState`` is that position; ``random.manual_seed`` sets it.
"""

from __future__ import annotations

import contextvars
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: raw 64-bit words each element of a draw consumes
WORDS = {"uniform": 1, "normal": 2, "bernoulli": 1, "trunc_normal": 1}
#: elements drawn per call of the generator: bounds the temporaries (a normal: 16 bytes of words and
#: about 40 of float64 values per element, ~56 MiB per call)
_CHUNK = 1 << 20
_TWO_PI = 2.0 * math.pi
_2_53 = 2.0 ** -53


@dataclass(frozen=True)
class RngState:
    """Where the next random op enters the stream.

    Attributes:
        seed: the Philox key, an int in ``[0, 2**64)``.
        offset: the position of the next op's first word, an int >= 0 (a multiple of 4).
    """

    seed: int
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"random seed={self.seed!r} must be an int in [0, 2**64); the same on every rank")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"random offset={self.offset!r} must be a non-negative int")

    def advanced(self, kind: str, numel: int) -> RngState:
        """The state after an op of ``kind`` on a tensor of ``numel`` elements (global)."""
        return RngState(self.seed, self.offset + (WORDS[kind] * numel + 3) // 4 * 4)


# The stream's position, per thread and asyncio task as ``SkipDTensorDispatch``'s depth:
# ``None`` until ``random.manual_seed`` (a draw then refuses: ranks would otherwise have to
# agree on a seed through a collective).
_STATE: contextvars.ContextVar[RngState | None] = contextvars.ContextVar("hyper_parallel_rng_state", default=None)


def set_state(state: RngState) -> None:
    """Make ``state`` the position the next random op on DTensors enters the stream at."""
    if not isinstance(state, RngState):
        raise TypeError(f"set_state(state={state!r}): expected an RngState (random.get_rng_state() gives one)")
    _STATE.set(state)


def get_state() -> RngState | None:
    """The position the next random op enters the stream at; ``None`` before a seed."""
    return _STATE.get()


def take(op: str, kind: str, numel: int) -> RngState:
    """The state a draw of ``kind`` over ``numel`` elements (global) enters at, advancing
    the stream past it (every rank takes the same).

    Raises:
        RuntimeError: no seed was set in this thread.
    """
    state = _STATE.get()
    if state is None:
        raise RuntimeError(f"{op} on a DTensor draws from hyper_parallel's stream, which has no seed in this thread: "
                           "call hyper_parallel.core.dtensor.random.manual_seed(seed) first, with the same seed "
                           "on every rank (see [Note: random ops on DTensors])")
    _STATE.set(state.advanced(kind, numel))
    return state


def raw_words(seed: int, start: int, count: int) -> np.ndarray:
    """Words ``start .. start + count - 1`` of the Philox-4x64 stream keyed by ``seed``:
    ``uint64 [count]``. Computes only those (and at most 3 before them)."""
    skip = start % 4
    gen = np.random.Philox(key=seed, counter=start // 4)
    return gen.random_raw(skip + count)[skip:]


def _runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], int]:
    """The box ``offsets[d] .. offsets[d] + lengths[d]`` of a row-major tensor of ``shape``
    as contiguous runs of the flat index space: ``(starts, run_length)``, in the row-major
    order of the box's elements."""
    nd = len(shape)
    split = nd - 1
    while split > 0 and offsets[split] == 0 and lengths[split] == shape[split]:
        split -= 1  # dims after `split` are whole: runs span them
    strides = [math.prod(shape[d + 1:]) for d in range(nd)]
    run = lengths[split] * strides[split]
    base = offsets[split] * strides[split]
    outer = [range(offsets[d], offsets[d] + lengths[d]) for d in range(split)]
    starts = [base + sum(i * strides[d] for d, i in enumerate(idx)) for idx in itertools.product(*outer)]
    return starts, run


def _transform(kind: str, words: np.ndarray, params: dict[str, float]) -> np.ndarray:
    """float64 values of ``words`` (``WORDS[kind]`` per element, consecutive)."""
    if kind == "normal":
        pairs = words.reshape(-1, 2)
        u1 = ((pairs[:, 0] >> np.uint64(11)).astype(np.float64) + 1.0) * _2_53  # (0, 1]: log is finite
        u2 = (pairs[:, 1] >> np.uint64(11)).astype(np.float64) * _2_53
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(_TWO_PI * u2)  # Box & Muller, 1958
        return params["mean"] + params["std"] * z
    u = (words >> np.uint64(11)).astype(np.float64) * _2_53  # [0, 1), 53 bits
    if kind == "uniform":
        return params["low"] + (params["high"] - params["low"]) * u
    if kind == "bernoulli":
        return (u < params["p"]).astype(np.float64)
    if kind == "trunc_normal":
        return _trunc_normal(u, params)
    raise ValueError(f"unknown random op kind {kind!r}; one of {sorted(WORDS)}")


def _trunc_normal(u: np.ndarray, params: dict[str, float]) -> np.ndarray:
    """The normal ``(mean, std)`` truncated to ``[a, b]`` by its inverse CDF, as
    ``torch.nn.init.trunc_normal_`` computes it: ``erfinv(U(2 cdf(a) - 1, 2 cdf(b) - 1))``."""
    mean, std, a, b = params["mean"], params["std"], params["a"], params["b"]
    lo = math.erf((a - mean) / std / math.sqrt(2.0))
    hi = math.erf((b - mean) / std / math.sqrt(2.0))
    x = erfinv(lo + (hi - lo) * u)
    return np.clip(mean + std * math.sqrt(2.0) * x, a, b)


def erfinv(x: np.ndarray) -> np.ndarray:
    """The inverse error function of float64 ``x`` in ``(-1, 1)`` (``+-inf`` at ``+-1``):
    Giles' single-precision polynomials (M. Giles, *Approximating the erfinv function*,
    GPU Computing Gems, 2011; relative error below 4e-7, about float32's resolution, which
    is what initial values are cast to), evaluated in float64 by numpy."""
    with np.errstate(divide="ignore"):
        w = -np.log((1.0 - x) * (1.0 + x))
    central = w < 5.0
    wc = w - 2.5
    pc = np.full_like(x, 2.81022636e-08)
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503, -0.00417768164,
              0.246640727, 1.50140941):
        pc = c + pc * wc
    wt = np.sqrt(w) - 3.0
    pt = np.full_like(x, -0.000200214257)
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613, 0.00943887047,
              1.00167406, 2.83297682):
        pt = c + pt * wt
    return np.where(central, pc, pt) * x


def draw(kind: str, params: dict[str, float], state: RngState, shape: Sequence[int], offsets: Sequence[int],
         lengths: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """This piece's values of a draw of ``kind`` over a global tensor of ``shape``.

    Args:
        kind: a key of ``WORDS``; ``params``: its arguments (``mean``/``std``; ``low``/``high``;
            ``p``; ``mean``/``std``/``a``/``b``).
        state: where the draw enters the stream (the op's first word).
        offsets, lengths: the piece, a box of the global tensor (``DTensorSpec.local_offsets``
            and the local shape).
        dtype: the numpy dtype of the result (the tensor's; float32 for bfloat16).

    Returns:
        ``dtype [*lengths]``, the values [Note: random ops on DTensors] gives the piece.
    """
    k = WORDS[kind]
    out = np.empty(math.prod(lengths), dtype)
    if out.size == 0:
        return out.reshape(tuple(lengths))
    if not shape:
        starts, run = [0], 1
    else:
        starts, run = _runs(shape, offsets, lengths)
    pos = 0
    for start in starts:
        for first in range(0, run, _CHUNK):
            count = min(_CHUNK, run - first)
            words = raw_words(state.seed, state.offset + k * (start + first), k * count)
            out[pos:pos + count] = _transform(kind, words, params)
            pos += count
    return out.reshape(tuple(lengths))
