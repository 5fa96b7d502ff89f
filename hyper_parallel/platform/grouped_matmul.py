"""``Platform.grouped_matmul``'s checks and its fallback: one matmul per non-empty group,
for a device whose framework has no grouped GEMM kernel (MindSpore CPU; torch on a
device or dtype ``torch.nn.functional.grouped_mm`` does not take). The fallback warns
once per process (Python's default warning filter shows a location's first warning)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any


def check_grouped_matmul(x: Any, weight: Any, group_sizes: Sequence[int]) -> list[int]:
    """``group_sizes`` as ints after checking them against ``x`` ``[rows, in]`` and
    ``weight`` ``[groups, out, in]``.

    Raises:
        ValueError: ``x`` not 2-D, ``weight`` not 3-D, the ``in`` dims differ, or
            ``group_sizes`` not one non-negative size per group summing to ``rows``.
    """
    if x.ndim != 2 or weight.ndim != 3:
        raise ValueError(f"grouped_matmul: x must be [rows, in] and weight [groups, out, in], got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}; reshape the rows to 2-D and stack "
                         "the groups' weights along dim 0")
    if int(x.shape[1]) != int(weight.shape[2]):
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)} has in={int(x.shape[1])} but weight "
                         f"{tuple(weight.shape)} takes in={int(weight.shape[2])}; weight is in Linear's "
                         "[out, in] layout per group")
    sizes = [int(n) for n in group_sizes]
    if len(sizes) != int(weight.shape[0]) or min(sizes, default=0) < 0 or sum(sizes) != int(x.shape[0]):
        raise ValueError(f"grouped_matmul: group_sizes={sizes} must give one size >= 0 per group "
                         f"({int(weight.shape[0])}) summing to x's {int(x.shape[0])} rows")
    return sizes


def looped_grouped_matmul(p: Any, x: Any, weight: Any, sizes: list[int], reason: str) -> Any:
    """``[rows, out]``: ``x``'s consecutive row groups each times ``weight[g]`` transposed,
    one matmul per non-empty group, concatenated (differentiable). Warns (once per
    process) that no grouped kernel ran, and why (``reason``; "" for no rows, where
    there is nothing a kernel would do better)."""
    if reason:
        warnings.warn(f"grouped_matmul on {p.name}: {reason}; running one matmul per expert instead of a "
                      "grouped GEMM kernel", RuntimeWarning, stacklevel=3)
    parts = p.split(x, sizes, 0)
    outs = [part @ weight[g].transpose(0, 1) for g, part in enumerate(parts) if sizes[g]]
    if not outs:  # no rows: an empty [0, out] that still reaches the weight in autograd
        return x @ weight[0].transpose(0, 1)
    return outs[0] if len(outs) == 1 else p.cat(outs, 0)
