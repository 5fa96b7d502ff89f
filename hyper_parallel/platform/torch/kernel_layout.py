"""Argument layouts shared by torch's attention kernels (CPU, CUDA, NPU)."""

from __future__ import annotations

from typing import Any


def bhsd(x: Any) -> Any:
    """``[batch, seq, heads, dim]`` <-> ``[batch, heads, seq, dim]``: a transposed view, no copy
    (torch's SDPA kernels take BHSD, the contract is BSHD)."""
    return x.transpose(1, 2)
