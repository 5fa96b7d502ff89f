"""Deterministic per-rank data for the conformance suite (numpy, so every backend sees
the same values)."""

from __future__ import annotations

import numpy as np


def rank_data(rank: int, shape: tuple[int, ...], seed: int = 0, dtype: type = np.float32) -> np.ndarray:
    """Standard-normal values that depend only on (seed, rank, shape)."""
    return np.random.default_rng(1000 * seed + rank).standard_normal(shape).astype(dtype)


def all_rank_data(world: int, shape: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    """``rank_data`` of every rank, as each rank can compute it locally."""
    return [rank_data(r, shape, seed) for r in range(world)]


def close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """float32 comparison. The tolerance covers summation order: backends and world sizes
    add the per-rank terms in different orders (a few ulps of the magnitudes involved)."""
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5, err_msg=what)
