"""Argument layouts shared by torch's attention kernels (CPU, CUDA, NPU)."""

from __future__ import annotations

import math
from typing import Any

import torch

from hyper_parallel.platform import attention_pieces as pieces


def bhsd(x: Any) -> Any:
    """``[batch, seq, heads, dim]`` <-> ``[batch, heads, seq, dim]``: a transposed view, no copy
    (torch's SDPA kernels take BHSD, the contract is BSHD)."""
    return x.transpose(1, 2)


def dead_to_inf(lse: Any) -> Any:
    """Rows that see no key (``lse`` at or below ``attention_pieces.LSE_FLOOR``) get ``+inf``,
    contiguous: the backward kernels compute ``exp(s - lse)``, which is then 0 where ``-inf``
    would give NaN."""
    return torch.where(lse > pieces.LSE_FLOOR, lse, math.inf).contiguous()


def packed_rows(x: Any) -> Any:
    """``[batch, seq, heads, dim]`` -> ``[batch * seq, heads, dim]``, batch rows one after
    another (a view when ``x`` is contiguous; [Note: packed rows] in ``packed_documents``)."""
    b, s, h, d = x.shape
    return x.reshape(b * s, h, d)
