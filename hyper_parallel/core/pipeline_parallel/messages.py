"""Point-to-point messages between pipeline stages.

A message is one microbatch's activations (forward) or input gradients (backward): a
tuple of floating-point tensors whose shapes are fixed once inferred (``TensorSpec``).

[Note: one channel per rank pair]
The platform's sends and receives carry no tag: the messages from rank ``a`` to rank
``b`` are matched to ``b``'s receives in the order ``a`` sent them. A schedule does not
promise that ``b`` consumes them in that order (two stages of an interleaved schedule
share a pair of ranks; forward activations and backward gradients can share a
direction). ``Mailbox`` therefore receives each peer's messages in the peer's send order,
known from the peer's action list, and keeps those that arrive before they are needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.pipeline_parallel.boundary import (LAYOUT_LEN, MAX_DIMS, BoundaryLayout, decode_layout,
                                                            encode_layout, layout_of)
from hyper_parallel.platform import P2POp, Platform, Work
from hyper_parallel.platform.contract.types import DTYPE_NAMES
from hyper_parallel.core.tensor_ops import dtype_name

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
MAX_TENSORS = 8  # tensors per message
SLOT_LEN = 2 + MAX_DIMS + LAYOUT_LEN  # one tensor: dtype, ndim, dims, its DTensor layout
META_LEN = 1 + MAX_TENSORS * SLOT_LEN  # int64: count, then a slot per tensor


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype name (one of ``DTYPE_NAMES``) of one tensor of a message (the
    local piece of a DTensor, whose ``layout`` rebuilds it: see
    [Note: DTensors between stages] in ``boundary.py``)."""

    shape: tuple[int, ...]
    dtype: str
    layout: BoundaryLayout | None = None


#: (kind "F" or "B", sending stage, microbatch): a message's identity
MessageKey = tuple[str, int, int]


def spec_of(platform: Platform, tensors: Sequence[Any], what: str) -> tuple[TensorSpec, ...]:
    """The specs of a message's tensors.

    Raises:
        TypeError: a value is not a floating-point tensor (only those carry gradients
            between stages), or there are more than ``MAX_TENSORS`` of them / a tensor
            has more than ``MAX_DIMS`` dims, or a DTensor whose layout cannot cross
            (``boundary.layout_of``).
    """
    specs = []
    if len(tensors) > MAX_TENSORS:
        raise TypeError(f"{what}: {len(tensors)} tensors; a stage passes at most {MAX_TENSORS} to the next")
    for i, tensor in enumerate(tensors):
        layout = layout_of(tensor, platform.rank(), f"{what}[{i}]") if isinstance(tensor, DTensor) else None
        if layout is not None:
            tensor = tensor.to_local()
        if not platform.is_tensor(tensor) or dtype_name(tensor.dtype) not in FLOAT_DTYPES:
            kind = dtype_name(tensor.dtype) if platform.is_tensor(tensor) else type(tensor).__name__
            raise TypeError(f"{what}[{i}] is {kind}; a stage's outputs must be floating-point tensors (a tensor or a "
                            "tuple of tensors) so that their gradients can flow back")
        if tensor.ndim > MAX_DIMS:
            raise TypeError(f"{what}[{i}] has {tensor.ndim} dims; at most {MAX_DIMS} cross a stage boundary")
        specs.append(TensorSpec(tuple(int(d) for d in tensor.shape), dtype_name(tensor.dtype), layout))
    return tuple(specs)


def encode_specs(platform: Platform, specs: Sequence[TensorSpec]) -> Any:
    """An int64 tensor ``[META_LEN]`` describing ``specs`` (sent ahead of the first message)."""
    meta = np.zeros(META_LEN, np.int64)
    meta[0] = len(specs)
    for i, spec in enumerate(specs):
        base = 1 + i * SLOT_LEN
        meta[base] = DTYPE_NAMES.index(spec.dtype)
        meta[base + 1] = len(spec.shape)
        meta[base + 2:base + 2 + len(spec.shape)] = spec.shape
        meta[base + 2 + MAX_DIMS:base + SLOT_LEN] = encode_layout(spec.layout)
    return platform.from_numpy(meta)


def decode_specs(platform: Platform, meta: Any) -> tuple[TensorSpec, ...]:
    """Inverse of ``encode_specs``."""
    values = platform.to_numpy(meta)
    specs = []
    for i in range(int(values[0])):
        base = 1 + i * SLOT_LEN
        ndim = int(values[base + 1])
        specs.append(TensorSpec(tuple(int(d) for d in values[base + 2:base + 2 + ndim]),
                                DTYPE_NAMES[int(values[base])],
                                decode_layout(values[base + 2 + MAX_DIMS:base + SLOT_LEN], ndim)))
    return tuple(specs)


def send(platform: Platform, tensors: Sequence[Any], dst: int, group: Any) -> list[Work]:
    """Start sending ``tensors`` to group rank ``dst`` (one batch); wait the Works later."""
    return platform.batch_isend_irecv([P2POp("isend", tensor, dst, group) for tensor in tensors])


def receive(platform: Platform, specs: Sequence[TensorSpec], src: int, group: Any) -> tuple[Any, ...]:
    """Receive one message of ``specs`` from group rank ``src`` (blocks until it arrived)."""
    buffers = [platform.zeros(spec.shape, platform.dtype(spec.dtype), fill=False) for spec in specs]
    works = platform.batch_isend_irecv([P2POp("irecv", buffer, src, group) for buffer in buffers])
    return tuple(work.wait() for work in works)


class Mailbox:
    """Receives each peer's messages in that peer's send order and hands them out in the
    order this rank asks for them. See [Note: one channel per rank pair].

    Args:
        incoming: per peer group rank, the keys of the messages it sends here, in order.
        spec_of_key: the tensor specs of a message.
    """

    def __init__(self, platform: Platform, group: Any, incoming: dict[int, list[MessageKey]],
                 spec_of_key: Callable[[MessageKey], Sequence[TensorSpec]]) -> None:
        self._platform = platform
        self._group = group
        self._incoming = incoming
        self._spec_of_key = spec_of_key
        self._position: dict[int, int] = {peer: 0 for peer in incoming}  # next message index per peer
        self._early: dict[MessageKey, tuple[Any, ...]] = {}  # arrived before they were asked for

    def get(self, peer: int, key: MessageKey) -> tuple[Any, ...]:
        """The tensors of message ``key`` from ``peer``, receiving earlier ones first.

        Raises:
            RuntimeError: ``peer`` never sends ``key`` in this schedule.
        """
        if key in self._early:
            return self._early.pop(key)
        expected = self._incoming.get(peer, [])
        while self._position.get(peer, 0) < len(expected):
            next_key = expected[self._position[peer]]
            self._position[peer] += 1
            tensors = receive(self._platform, self._spec_of_key(next_key), peer, self._group)
            if next_key == key:
                return tensors
            self._early[next_key] = tensors
        raise RuntimeError(f"pipeline runtime: message {key} from rank {peer} is not sent by the schedule")
