"""Random ops whose values do not depend on the layout: each element of a DTensor gets what
one device drawing the whole tensor with the same seed gets ([Note: random ops on
DTensors] in ``philox.py``), on torch and MindSpore alike.

Every function takes a DTensor (any ``Shard``/``Replicate`` placements, uneven shards,
n-D meshes; ``Partial`` is refused) or a plain framework tensor (the whole tensor: the
one-device reference, so the same model code runs unsharded). They draw from
hyper_parallel's stream, never the framework's generator: ``manual_seed`` sets it, the
same seed on every rank; each call advances it past the whole tensor on every rank.
The values therefore equal a one-rank run of the same calls, not ``torch.randn`` /
``mindspore.ops.randn`` (the frameworks' CPU generators are not counter-based).

Each call goes through core's one dispatch entry (``dispatch.dispatch`` with the op's
rule in ``OP_RULES``): a backend that hands an intercepted ``normal_`` / ``uniform_`` /
``bernoulli_`` with its arguments reaches the same rule and the same values.
"""

from __future__ import annotations

import math
from typing import Any

from hyper_parallel.core.dtensor import philox
from hyper_parallel.core.dtensor.dispatch import dispatch, draw_local
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Replicate

__all__ = ["RngState", "bernoulli_", "dropout", "dropout_with_mask", "get_rng_state", "manual_seed", "normal_",
           "set_rng_state", "trunc_normal_", "uniform_"]

RngState = philox.RngState


def manual_seed(seed: int) -> None:
    """Seed the stream of random ops on DTensors in this thread (position 0). Call it with
    the same ``seed`` on every rank: ranks that differ draw different pieces of different
    tensors (unchecked: checking would cost a collective).

    Raises:
        ValueError: ``seed`` is not an int in ``[0, 2**64)``.
    """
    philox.set_state(RngState(seed))


def get_rng_state() -> RngState | None:
    """The stream's position (seed and offset), ``None`` before ``manual_seed``: restore it
    with ``set_rng_state`` to draw the same values again."""
    return philox.get_state()


def set_rng_state(state: RngState) -> None:
    """Restore a position ``get_rng_state`` returned."""
    philox.set_state(state)


def _draw(op: str, x: Any, params: dict[str, float]) -> Any:
    """``x`` filled in place by the draw ``op`` (a rule of the ``random`` family)."""
    if isinstance(x, DTensor):
        return dispatch(op, [x], lambda local: local, params, inplace=0)
    shape = tuple(int(s) for s in x.shape)
    return draw_local(op, params, x, shape, (0,) * len(shape), shape, inplace=True)


def _check_positive(op: str, name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{op}: {name}={value!r} must be a finite number > 0")


def normal_(x: Any, mean: float = 0.0, std: float = 1.0) -> Any:
    """Fill ``x`` (any shape, floating dtype) in place with normal values ``mean + std * z``,
    ``z`` a standard normal from two stream words per element (Box-Muller); returns ``x``.

    Raises:
        ValueError: ``std <= 0``; ``x`` ``Partial`` on some mesh axis.
        RuntimeError: no ``manual_seed`` in this thread.
    """
    _check_positive("normal_", "std", std)
    return _draw("normal", x, {"mean": float(mean), "std": float(std)})


def uniform_(x: Any, a: float = 0.0, b: float = 1.0) -> Any:
    """Fill ``x`` in place with values uniform on ``[a, b)`` (53 bits of one word per
    element); returns ``x``.

    Raises:
        ValueError: ``a > b``; ``x`` ``Partial``. RuntimeError: no seed.
    """
    if not a <= b:
        raise ValueError(f"uniform_: a={a!r} must be <= b={b!r}")
    return _draw("uniform", x, {"low": float(a), "high": float(b)})


def trunc_normal_(x: Any, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Any:
    """Fill ``x`` in place with the normal ``(mean, std)`` truncated to ``[a, b]``, by the
    inverse CDF as ``torch.nn.init.trunc_normal_`` computes it (one uniform word per
    element through ``erfinv``, Giles' approximation in float64); returns ``x``.

    Raises:
        ValueError: ``std <= 0`` or ``a >= b``; ``x`` ``Partial``. RuntimeError: no seed.
    """
    _check_positive("trunc_normal_", "std", std)
    if not a < b:
        raise ValueError(f"trunc_normal_: a={a!r} must be < b={b!r}")
    return _draw("trunc_normal", x, {"mean": float(mean), "std": float(std), "a": float(a), "b": float(b)})


def bernoulli_(x: Any, p: float = 0.5) -> Any:
    """Fill ``x`` in place with 1 where a uniform word is below ``p``, else 0; returns ``x``.

    Raises:
        ValueError: ``p`` outside ``[0, 1]``; ``x`` ``Partial``. RuntimeError: no seed.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bernoulli_: p={p!r} must be in [0, 1]")
    return _draw("bernoulli", x, {"p": float(p)})


def dropout(x: Any, p: float = 0.5, training: bool = True) -> Any:
    """Inverted dropout (Srivastava et al., 2014): each element of ``x`` kept with
    probability ``1 - p`` and scaled by ``1 / (1 - p)``, else 0; ``x`` itself when not
    ``training`` or ``p == 0``. Differentiable in ``x`` (the mask is a constant).

    The mask of element ``i`` is the one one device draws for the whole tensor: a
    sequence-sharded activation (context parallelism) gets the unsharded sequence's
    mask. A ``Partial`` ``x`` is reduced first (the mask is drawn on whole values).

    Args:
        x: a DTensor or framework tensor, floating point, any shape.
        p: the probability of zeroing, in ``[0, 1)``.

    Returns:
        A tensor like ``x`` (same placements for a DTensor of ``Shard``/``Replicate``).

    Raises:
        ValueError: ``p`` outside ``[0, 1)``. RuntimeError: no seed.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p={p!r} must be in [0, 1) (p=1 zeroes everything: use zeros_like)")
    if not training or p == 0.0:
        return x
    return dropout_with_mask(x, p)[0]


def dropout_with_mask(x: Any, p: float) -> tuple[Any, Any]:
    """``dropout(x, p)`` in training and its mask: ``(x * mask / (1 - p), mask)``, the mask
    of ``x``'s shape and placements, 1 where an element is kept (a bernoulli draw of
    ``1 - p``), else 0 (what a framework's dropout primitive returning its mask needs).

    Raises:
        ValueError: ``p`` outside ``[0, 1)``. RuntimeError: no seed.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p={p!r} must be in [0, 1) (p=1 zeroes everything: use zeros_like)")
    keep = {"p": 1.0 - float(p)}
    if isinstance(x, DTensor):
        if any(pl.is_partial() for pl in x.placements):
            x = x.redistribute(x.device_mesh, [Replicate() if pl.is_partial() else pl for pl in x.placements])
        mask = dispatch("bernoulli", [x], lambda local: local, keep)
    else:
        shape = tuple(int(s) for s in x.shape)
        mask = draw_local("bernoulli", keep, x, shape, (0,) * len(shape), shape, inplace=False)
    return x * mask * (1.0 / (1.0 - p)), mask
