"""AdamW (Loshchilov & Hutter, *Decoupled Weight Decay Regularization*, 2019) through each
framework's own implementation, with one interface for stepping and for the optimizer
state as numpy arrays (what checkpoints hold).

torch: ``torch.optim.AdamW(foreach=False)`` (the per-parameter loop: the same arithmetic
order on every run, so a resumed run is bit-identical). MindSpore:
``mindspore.experimental.optim.AdamW``, the same formula with bias correction (MindSpore's
``nn.AdamWeightDecay`` has none and would not match torch).

The parameters of a parallelized model are DTensors (fully_shard, tensor parallelism).
Both step their local pieces, which for this element-wise rule is exactly the unsharded
step: torch runs the step under ``SkipDTensorDispatch`` (its ops on the DTensor
parameters and gradients run on their local tensors, and the moments it creates are
local tensors), MindSpore's ``AdamW`` updates each parameter's local storage. Gradients,
moments and values cross this interface as local pieces (``local_tensor``).
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
        self._p = p
        self._params = list(params)
        if p.framework == "torch":
            import torch

            self._opt = torch.optim.AdamW(self._params, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay,
                                          foreach=False)
        else:
            from mindspore.experimental.optim import AdamW as MSAdamW

            self._opt = MSAdamW(self._params, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)

    def gradients(self, grads: Sequence[Any]) -> list[Any]:
        """The local pieces of the gradients ``step`` will apply: torch's ``.grad`` of each
        parameter (what ``vjp`` accumulated; zeros for a parameter that got none), else
        ``grads``."""
        if self._p.framework != "torch":
            return [local_tensor(g) for g in grads]
        import torch

        return [torch.zeros_like(local_tensor(param)) if param.grad is None else local_tensor(param.grad)
                for param in self._params]

    def step(self, grads: Sequence[Any], lr: float, scale: float = 1.0) -> None:
        """One update with ``grads`` (one per parameter, as ``platform.vjp`` returns them)
        multiplied by ``scale`` (gradient clipping) at learning rate ``lr``. torch reads the
        gradients ``vjp`` accumulated into ``.grad`` and they are cleared after the step."""
        for group in self._opt.param_groups:
            group["lr"] = float(lr)
        if self._p.framework == "torch":
            with SkipDTensorDispatch():
                if scale != 1.0:
                    for param in self._params:
                        if param.grad is not None:
                            param.grad.mul_(scale)
                self._opt.step()
            self._opt.zero_grad(set_to_none=True)
        else:
            self._opt(tuple(grads) if scale == 1.0 else tuple(g * scale for g in grads))

    def state_arrays(self) -> dict[str, np.ndarray]:
        """``{"step": int64 [], "exp_avg.{i}": ..., "exp_avg_sq.{i}": ...}`` (``i``: the
        parameter's index; float32 arrays of the parameter's local shape)."""
        out: dict[str, np.ndarray] = {}
        if self._p.framework == "torch":
            steps = set()
            for i, param in enumerate(self._params):
                state = self._opt.state.get(param, {})
                if not state:
                    continue
                steps.add(int(state["step"]))
                out[f"exp_avg.{i}"] = local_tensor(state["exp_avg"]).detach().numpy().copy()
                out[f"exp_avg_sq.{i}"] = local_tensor(state["exp_avg_sq"]).detach().numpy().copy()
            out["step"] = np.asarray(steps.pop() if steps else 0, np.int64)
        else:
            out["step"] = np.asarray(int(self._opt.state_step.asnumpy()), np.int64)
            for i in range(len(self._params)):
                out[f"exp_avg.{i}"] = local_tensor(self._opt.exp_avg[i]).asnumpy().copy()
                out[f"exp_avg_sq.{i}"] = local_tensor(self._opt.exp_avg_sq[i]).asnumpy().copy()
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore what ``state_arrays`` returned (same parameters, same local shapes).

        Raises:
            ValueError: a moment's shape differs from its parameter's local shape.
        """
        step = int(arrays["step"])
        for i, param in enumerate(self._params):
            shape = tuple(local_tensor(param).shape)
            for key in (f"exp_avg.{i}", f"exp_avg_sq.{i}"):
                if key in arrays and tuple(arrays[key].shape) != shape:
                    raise ValueError(f"optimizer state {key} has shape {arrays[key].shape} but parameter {i} has "
                                     f"the local shape {shape}; the checkpoint was written with another layout")
        if self._p.framework == "torch":
            import torch

            for i, param in enumerate(self._params):
                if f"exp_avg.{i}" not in arrays:
                    continue
                self._opt.state[param] = {"step": torch.tensor(float(step)),
                                          "exp_avg": torch.from_numpy(arrays[f"exp_avg.{i}"].copy()),
                                          "exp_avg_sq": torch.from_numpy(arrays[f"exp_avg_sq.{i}"].copy())}
        else:
            import mindspore as ms

            self._opt.state_step.set_data(ms.Tensor(step, ms.int32))
            for i in range(len(self._params)):  # set_data keeps a ParameterDTensor's spec
                self._opt.exp_avg[i].set_data(ms.Tensor(arrays[f"exp_avg.{i}"].copy()))
                self._opt.exp_avg_sq[i].set_data(ms.Tensor(arrays[f"exp_avg_sq.{i}"].copy()))


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of 1-based ``step``: linear warmup to ``peak`` over ``warmup_steps``,
    then cosine decay to ``peak / 10`` at ``total_steps``."""
    if warmup_steps and step <= warmup_steps:
        return peak * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + np.cos(np.pi * progress)))


def set_parameter_values(p: Platform, params: Sequence[Any], values: Sequence[np.ndarray]) -> None:
    """Overwrite each parameter's local piece in place with a float32 array of its shape."""
    for param, value in zip(params, values):
        if tuple(value.shape) != tuple(local_tensor(param).shape):
            raise ValueError(f"checkpoint value of shape {value.shape} for a parameter of local shape "
                             f"{tuple(local_tensor(param).shape)}")
        if p.framework == "torch":
            import torch

            with torch.no_grad():
                local_tensor(param).copy_(torch.from_numpy(np.ascontiguousarray(value)))
        else:
            import mindspore as ms

            param.set_data(ms.Tensor(np.ascontiguousarray(value)))
