"""Small models for the tensor-parallel tests, built natively in each framework with the
same parameter names and values (the framework branch lives here, in test support)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel.attention import local_attention

HEAD_DIM = 2


def weights(kind: str, dim: int = 6, hidden: int = 7, heads: int = 4, kv_heads: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    if kind == "attention":
        return {"wq.weight": w(heads * HEAD_DIM, dim), "wk.weight": w(kv_heads * HEAD_DIM, dim),
                "wv.weight": w(kv_heads * HEAD_DIM, dim), "wo.weight": w(dim, heads * HEAD_DIM),
                "wo.bias": w(dim)}
    out = {"fc1.weight": w(hidden, dim), "fc1.bias": w(hidden), "fc2.weight": w(dim, hidden), "fc2.bias": w(dim)}
    if kind == "sp_block":
        out["norm.weight"] = (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    return out


def _attention_forward(p: Any, m: Any, x: Any) -> Any:
    b, s = x.shape[0], x.shape[1]
    q = m.wq(x).reshape(b, s, -1, HEAD_DIM)
    k = m.wk(x).reshape(b, s, -1, HEAD_DIM)
    v = m.wv(x).reshape(b, s, -1, HEAD_DIM)
    out = local_attention(q, k, v, is_causal=True)
    return m.wo(out.reshape(b, s, -1))


def build(p: Any, kind: str, values: dict[str, np.ndarray]) -> Any:
    """``mlp``: fc2(relu(fc1(x))); ``sp_block``: fc2(relu(fc1(rmsnorm(x)))); ``attention``:
    wo(causal_attention(wq x, wk x, wv x)) over heads of ``HEAD_DIM``."""
    shapes = {name: value.shape for name, value in values.items()}
    # name -> (in features, out features, has bias), sorted so every rank registers the
    # submodules in the same order (sets iterate in a per-process hash order).
    linears = {name: (shapes[f"{name}.weight"][1], shapes[f"{name}.weight"][0], f"{name}.bias" in shapes)
               for name in sorted({n.split(".")[0] for n in shapes if n.endswith(".weight") and n != "norm.weight"})}
    if p.framework == "torch":
        import torch

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                for name, (in_f, out_f, bias) in linears.items():
                    setattr(self, name, torch.nn.Linear(in_f, out_f, bias=bias))
                if "norm.weight" in shapes:
                    self.norm = RMSNorm(shapes["norm.weight"][0])

            def forward(self, x: Any) -> Any:
                if kind == "attention":
                    return _attention_forward(p, self, x)
                if kind == "sp_block":
                    x = self.norm(x)
                return self.fc2(torch.relu(self.fc1(x)))

        class RMSNorm(torch.nn.Module):
            def __init__(self, dim: int) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(dim))

            def forward(self, x: Any) -> Any:
                return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.weight

        model = Model()
    else:
        import mindspore as ms
        from mindspore import mint, nn

        class MSRMSNorm(nn.Cell):
            def __init__(self, dim: int) -> None:
                super().__init__()
                self.weight = ms.Parameter(mint.ones(dim), name="weight")

            def construct(self, x: Any) -> Any:
                return x * mint.rsqrt(mint.mean(x * x, -1, True) + 1e-6) * self.weight

        class MSModel(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                for name, (in_f, out_f, bias) in linears.items():
                    setattr(self, name, mint.nn.Linear(in_f, out_f, bias=bias))
                if "norm.weight" in shapes:
                    self.norm = MSRMSNorm(shapes["norm.weight"][0])

            def construct(self, x: Any) -> Any:
                if kind == "attention":
                    return _attention_forward(p, self, x)
                if kind == "sp_block":
                    x = self.norm(x)
                return self.fc2(mint.nn.functional.relu(self.fc1(x)))

        model = MSModel()
    for name, value in values.items():
        p.set_parameter(model, name, p.make_parameter(p.from_numpy(value)))
    return model


def optimizer_step(p: Any, params: list[Any], grads: tuple[Any, ...]) -> None:
    """One AdamW step (torch.optim.AdamW; MindSpore's AdamWeightDecay) on ``params``.

    torch reads the gradients ``vjp`` accumulated into ``.grad``; MindSpore takes them."""
    if p.framework == "torch":
        import torch

        torch.optim.AdamW(params, lr=0.05, weight_decay=0.1).step()
    else:
        from mindspore import nn

        nn.AdamWeightDecay(params, learning_rate=0.05, weight_decay=0.1)(tuple(grads))
