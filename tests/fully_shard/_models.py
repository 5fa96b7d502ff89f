"""A small model for the fully_shard tests, built natively in each framework with the
same parameter names and values, and the training loop of each framework (the
framework branch lives here, in test support).

Model: ``x [batch, 5] -> inp (7x5, uneven over 4 ranks) -> blocks (residual
fc2(relu(fc1(h))), 6x7 and 7x6) -> out (5x7) -> tied (reads inp.weight) [batch, 7]``,
scaled by a frozen ``gain`` [7] (the ignored parameter), loss ``mean(z * z)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

N_BLOCKS = 2


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    out = {"inp.weight": w(7, 5), "inp.bias": w(7)}
    for i in range(N_BLOCKS):
        out.update({f"blocks.{i}.fc1.weight": w(6, 7), f"blocks.{i}.fc1.bias": w(6),
                    f"blocks.{i}.fc2.weight": w(7, 6), f"blocks.{i}.fc2.bias": w(7)})
    out.update({"out.weight": w(5, 7), "out.bias": w(5), "gain": (1.0 + 0.1 * rng.standard_normal(7)).astype(np.float32)})
    return out


def build(p: Any, values: dict[str, np.ndarray]) -> Any:
    """The model with ``values``; ``tied.weight`` is the ``inp.weight`` parameter object."""
    if p.framework == "torch":
        import torch

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = torch.nn.Linear(7, 6)
                self.fc2 = torch.nn.Linear(6, 7)

            def forward(self, h: Any) -> Any:
                return h + self.fc2(torch.relu(self.fc1(h)))

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inp = torch.nn.Linear(5, 7)
                self.blocks = torch.nn.ModuleList([Block() for _ in range(N_BLOCKS)])
                self.out = torch.nn.Linear(7, 5)
                self.tied = torch.nn.Linear(5, 7, bias=False)
                self.gain = torch.nn.Parameter(torch.ones(7), requires_grad=False)

            def forward(self, x: Any) -> Any:
                h = self.inp(x)
                for block in self.blocks:
                    h = block(h)
                return self.tied(self.out(h)) * self.gain

        model = Model()
    else:
        import mindspore as ms
        from mindspore import mint, nn

        class MSBlock(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = mint.nn.Linear(7, 6)
                self.fc2 = mint.nn.Linear(6, 7)

            def construct(self, h: Any) -> Any:
                return h + self.fc2(mint.nn.functional.relu(self.fc1(h)))

        class MSModel(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                self.inp = mint.nn.Linear(5, 7)
                self.blocks = nn.CellList([MSBlock() for _ in range(N_BLOCKS)])
                self.out = mint.nn.Linear(7, 5)
                self.tied = mint.nn.Linear(5, 7, bias=False)
                self.gain = ms.Parameter(mint.ones(7), name="gain", requires_grad=False)

            def construct(self, x: Any) -> Any:
                h = self.inp(x)
                for block in self.blocks:
                    h = block(h)
                return self.tied(self.out(h)) * self.gain

        model = MSModel()
    for name, value in values.items():
        p.set_parameter(model, name, p.make_parameter(p.from_numpy(value), requires_grad=name != "gain"))
    p.set_parameter(model, "tied.weight", _param(model, "inp.weight", p))
    return model


def _param(model: Any, fqn: str, p: Any) -> Any:
    owner = model
    for part in fqn.split("."):
        owner = getattr(owner, part)
    return owner


def trainable(p: Any, model: Any) -> list[Any]:
    """The parameters the optimizer steps (each once; the frozen gain left out)."""
    return [param for name, param in p.named_parameters(model) if name != "gain"]


class Trainer:
    """The framework's own loop: torch ``loss.backward()`` + ``torch.optim.AdamW``;
    MindSpore ``value_and_grad`` over the parameters + ``nn.AdamWeightDecay``, both
    built **after** fully_shard (they bind the parameter objects)."""

    def __init__(self, p: Any, model: Any, lr: float = 0.02, weight_decay: float = 0.1) -> None:
        self.p, self.model = p, model
        self.params = trainable(p, model)
        if p.framework == "torch":
            import torch

            self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        else:
            import mindspore as ms
            from mindspore import nn

            self.opt = nn.AdamWeightDecay(self.params, learning_rate=lr, weight_decay=weight_decay)
            self.grad_fn = ms.value_and_grad(self._loss, None, weights=self.params)
        self.grads: Any = None  # MindSpore: the summed gradients of the backwards since the last step

    def _loss(self, x: Any, scale: float) -> Any:
        z = self.model(x)
        return (z * z).mean() * scale

    def backward(self, x: np.ndarray, scale: float = 1.0) -> float:
        """Forward and backward of ``scale * mean(model(x) ** 2)``; gradients accumulate."""
        p = self.p
        if p.framework == "torch":
            loss = self._loss(p.from_numpy(x), scale)
            loss.backward()
            return float(loss.detach())
        loss, grads = self.grad_fn(p.from_numpy(x), scale)
        self.grads = grads if self.grads is None else tuple(a + b for a, b in zip(self.grads, grads))
        return float(loss.asnumpy())

    def grad_arrays(self) -> list[np.ndarray]:
        """The gradients the optimizer is about to apply, one per parameter (``self.params`` order)."""
        if self.p.framework == "torch":
            for param in self.params:  # a DTensor parameter's gradient is a DTensor of its placements
                if hasattr(param, "placements"):
                    assert type(param.grad) is type(param) and param.grad.placements == param.placements, \
                        (type(param.grad), getattr(param.grad, "placements", None), param.placements)
            return [self.p.to_numpy(param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad)
                    for param in self.params]
        return [self.p.to_numpy(g) for g in self.grads]  # MindSpore: the local pieces

    def step(self) -> None:
        if self.p.framework == "torch":
            self.opt.step()
            self.opt.zero_grad()
        else:
            self.opt(self.grads)
            self.grads = None


def assert_shard_grads(trainer: Trainer, ref_trainer: Trainer, states: list[Any], tol: dict[str, float],
                       label: str) -> None:
    """Each of ``trainer``'s gradients (this rank's pieces) equals the rows along its
    parameter's shard dim of ``ref_trainer``'s (one process) that this rank holds; the
    parameters are found among the ``HSDPState`` units ``states``."""
    from tests.dtensor._reference import chunk

    for param, grad, expected in zip(trainer.params, trainer.grad_arrays(), ref_trainer.grad_arrays()):
        hp = next(hp for state in states for hp in state.params if hp.sharded is param)
        start, length = chunk(hp.shape[hp.dim], hp.shard_size, hp.shard_rank)
        if hp.replicated:  # [Note: no empty chunks on MindSpore]: held whole
            start, length = 0, hp.shape[hp.dim]
        np.testing.assert_allclose(grad, np.take(expected, range(start, start + length), axis=hp.dim), **tol,
                                   err_msg=f"{label}: gradient of {hp.fqn} (Shard({hp.dim}))")
