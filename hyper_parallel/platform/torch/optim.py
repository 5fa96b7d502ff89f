"""``Platform.adamw`` on torch: ``torch.optim.AdamW(foreach=False)``; see
[Note: the framework's AdamW] in ``platform/contract/optim.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hyper_parallel.platform.contract.validation import local_piece


class TorchAdamW:
    """``torch.optim.AdamW`` behind the contract's ``Optimizer``."""

    def __init__(self, params: Sequence[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        self._params = list(params)
        self._opt = torch.optim.AdamW(self._params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      foreach=False)

    def gradients(self, grads: Sequence[Any]) -> list[Any]:
        return [torch.zeros_like(local_piece(param)) if param.grad is None else local_piece(param.grad)
                for param in self._params]

    def step(self, grads: Sequence[Any], lr: float, scale: float = 1.0) -> None:
        for group in self._opt.param_groups:
            group["lr"] = float(lr)
        if scale != 1.0:
            for param in self._params:
                if param.grad is not None:
                    param.grad.mul_(scale)
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)

    def state_arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        steps = set()
        for i, param in enumerate(self._params):
            state = self._opt.state.get(param, {})
            if not state:
                continue
            steps.add(int(state["step"]))
            # .cpu(): on an accelerator the state lives on the device (a no-op on CPU)
            out[f"exp_avg.{i}"] = local_piece(state["exp_avg"]).detach().cpu().numpy().copy()
            out[f"exp_avg_sq.{i}"] = local_piece(state["exp_avg_sq"]).detach().cpu().numpy().copy()
        out["step"] = np.asarray(steps.pop() if steps else 0, np.int64)
        return out

    def load_parameter_values(self, values: Sequence[np.ndarray]) -> None:
        with torch.no_grad():
            for param, value in zip(self._params, values):
                local_piece(param).copy_(torch.from_numpy(np.ascontiguousarray(value)))

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        step = int(arrays["step"])
        for i, param in enumerate(self._params):
            if f"exp_avg.{i}" not in arrays:
                continue
            device = local_piece(param).device  # the moments live beside their parameter
            self._opt.state[param] = {"step": torch.tensor(float(step)),
                                      "exp_avg": torch.from_numpy(arrays[f"exp_avg.{i}"].copy()).to(device),
                                      "exp_avg_sq": torch.from_numpy(arrays[f"exp_avg_sq.{i}"].copy()).to(device)}
