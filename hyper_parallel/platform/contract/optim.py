"""Contract section: the framework's own optimizer ("fused kernels, not math").

[Note: the framework's AdamW]
AdamW (Loshchilov & Hutter, *Decoupled Weight Decay Regularization*, 2019) is the
framework's implementation, not one written in platform ops: torch
``torch.optim.AdamW(foreach=False)`` (the per-parameter loop, the same arithmetic order on
every run, so a resumed run is bit-identical; its fused multiply-adds are not what a
composition of ops computes), MindSpore ``mindspore.experimental.optim.AdamW`` (the same
formula with bias correction; ``nn.AdamWeightDecay`` has none and would not match torch).

The parameters may be DTensors (fully_shard, tensor parallelism). AdamW is element-wise,
so stepping each rank's local pieces is exactly the unsharded step: the caller runs
``step`` under core's ``SkipDTensorDispatch`` (torch's ops on DTensor parameters and
gradients then run on their local tensors, and the moments it creates are local
tensors); MindSpore's AdamW updates each parameter's local storage directly. Gradients,
moments and state arrays cross the interface as local pieces (a DTensor's ``_local``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class Optimizer(Protocol):
    """An optimizer over a fixed list of parameters (``Platform.adamw``)."""

    def gradients(self, grads: Sequence[Any]) -> list[Any]:
        """The local pieces of the gradients ``step`` will apply, one per parameter:
        torch's ``.grad`` (what ``vjp`` accumulated; zeros for a parameter that got
        none), MindSpore ``grads`` (as ``vjp`` returned them)."""

    def step(self, grads: Sequence[Any], lr: float, scale: float = 1.0) -> None:
        """One update at learning rate ``lr`` with ``grads`` (one per parameter, as
        ``Platform.vjp`` returns them) multiplied by ``scale`` (gradient clipping). torch
        steps on the gradients ``vjp`` accumulated into ``.grad`` and clears them after."""

    def state_arrays(self) -> dict[str, np.ndarray]:
        """``{"step": int64 [], "exp_avg.{i}": ..., "exp_avg_sq.{i}": ...}`` (``i``: the
        parameter's index; float32 copies of the local pieces; a parameter that has no
        state yet has no entries)."""

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore what ``state_arrays`` returned (same parameters, same local shapes:
        the caller checks them)."""

    def load_parameter_values(self, values: Sequence[np.ndarray]) -> None:
        """Overwrite each parameter's local piece in place with ``values[i]`` (float32, its
        local shape: the caller checks them), as the framework writes a parameter (torch
        ``copy_`` into the local tensor under ``no_grad``, MindSpore ``set_data``): the
        parameters stay the same objects, so this optimizer keeps stepping them."""


class OptimSection(ABC):
    """The framework's optimizer; see [Note: the framework's AdamW]."""

    @abstractmethod
    def adamw(self, params: Sequence[Any], lr: float, *, betas: tuple[float, float], eps: float,
              weight_decay: float) -> Optimizer:
        """The framework's AdamW (with bias correction) over ``params`` (framework
        parameters, in a fixed order: ``state_arrays`` indexes them), learning rate
        ``lr`` until ``step`` gives one, decoupled ``weight_decay`` on every parameter."""
