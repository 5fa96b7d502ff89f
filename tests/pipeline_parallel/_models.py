"""A chain of ``tanh(linear)`` layers built natively in each framework (the framework
branch lives here, in test support), its numpy-free reference loss, and a slicing of
it into pipeline stages."""

from __future__ import annotations

from typing import Any

import numpy as np

DIM = 6


def layer_weights(n_layers: int, dim: int = DIM, seed: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [((rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32),
             (0.1 * rng.standard_normal(dim)).astype(np.float32)) for _ in range(n_layers)]


def build_chain(p: Any, weights: list[tuple[np.ndarray, np.ndarray]]) -> Any:
    """``x -> tanh(x @ W_i^T + b_i)`` for each layer (the framework's linear layer),
    parameters ``layers.{i}.weight/bias``."""
    if p.framework == "torch":
        import torch

        class Chain(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0]) for w, _ in weights)
                with torch.no_grad():
                    for layer, (w, b) in zip(self.layers, weights):
                        layer.weight.copy_(torch.from_numpy(w))
                        layer.bias.copy_(torch.from_numpy(b))

            def forward(self, x: Any) -> Any:
                for layer in self.layers:
                    x = torch.tanh(layer(x))
                return x

        return Chain()
    import mindspore as ms

    def linear(w: np.ndarray, b: np.ndarray) -> Any:
        layer = ms.mint.nn.Linear(w.shape[1], w.shape[0])  # MindSpore's linear layer, like torch.nn.Linear
        layer.weight.set_data(ms.Tensor(w))
        layer.bias.set_data(ms.Tensor(b))
        return layer

    class MSChain(ms.nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.layers = ms.nn.CellList([linear(w, b) for w, b in weights])

        def construct(self, x: Any) -> Any:
            for layer in self.layers:
                x = ms.ops.tanh(layer(x))
            return x

    return MSChain()


def mse(output: Any, target: Any) -> Any:
    """Mean squared error over all elements, with tensor methods only (both frameworks)."""
    diff = output - target
    return (diff * diff).mean()


def _module(p: Any, forward: Any, attributes: dict[str, Any]) -> Any:
    """A framework module (torch ``nn.Module`` / MindSpore ``Cell``) whose forward is
    ``forward(self, ...)`` and which holds ``attributes`` (submodules or parameters)."""
    if p.framework == "torch":
        import torch

        base, method = torch.nn.Module, "forward"
    else:
        import mindspore as ms

        base, method = ms.nn.Cell, "construct"

    def __init__(self: Any) -> None:
        base.__init__(self)
        for name, value in attributes.items():
            setattr(self, name, value)

    return type("TestModule", (base,), {"__init__": __init__, method: forward})()


def chain_modules(p: Any, blocks: list[Any]) -> Any:
    """A framework module running ``blocks`` one after the other (``block{i}``)."""
    def forward(self: Any, x: Any) -> Any:
        for i in range(len(blocks)):
            x = getattr(self, f"block{i}")(x)
        return x

    return _module(p, forward, {f"block{i}": block for i, block in enumerate(blocks)})


def build_moe_block(p: Any, moe: Any, weights: dict[str, Any], dispatch: Any, combine: Any) -> Any:
    """``x -> x + moe(x @ pre)``: a framework module holding ``pre``, ``router`` and this
    rank's experts' ``w1.{l}``/``w2.{l}`` (numpy values in ``weights``), whose forward
    calls the core ``MoE`` with the given ``dispatch``/``combine`` (wrapped for overlap)."""
    n_local = moe.local_experts

    def forward(self: Any, x: Any) -> Any:
        w1 = [getattr(self, f"w1_{l}") for l in range(n_local)]
        w2 = [getattr(self, f"w2_{l}") for l in range(n_local)]

        def expert(l: int, t: Any) -> Any:
            h = t @ w1[l]
            return (h + h * h * 0.1) @ w2[l]

        return x + moe.forward(x @ self.pre, self.router, expert, dispatch=dispatch, combine=combine)

    if p.framework == "torch":
        import torch

        params = {name: torch.nn.Parameter(torch.from_numpy(value.copy())) for name, value in weights.items()}
    else:
        import mindspore as ms

        params = {name: ms.Parameter(ms.Tensor(value.copy()), name=name) for name, value in weights.items()}
    return _module(p, forward, params)


def build_loss_stage(p: Any, weights: list[tuple[np.ndarray, np.ndarray]], last: bool,
                     wrap: Any = None, prepare: Any = None) -> Any:
    """A stage in upstream hyper-parallel's / MindFormers' convention: ``forward(x, *,
    target, scale)`` runs the chain of ``weights`` on ``x`` (first passed through
    ``prepare`` when given); the last stage returns ``(mse(chain(x), target) * scale,)``
    (its loss, from a keyword argument every stage receives), the others the chain's
    output (passed through ``wrap`` when given)."""
    chain = build_chain(p, weights)

    def forward(self: Any, x: Any, target: Any = None, scale: float = 1.0) -> Any:
        out = self.chain(x if prepare is None else prepare(x))
        if last:
            return (mse(out, target) * scale,)
        return out if wrap is None else wrap(out)

    return _module(p, forward, {"chain": chain})
