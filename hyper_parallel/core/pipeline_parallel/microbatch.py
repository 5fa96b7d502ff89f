"""Splitting a step's inputs into microbatches and merging the last stage's outputs.

A microbatch is a slice of dim 0 (the batch dim) of every tensor argument; non-tensor
arguments go to every microbatch unchanged. Microbatches are equal in size: the stages
exchange fixed-size buffers whose shapes are inferred once (see ``PipelineStage``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform import Platform


def split_microbatches(platform: Platform, args: Sequence[Any], kwargs: dict[str, Any],
                       n_microbatches: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``n_microbatches`` pairs ``(args, kwargs)``; each tensor ``[batch, ...]`` becomes
    ``[batch / n_microbatches, ...]`` slices in batch order (no copy where the framework
    can view).

    Raises:
        ValueError: a tensor argument is 0-dimensional, or its dim 0 is not divisible by
            ``n_microbatches``.
    """
    if n_microbatches < 1:
        raise ValueError(f"split_microbatches: n_microbatches={n_microbatches} must be >= 1")

    def pieces(name: str, value: Any) -> list[Any]:
        if not platform.is_tensor(value):
            return [value] * n_microbatches
        if value.ndim == 0:
            raise ValueError(f"pipeline step: {name} is a 0-dimensional tensor; microbatches slice dim 0 (the batch "
                             "dim): pass it as a Python number or give it a batch dim")
        batch = value.shape[0]
        if batch % n_microbatches:
            raise ValueError(f"pipeline step: {name} has batch size {batch} (dim 0), not divisible by "
                             f"n_microbatches={n_microbatches}; use a batch that is a multiple of {n_microbatches}")
        return platform.split(value, [batch // n_microbatches] * n_microbatches, 0)

    split_args = [pieces(f"args[{i}]", value) for i, value in enumerate(args)]
    split_kwargs = {key: pieces(f"kwargs[{key!r}]", value) for key, value in sorted(kwargs.items())}
    return [(tuple(piece[m] for piece in split_args), {key: piece[m] for key, piece in split_kwargs.items()})
            for m in range(n_microbatches)]


def merge_microbatches(platform: Platform, outputs: Sequence[Any]) -> Any:
    """Concatenate per-microbatch outputs along dim 0: a tensor each gives a tensor, a
    tuple of tensors each gives a tuple of concatenations."""
    if isinstance(outputs[0], tuple):
        return tuple(platform.cat([out[i] for out in outputs], 0) for i in range(len(outputs[0])))
    return platform.cat(list(outputs), 0)
