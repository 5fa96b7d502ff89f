"""The weight-gradient split of linear layers (``weight_grad.LinearWeightSplit``) in the
zero-bubble schedules: structurally, an ``I`` runs the input-gradient matmul of every
split linear layer and no weight-gradient matmul, and the ``W`` of the same microbatch
runs the weight-gradient matmuls (counted where the split runs them); and with a
parameter outside linear layers (a gain, through ``vjp``'s weight part) the step still
gives the unpipelined model's losses and gradients.

float32: microbatch gradients summed in another order than the reference's whole-batch
backward (rtol/atol 1e-5), as in test_runtime."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hyper_parallel.core.pipeline_parallel import (PipelineStage, ScheduleDualPipeV, ScheduleInterleavedZeroBubble,
                                                   ScheduleZBVZeroBubble)
from hyper_parallel.core.pipeline_parallel.runtime import _StepState
from hyper_parallel.core.pipeline_parallel.microbatch import split_microbatches
from hyper_parallel.core.pipeline_parallel.schedules import ActionType, v_placement
from hyper_parallel.platform import get_platform
from tests.pipeline_parallel._models import DIM, build_chain, layer_weights, mse
from tests.pipeline_parallel.test_runtime import BATCH, TOL

A = ActionType


def _stages(p: Any, kind: str, modules: list[Any]) -> tuple[list[PipelineStage], Any]:
    n, r = p.world_size(), p.rank()
    num_stages = n if kind == "zbh1" else 2 * n
    placement = "v" if kind in ("zbv", "dualpipev") else "loop"
    place = v_placement(n) if placement == "v" else (lambda s: s % n)
    stages = [PipelineStage(modules[s], s, num_stages, placement=placement) for s in range(num_stages)
              if place(s) == r]
    return stages, place


def _schedule(kind: str, stages: list[PipelineStage], n_microbatches: int) -> Any:
    if kind == "zbv":
        return ScheduleZBVZeroBubble(stages, n_microbatches, mse)
    if kind == "dualpipev":
        return ScheduleDualPipeV(stages, n_microbatches, mse)
    return ScheduleInterleavedZeroBubble(stages, n_microbatches, mse)


def _counts(stages: list[PipelineStage]) -> dict[int, tuple[int, int]]:
    return {st.stage_index: (st.weight_split.input_grad_matmuls, st.weight_split.weight_grad_matmuls)
            for st in stages}


def check_split_matmuls(configs: list[tuple[str, int]]) -> None:
    """Per action of this rank: ``I`` adds ``layers`` input-gradient matmuls and no
    weight-gradient matmul to its stage, ``W`` the reverse, ``F`` neither; a full ``B``
    (DualPipeV's pairs) both. Then the gradients of the step are the unpipelined ones."""
    p = get_platform()
    n, layers = p.world_size(), 2
    rng = np.random.default_rng(5)
    x = p.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
    y = p.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
    for kind, n_microbatches in configs:
        num_stages = n if kind == "zbh1" else 2 * n
        weights = layer_weights(num_stages * layers, seed=9)
        stages, place = _stages(p, kind, [build_chain(p, weights[s * layers:(s + 1) * layers])
                                          for s in range(num_stages)])
        schedule = _schedule(kind, stages, n_microbatches)
        assert all(len(st.weight_split.layers) == layers and not st.weight_split.needs_rewalk for st in stages)
        schedule.step(x, target=y)  # infers the shapes
        for st in stages:
            st._reset_grads()
        run = _StepState(schedule, split_microbatches(p, (x,), {}, n_microbatches) if 0 in schedule._stages else [],
                         [mb[0][0] for mb in split_microbatches(p, (y,), {}, n_microbatches)]
                         if num_stages - 1 in schedule._stages else [])
        seen = {A.I: 0, A.W: 0}
        for action in schedule.actions:
            before = _counts(stages)
            run.execute(action)
            after = _counts(stages)
            parts = action.sub_actions if action.type is A.OVERLAP_B_F else (action,)
            expected = dict(before)
            for part in parts:
                d_in, d_w = {A.I: (layers, 0), A.W: (0, layers), A.B: (layers, layers)}.get(part.type, (0, 0))
                old = expected[part.stage_index]
                expected[part.stage_index] = (old[0] + d_in, old[1] + d_w)
                seen[part.type] = seen.get(part.type, 0) + 1
            assert after == expected, (kind, n_microbatches, p.rank(), str(action), before, after)
        assert seen[A.I] and seen[A.W] and seen[A.I] == seen[A.W], (kind, seen)
        for work in run.sends:
            work.wait()
        assert not run.captures and not run.backward, "every capture and recording was used"


def check_gain_parity(configs: list[tuple[str, int]]) -> None:
    """Stages ``chain -> x * gain``: the gain takes ``vjp``'s weight-part path beside the
    split linear layers; losses and every gradient equal the unpipelined model's."""
    p = get_platform()
    n, r, layers = p.world_size(), p.rank(), 2
    rng = np.random.default_rng(13)
    x_np = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y_np = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    for kind, n_microbatches in configs:
        num_stages = n if kind == "zbh1" else 2 * n
        weights = layer_weights(num_stages * layers, seed=17)
        gains = [(1.0 + 0.1 * rng.standard_normal(DIM)).astype(np.float32) for _ in range(num_stages)]

        def build(s: int) -> Any:
            return _GainChain.build(p, weights[s * layers:(s + 1) * layers], gains[s])

        reference = [build(s) for s in range(num_stages)]

        def whole(t: Any) -> Any:
            for module in reference:
                t = module(t)
            return mse(t, p.from_numpy(y_np))

        ref_params = [[param for _, param in p.named_parameters(m)] for m in reference]
        loss, backward = p.vjp(whole, [p.from_numpy(x_np)], [q for ps in ref_params for q in ps])
        _, flat = backward([p.full((), 1.0, loss.dtype)])
        ref_grads, i = [], 0
        for ps in ref_params:
            ref_grads.append([p.to_numpy(g) for g in flat[i:i + len(ps)]])
            i += len(ps)
        stages, place = _stages(p, kind, [build(s) for s in range(num_stages)])
        schedule = _schedule(kind, stages, n_microbatches)
        assert all(st.weight_split.needs_rewalk and len(st.weight_split.layers) == layers for st in stages)
        losses: list = []
        schedule.step(p.from_numpy(x_np), target=p.from_numpy(y_np), losses=losses)
        what = f"{kind}, {n_microbatches} microbatches, rank {r}"
        if place(num_stages - 1) == r:
            np.testing.assert_allclose(np.mean([float(p.to_numpy(v)) for v in losses]), float(p.to_numpy(loss)),
                                       **TOL, err_msg=what)
        for st in stages:
            got = st.param_grads()
            for (name, param), want in zip(st.named_params, ref_grads[st.stage_index]):
                np.testing.assert_allclose(p.to_numpy(got[name]), want, **TOL,
                                           err_msg=f"{what}: stage {st.stage_index} {name}")
                if p.framework == "torch":  # landed like any gradient: accumulated into param.grad
                    np.testing.assert_array_equal(p.to_numpy(param.grad), p.to_numpy(got[name]), err_msg=name)
            split = st.weight_split
            split.remove()  # the layers' own forward is back: a backward runs no split matmul
            before = (split.input_grad_matmuls, split.weight_grad_matmuls)
            out, back = p.vjp(st.submodule, [p.from_numpy(x_np[:2])], [q for _, q in st.named_params])
            back([p.full(tuple(out.shape), 1.0, out.dtype)])
            assert (split.input_grad_matmuls, split.weight_grad_matmuls) == before, what


class _GainChain:
    """``chain(x) * gain``: a chain of linear layers and a parameter outside them."""

    @staticmethod
    def build(p: Any, weights: list, gain: np.ndarray) -> Any:
        chain = build_chain(p, weights)
        if p.framework == "torch":
            import torch

            class Gain(torch.nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.chain = chain
                    self.gain = torch.nn.Parameter(torch.from_numpy(gain.copy()))

                def forward(self, t: Any) -> Any:
                    return self.chain(t) * self.gain

            return Gain()
        import mindspore as ms

        class MSGain(ms.nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                self.chain = chain
                self.gain = ms.Parameter(ms.Tensor(gain.copy()), name="gain")

            def construct(self, t: Any) -> Any:
                return self.chain(t) * self.gain

        return MSGain()


def check_weight_split(structural_torch: list, structural_ms: list, gain_torch: list, gain_ms: list) -> None:
    """Both checks in one rank call (MindSpore pays seconds per call)."""
    torch_fw = get_platform().framework == "torch"
    check_split_matmuls(structural_torch if torch_fw else structural_ms)
    check_gain_parity(gain_torch if torch_fw else gain_ms)


@pytest.mark.parametrize("world_size", [2])
def test_weight_split(run_on_ranks, world_size: int) -> None:
    structural = [("zbh1", 4), ("izb", 4), ("zbv", 4), ("dualpipev", 4)]
    run_on_ranks(check_weight_split, structural, [("zbh1", 4), ("zbv", 4)],
                 [("zbh1", 4), ("izb", 4), ("zbv", 4), ("dualpipev", 4)], [("zbv", 4), ("dualpipev", 4)],
                 world_size=world_size, timeout_s=300)
