"""A two-layer MLP built natively in each framework with the same parameter names and
values, for the hook and module-tree checks. The only framework branch of the suite."""

from __future__ import annotations

from typing import Any

import numpy as np


def mlp_weights(d_in: int, d_hidden: int, d_out: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {
        "fc1.weight": rng.standard_normal((d_hidden, d_in)).astype(np.float32),
        "fc1.bias": rng.standard_normal((d_hidden,)).astype(np.float32),
        "fc2.weight": rng.standard_normal((d_out, d_hidden)).astype(np.float32),
        "fc2.bias": rng.standard_normal((d_out,)).astype(np.float32),
    }


def mlp_numpy(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    h = np.maximum(x @ weights["fc1.weight"].T + weights["fc1.bias"], 0.0)
    return h @ weights["fc2.weight"].T + weights["fc2.bias"]


def build_mlp(p: Any, weights: dict[str, np.ndarray]) -> Any:
    """``fc2(relu(fc1(x)))`` as a torch Module or a MindSpore Cell."""
    d_hidden, d_in = weights["fc1.weight"].shape
    d_out = weights["fc2.weight"].shape[0]
    if p.framework == "torch":
        import torch

        class MLP(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = torch.nn.Linear(d_in, d_hidden)
                self.fc2 = torch.nn.Linear(d_hidden, d_out)

            def forward(self, x: Any) -> Any:
                return self.fc2(torch.relu(self.fc1(x)))

        model = MLP()
    else:
        from mindspore import mint, nn

        class MLP(nn.Cell):  # type: ignore[no-redef]
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = mint.nn.Linear(d_in, d_hidden)
                self.fc2 = mint.nn.Linear(d_hidden, d_out)

            def construct(self, x: Any) -> Any:
                return self.fc2(mint.nn.functional.relu(self.fc1(x)))

        model = MLP()
    for name, value in weights.items():
        p.set_parameter(model, name, p.make_parameter(p.from_numpy(value)))
    return model


def build_keyword_scale(p: Any) -> Any:
    """A parameter-free module ``forward(x, *, scale, shift=None) -> x * scale (+ shift)``
    (keyword-only arguments) as a torch Module or a MindSpore Cell."""

    def forward(x: Any, scale: Any, shift: Any) -> Any:
        out = x * scale
        return out if shift is None else out + shift

    if p.framework == "torch":
        import torch

        class KeywordScale(torch.nn.Module):
            def forward(self, x: Any, *, scale: Any, shift: Any = None) -> Any:
                return forward(x, scale, shift)

        return KeywordScale()
    from mindspore import nn

    class KeywordScaleCell(nn.Cell):  # type: ignore[no-redef]
        def construct(self, x: Any, *, scale: Any, shift: Any = None) -> Any:
            return forward(x, scale, shift)

    return KeywordScaleCell()
