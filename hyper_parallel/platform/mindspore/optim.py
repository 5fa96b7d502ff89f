"""``Platform.adamw`` on MindSpore: ``mindspore.experimental.optim.AdamW``; see
[Note: the framework's AdamW] in ``platform/contract/optim.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hyper_parallel.platform.contract.validation import local_piece


class MindSporeAdamW:
    """``mindspore.experimental.optim.AdamW`` behind the contract's ``Optimizer``."""

    def __init__(self, params: Sequence[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        import mindspore
        from mindspore.experimental.optim import AdamW

        self._ms = mindspore
        self._params = list(params)
        self._opt = AdamW(self._params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def gradients(self, grads: Sequence[Any]) -> list[Any]:
        return [local_piece(g) for g in grads]

    def step(self, grads: Sequence[Any], lr: float, scale: float = 1.0) -> None:
        for group in self._opt.param_groups:
            group["lr"] = float(lr)
        self._opt(tuple(grads) if scale == 1.0 else tuple(g * scale for g in grads))

    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {"step": np.asarray(int(self._opt.state_step.asnumpy()), np.int64)}
        for i in range(len(self._params)):
            out[f"exp_avg.{i}"] = local_piece(self._opt.exp_avg[i]).asnumpy().copy()
            out[f"exp_avg_sq.{i}"] = local_piece(self._opt.exp_avg_sq[i]).asnumpy().copy()
        return out

    def load_parameter_values(self, values: Sequence[np.ndarray]) -> None:
        for param, value in zip(self._params, values):  # set_data keeps a ParameterDTensor's spec
            param.set_data(self._ms.Tensor(np.ascontiguousarray(value)))

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        ms = self._ms
        self._opt.state_step.set_data(ms.Tensor(int(arrays["step"]), ms.int32))
        for i in range(len(self._params)):  # set_data keeps a ParameterDTensor's spec
            self._opt.exp_avg[i].set_data(ms.Tensor(arrays[f"exp_avg.{i}"].copy()))
            self._opt.exp_avg_sq[i].set_data(ms.Tensor(arrays[f"exp_avg_sq.{i}"].copy()))
