"""AdamW (Loshchilov & Hutter, *Decoupled Weight Decay Regularization*, 2019) through the
framework's own implementation (``Platform.adamw``; [Note: the framework's AdamW] in
``platform/contract/optim.py``), with one interface for stepping and for the optimizer
state as numpy arrays (what checkpoints hold).

The parameters of a parallelized model are DTensors (fully_shard, tensor parallelism).
AdamW is element-wise, so stepping their local pieces is exactly the unsharded step: the
step runs under ``SkipDTensorDispatch`` (ops on DTensors run on their local tensors).
Gradients, moments and values cross this interface as local pieces (``local_tensor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor import DTensor, SkipDTensorDispatch
from hyper_parallel.platform import Platform

BETAS = (0.9, 0.95)
EPS = 1e-8


def local_tensor(x: Any) -> Any:
    """A DTensor's local piece (not differentiable; on torch the DTensor's own storage, so
    an in-place write reaches the parameter), a plain tensor itself."""
    return x._local if isinstance(x, DTensor) else x


class AdamW:
    """AdamW over ``params`` (framework parameters, in a fixed order).

    Args:
        p: the platform.
        params: the parameters to update.
        lr: initial learning rate (``step`` takes each step's).
        weight_decay: decoupled weight decay coefficient (applied to every parameter).
    """

    def __init__(self, p: Platform, params: Sequence[Any], lr: float, weight_decay: float) -> None:
        self._params = list(params)
        self._opt = p.adamw(self._params, lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)

    def gradients(self, grads: Sequence[Any]) -> list[Any]:
        """The local pieces of the gradients ``step`` will apply (``Optimizer.gradients``)."""
        return self._opt.gradients(grads)

    def step(self, grads: Sequence[Any], lr: float, scale: float = 1.0) -> None:
        """One update with ``grads`` (one per parameter, as ``platform.vjp`` returns them)
        multiplied by ``scale`` (gradient clipping) at learning rate ``lr``."""
        with SkipDTensorDispatch():
            self._opt.step(grads, lr, scale)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """``{"step": int64 [], "exp_avg.{i}": ..., "exp_avg_sq.{i}": ...}`` (``i``: the
        parameter's index; float32 arrays of the parameter's local shape)."""
        return self._opt.state_arrays()

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore what ``state_arrays`` returned (same parameters, same local shapes).

        Raises:
            ValueError: a moment's shape differs from its parameter's local shape.
        """
        for i, param in enumerate(self._params):
            shape = tuple(local_tensor(param).shape)
            for key in (f"exp_avg.{i}", f"exp_avg_sq.{i}"):
                if key in arrays and tuple(arrays[key].shape) != shape:
                    raise ValueError(f"optimizer state {key} has shape {arrays[key].shape} but parameter {i} has "
                                     f"the local shape {shape}; the checkpoint was written with another layout")
        self._opt.load_state_arrays(arrays)

    def load_parameter_values(self, values: Sequence[np.ndarray]) -> None:
        """Overwrite each parameter's local piece in place with a float32 array of its
        shape (``Optimizer.load_parameter_values``: the same parameter objects).

        Raises:
            ValueError: a value's shape differs from its parameter's local shape.
        """
        for param, value in zip(self._params, values):
            if tuple(value.shape) != tuple(local_tensor(param).shape):
                raise ValueError(f"checkpoint value of shape {value.shape} for a parameter of local shape "
                                 f"{tuple(local_tensor(param).shape)}")
        self._opt.load_parameter_values(values)


#: ``--lr-schedule`` values (after the linear warmup): cosine decay to ``min_lr``; linear
#: decay to ``min_lr``; constant at the peak; WSD (warmup-stable-decay, Hu et al.,
#: *MiniCPM*, 2024): the peak until the last ``WSD_DECAY_FRACTION`` of the steps after
#: warmup, then linear decay to ``min_lr``.
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
WSD_DECAY_FRACTION = 0.2


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
          min_lr: float | None = None) -> float:
    """Learning rate of 1-based ``step``: linear warmup to ``peak`` over ``warmup_steps``,
    then ``schedule`` (``LR_SCHEDULES``) from ``peak`` to ``min_lr`` (default ``peak / 10``)
    at ``total_steps``.

    Raises:
        ValueError: an unknown ``schedule``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule={schedule!r} is not a schedule; use one of {', '.join(LR_SCHEDULES)}")
    # the end as a fraction of the peak (0.1 by default: the arithmetic of earlier runs, so
    # a resumed run's learning rates are bit-identical)
    ratio = 0.1 if min_lr is None else min_lr / peak
    if warmup_steps and step <= warmup_steps:
        return peak * step / warmup_steps
    if schedule == "constant":
        return peak
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "wsd":
        stable = 1.0 - WSD_DECAY_FRACTION
        progress = max(0.0, progress - stable) / WSD_DECAY_FRACTION
    elif schedule == "cosine":
        return float(peak * (ratio + (1.0 - ratio) * 0.5 * (1.0 + np.cos(np.pi * progress))))
    return peak * (1.0 - (1.0 - ratio) * progress)
