"""Which global sequence positions each context-parallel rank holds, and the data helpers
that shard inputs, labels and position ids that way.

[Note: sequence layout]
A sequence of ``S`` tokens is split over the ``cp`` ranks of a context-parallel mesh,
ranked in the mesh's row-major (flattened) order. Without load balance rank ``c`` holds
chunk ``c`` of ``cp`` equal chunks. With load balance (the head-tail or "zigzag" layout of
torch's ring-attention context parallel and of Megatron-LM's CP) the sequence is split into
``2 * cp`` chunks and rank ``c`` holds chunks ``c`` and ``2 * cp - 1 - c``: under a causal
mask a late chunk attends to many keys and an early one to few, so pairing them gives
every rank the same number of allowed (query, key) pairs.
Every algorithm in this package derives its masks from these positions, so the layout is
defined here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.platform import get_platform


def check_seq_len(seq_len: int, cp: int, load_balance: bool, what: str) -> None:
    """Raise ValueError unless ``seq_len`` splits evenly for the layout."""
    parts = 2 * cp if load_balance else cp
    if seq_len % parts:
        layout = f"2 * cp = {parts} chunks (load_balance=True)" if load_balance else f"cp = {parts} chunks"
        raise ValueError(f"{what}: sequence length {seq_len} does not split into {layout}; pad the sequence to "
                         f"a multiple of {parts} (or change the context-parallel degree)")


def shard_positions(seq_len: int, cp: int, index: int, load_balance: bool) -> np.ndarray:
    """The global positions (int64, ascending within each chunk) held by CP rank
    ``index``; see [Note: sequence layout]."""
    if not load_balance:
        chunk = seq_len // cp
        return np.arange(index * chunk, (index + 1) * chunk, dtype=np.int64)
    chunk = seq_len // (2 * cp)
    tail = 2 * cp - 1 - index
    return np.concatenate([np.arange(index * chunk, (index + 1) * chunk, dtype=np.int64),
                           np.arange(tail * chunk, (tail + 1) * chunk, dtype=np.int64)])


def _flat_mesh(device_mesh: DeviceMesh, what: str) -> tuple[int, int]:
    """``(cp, this rank's flattened index)`` of the mesh."""
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{what}: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(f"{what}: rank {get_platform().rank()} is not in {device_mesh}")
    return device_mesh.size(), int(np.ravel_multi_index(coordinate, device_mesh.shape))


def _check_dims(tensors: Sequence[Any], seq_dims: Sequence[int], what: str) -> list[int]:
    if len(tensors) != len(seq_dims):
        raise ValueError(f"{what}: got {len(tensors)} tensors but {len(seq_dims)} seq_dims; give one sequence "
                         "dim per tensor")
    dims = []
    for i, (t, d) in enumerate(zip(tensors, seq_dims)):
        if not -t.ndim <= d < t.ndim:
            raise ValueError(f"{what}: seq_dims[{i}]={d} is out of range for tensor {i} of shape {tuple(t.shape)}")
        dims.append(d % t.ndim)
    return dims


def context_parallel_shard(tensors: Sequence[Any], seq_dims: Sequence[int], device_mesh: DeviceMesh, *,
                           load_balance: bool = False) -> list[Any]:
    """This rank's part of each tensor along its sequence dim, in the layout
    ``ContextParallel`` expects (see [Note: sequence layout]).

    Shard inputs, labels and position ids with the same call so that RoPE sees the
    positions each rank really holds (with ``load_balance`` those are not contiguous).
    Local: no communication.

    Args:
        tensors: full tensors, identical on every rank (``[batch, seq, ...]`` or any
            layout whose sequence dim is named in ``seq_dims``).
        seq_dims: the sequence dim of each tensor.
        device_mesh: the context-parallel mesh (1-D, or the 2-D hybrid mesh; ranks are
            taken in row-major order).
        load_balance: the head-tail layout of ``ContextParallel(load_balance=True)``.

    Returns:
        One tensor per input with its sequence dim divided by ``cp``.

    Raises:
        ValueError: a sequence length not divisible by ``cp`` (``2 * cp`` with load
            balance), mismatched ``seq_dims``.
    """
    what = "context_parallel_shard"
    cp, index = _flat_mesh(device_mesh, what)
    dims = _check_dims(tensors, seq_dims, what)
    for t, d in zip(tensors, dims):
        check_seq_len(int(t.shape[d]), cp, load_balance, what)
    p = get_platform()
    out = []
    for t, d in zip(tensors, dims):
        parts = 2 * cp if load_balance else cp
        pieces = p.split(t, [int(t.shape[d]) // parts] * parts, d)  # check_seq_len: divisible
        if load_balance:
            out.append(p.cat([pieces[index], pieces[2 * cp - 1 - index]], d).contiguous())
        else:
            out.append(pieces[index].contiguous())
    return out


def context_parallel_unshard(tensors: Sequence[Any], seq_dims: Sequence[int], device_mesh: DeviceMesh, *,
                             load_balance: bool = False) -> list[Any]:
    """Inverse of ``context_parallel_shard``: the full tensors, on every rank.

    Collective over the flattened mesh: one differentiable all-gather per tensor along its
    sequence dim, then the head-tail chunks put back in order when ``load_balance``.

    Raises:
        ValueError: mismatched ``seq_dims``; a local length not divisible by 2 with
            ``load_balance``.
    """
    what = "context_parallel_unshard"
    cp, _ = _flat_mesh(device_mesh, what)
    dims = _check_dims(tensors, seq_dims, what)
    if load_balance:
        for t, d in zip(tensors, dims):
            if int(t.shape[d]) % 2:
                raise ValueError(f"{what}: local sequence length {int(t.shape[d])} is odd; a load-balanced shard "
                                 "holds two equal chunks (was it sharded with load_balance=True?)")
    p = get_platform()
    group = device_mesh.flatten().get_group() if device_mesh.ndim > 1 else device_mesh.get_group()
    out = []
    for t, d in zip(tensors, dims):
        full = p.differentiable_all_gather(t.contiguous(), d, group=group) if cp > 1 else t
        if load_balance and cp > 1:
            # rank c's pieces sit at 2c (head) and 2c + 1 (tail); each local shard holds two equal halves
            pieces = p.split(full, [int(full.shape[d]) // (2 * cp)] * (2 * cp), d)
            order = [pieces[2 * c] for c in range(cp)] + [pieces[2 * c + 1] for c in reversed(range(cp))]
            full = p.cat(order, d)
        out.append(full)
    return out
