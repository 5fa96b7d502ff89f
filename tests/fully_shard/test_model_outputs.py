"""fully_shard on torch models shaped like Hugging Face's: token ids in (no input needs a
gradient), a dataclass or a dict out. torch's module full-backward hooks warn on both
(and never fire for the dataclass); the backend hooks the output tensors instead (see
[Note: backward pre-hooks on output tensors]): no warning, the pre-backward hook fires
once per backward, and training matches one process.

Tolerance: rtol 2e-5 / atol 1e-6 (float32): the data-parallel gradient average adds the
ranks' sums in another order than the single-process batch."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import numpy as np
import pytest

from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.platform import get_platform

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="torch modules returning dataclasses and dicts (the Hugging Face shape)")
TOL = dict(rtol=2e-5, atol=1e-6)


@dataclasses.dataclass
class Output:
    loss: Any
    logits: Any
    hidden: Any = None


def _model(kind: str) -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, h: Any) -> Any:
            return h + torch.tanh(self.fc(h))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(11, 8)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
            self.head = torch.nn.Linear(8, 11)

        def forward(self, ids: Any, labels: Any) -> Any:
            h = self.embed(ids)
            for block in self.blocks:
                h = block(h)
            logits = self.head(h)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11).float(), labels.reshape(-1))
            if kind == "dataclass":
                return Output(loss=loss, logits=logits, hidden=h)
            return {"loss": loss, "logits": logits}

    torch.manual_seed(0)
    return Model()


def _data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    return rng.integers(0, 11, (4, 5)), rng.integers(0, 11, (4, 5))


def check_outputs(kind: str) -> None:
    import torch

    p = get_platform()
    n, r = p.world_size(), p.rank()
    ref = _model(kind)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    model = _model(kind)
    mesh = init_device_mesh(p.device_type, (n,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    fired: list[tuple[int, ...]] = []
    p.register_full_backward_pre_hook(model, lambda m, grad_output: fired.append(tuple(grad_output[0].shape)))
    rows = slice(r * 4 // n, (r + 1) * 4 // n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            ids, labels = _data(step)
            out = ref(torch.from_numpy(ids), torch.from_numpy(labels))
            (out.loss if kind == "dataclass" else out["loss"]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            out = model(torch.from_numpy(ids[rows]), torch.from_numpy(labels[rows]))
            loss = out.loss if kind == "dataclass" else out["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()
    hooks = [str(w.message) for w in caught if "hook" in str(w.message).lower()]
    assert not hooks, hooks
    assert len(fired) == 3, fired  # once per backward
    for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.to_numpy(got.full_tensor()), p.to_numpy(want), **TOL,
                                   err_msg=f"{kind}: {name} after 3 AdamW steps")


@pytest.mark.parametrize("kind", ["dataclass", "dict"])
def test_fully_shard_models_with_structured_outputs(run_on_ranks, kind: str) -> None:
    run_on_ranks(check_outputs, kind, world_size=2)
