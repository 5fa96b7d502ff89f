"""Expert parallelism: the MoE layer with experts sharded over 2 and 4 ranks against the
same layer with every expert on one rank processing every rank's tokens (outputs, input,
router and expert gradients); and the comm/compute overlap on an MoE model: identical
values and gradients with and without CommComputeOverlap.

float32 tolerances (rtol/atol 1e-5): the expert GEMMs see different row sets and the
weight gradients sum rows in a different order than the one-rank reference."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.expert_parallel import MoE
from hyper_parallel.core.pipeline_parallel import CommComputeOverlap, HookCoordinator
from hyper_parallel.platform import get_platform
from hyper_parallel.core.process_groups import split_group

TOL = dict(rtol=1e-5, atol=1e-5)
DIM, HIDDEN, TOKENS = 4, 5, 6


def _weights(num_experts: int):
    rng = np.random.default_rng(4)
    router = rng.standard_normal((num_experts, DIM)).astype(np.float32)
    w1 = [(rng.standard_normal((DIM, HIDDEN)) / 2).astype(np.float32) for _ in range(num_experts)]
    w2 = [(rng.standard_normal((HIDDEN, DIM)) / 2).astype(np.float32) for _ in range(num_experts)]
    return router, w1, w2


def _expert_fn(w1, w2):
    def run(local: int, tokens):
        h = tokens @ w1[local]
        return (h + h * h * 0.1) @ w2[local]
    return run


def _layer(p, moe: MoE, router, w1, w2, experts):
    params = [p.make_parameter(p.from_numpy(router))]
    params += [p.make_parameter(p.from_numpy(w1[e])) for e in experts]
    params += [p.make_parameter(p.from_numpy(w2[e])) for e in experts]
    n = len(experts)
    fn = _expert_fn(params[1:1 + n], params[1 + n:])
    return (lambda x: moe.forward(x, params[0], fn)), params


def check_moe_parity() -> None:
    p = get_platform()
    n, r = p.world_size(), p.rank()
    alone = split_group([[i] for i in range(n)])  # the one-rank reference layer
    rng = np.random.default_rng(9)
    for num_experts, top_k in ((n, 1), (2 * n, 2), (2 * n, 3)):
        x = rng.standard_normal((n * TOKENS, DIM)).astype(np.float32)  # every rank's tokens
        g = rng.standard_normal((n * TOKENS, DIM)).astype(np.float32)
        router, w1, w2 = _weights(num_experts)
        what = f"{num_experts} experts, top-{top_k}, {n} ranks, rank {r}"

        ref_moe = MoE(num_experts, top_k, group=alone)
        ref_fn, ref_params = _layer(p, ref_moe, router, w1, w2, range(num_experts))
        ref_out, ref_backward = p.vjp(ref_fn, [p.from_numpy(x)], ref_params)
        (ref_gx,), ref_grads = ref_backward([p.from_numpy(g)])

        moe = MoE(num_experts, top_k)
        experts = moe.expert_range
        fn, params = _layer(p, moe, router, w1, w2, experts)
        mine = slice(r * TOKENS, (r + 1) * TOKENS)
        out, backward = p.vjp(fn, [p.from_numpy(x[mine])], params)
        (gx,), grads = backward([p.from_numpy(g[mine])])
        np.testing.assert_allclose(p.to_numpy(out), p.to_numpy(ref_out)[mine], **TOL, err_msg=f"{what}: output")
        np.testing.assert_allclose(p.to_numpy(gx), p.to_numpy(ref_gx)[mine], **TOL, err_msg=f"{what}: input grad")
        router_grad = p.to_numpy(p.all_reduce(grads[0]).wait())  # each rank's share of the router's gradient
        np.testing.assert_allclose(router_grad, p.to_numpy(ref_grads[0]), **TOL, err_msg=f"{what}: router grad")
        k = len(experts)
        for i, e in enumerate(experts):
            np.testing.assert_allclose(p.to_numpy(grads[1 + i]), p.to_numpy(ref_grads[1 + e]), **TOL,
                                       err_msg=f"{what}: expert {e} w1 grad")
            np.testing.assert_allclose(p.to_numpy(grads[1 + k + i]), p.to_numpy(ref_grads[1 + num_experts + e]),
                                       **TOL, err_msg=f"{what}: expert {e} w2 grad")
    with pytest.raises(ValueError, match=f"num_experts=3 must be a positive multiple of the expert-parallel group "
                                         f"size {n}"):
        MoE(3, 1)
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, num_experts=4\]"):
        MoE(4, 5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_matches_one_rank(run_on_ranks, world_size: int) -> None:
    run_on_ranks(check_moe_parity, world_size=world_size)


LAYERS = 2


def _moe_model(p, overlap):
    """LAYERS blocks ``x + moe(x @ w_pre)``, 2 experts per rank, top-2."""
    n = p.world_size()
    rng = np.random.default_rng(2)
    moe = MoE(2 * n, 2)
    pre = [p.make_parameter(p.from_numpy((rng.standard_normal((DIM, DIM)) / 2).astype(np.float32)))
           for _ in range(LAYERS)]
    layers, params = [], list(pre)
    for layer in range(LAYERS):
        router, w1, w2 = _weights(2 * n)
        fn_params = [p.make_parameter(p.from_numpy(router))]
        fn_params += [p.make_parameter(p.from_numpy(w1[e])) for e in moe.expert_range]
        fn_params += [p.make_parameter(p.from_numpy(w2[e])) for e in moe.expert_range]
        params += fn_params
        dispatch = overlap.wrap_dispatch(moe.dispatch) if overlap else moe.dispatch
        combine = overlap.wrap_combine(moe.combine, is_last_layer=layer == LAYERS - 1) if overlap else moe.combine
        layers.append((fn_params, dispatch, combine))

    def forward(x):
        for layer, (fn_params, dispatch, combine) in enumerate(layers):
            fn = _expert_fn(fn_params[1:3], fn_params[3:5])
            x = x + moe.forward(x @ pre[layer], fn_params[0], fn, dispatch=dispatch, combine=combine)
        return x

    return forward, params


def check_moe_overlap() -> None:
    p = get_platform()
    rng = np.random.default_rng(20 + p.rank())
    xs = [p.from_numpy(rng.standard_normal((TOKENS, DIM)).astype(np.float32)) for _ in range(2)]
    gs = [p.from_numpy(rng.standard_normal((TOKENS, DIM)).astype(np.float32)) for _ in range(2)]
    forward, params = _moe_model(p, None)
    expected = []
    for x, g in zip(xs, gs):
        out, backward = p.vjp(forward, [x], params)
        expected.append((p.to_numpy(out), [p.to_numpy(t) for t in backward([g])[1]]))
    overlap = CommComputeOverlap(timeout_s=120.0)
    forward, params = _moe_model(p, overlap)
    out0, backward0 = p.vjp(forward, [xs[0]], params)
    (out1, backward1), (_, grads0) = overlap.run(lambda: p.vjp(forward, [xs[1]], params),
                                                 lambda: backward0([gs[0]]))
    np.testing.assert_array_equal(p.to_numpy(out0), expected[0][0])
    np.testing.assert_array_equal(p.to_numpy(out1), expected[1][0], err_msg="forward under overlap")
    for i, grad in enumerate(grads0):
        np.testing.assert_array_equal(p.to_numpy(grad), expected[0][1][i], err_msg=f"gradient {i} under overlap")
    for i, grad in enumerate(backward1([gs[1]])[1]):
        np.testing.assert_array_equal(p.to_numpy(grad), expected[1][1][i], err_msg=f"gradient {i} after overlap")


def test_moe_overlap_matches_sequential(run_on_ranks) -> None:
    run_on_ranks(check_moe_overlap, world_size=2)


def two_pipelines(p, seed: int):
    """4 ranks: pipelines ``[0, 1]`` and ``[2, 3]``, expert-parallel groups across them;
    returns ``(pp group, ep group, pipeline rank, x, y)`` with each pipeline's own
    ``[8, DIM]`` batch and target."""
    pp = split_group([[0, 1], [2, 3]])
    ep = split_group([[0, 2], [1, 3]])
    rng = np.random.default_rng(seed + p.rank(ep))
    x = p.from_numpy(rng.standard_normal((8, DIM)).astype(np.float32))
    y = p.from_numpy(rng.standard_normal((8, DIM)).astype(np.float32))
    return pp, ep, p.rank(pp), x, y


def moe_block_weights(moe: MoE, seed: int) -> dict[str, np.ndarray]:
    """A block's ``pre`` and ``router`` and this rank's experts' ``w1_{l}`` / ``w2_{l}``
    out of 4 experts drawn from ``seed`` (the same on every rank)."""
    w = np.random.default_rng(seed)
    weights = {"pre": (w.standard_normal((DIM, DIM)) / 2).astype(np.float32),
               "router": w.standard_normal((4, DIM)).astype(np.float32)}
    experts = {f"{k}_{e}": (w.standard_normal(shape) / 2).astype(np.float32)
               for e in range(4) for k, shape in (("w1", (DIM, HIDDEN)), ("w2", (HIDDEN, DIM)))}
    for l, e in enumerate(moe.expert_range):
        weights[f"w1_{l}"], weights[f"w2_{l}"] = experts[f"w1_{e}"], experts[f"w2_{e}"]
    return weights


def check_pipeline_overlap_on_moe() -> None:
    """4 ranks: 2 pipelines of 2 ranks (interleaved, 4 MoE-block stages) whose stages'
    experts are sharded over the 2 pipelines. OVERLAP_B_F pairs run a forward and a
    backward on two threads meeting at the blocks' dispatch/combine hooks; losses and
    every gradient equal the same schedule without the overlap, exactly."""
    from hyper_parallel.core.pipeline_parallel import PipelineStage, ScheduleInterleaved1F1B
    from tests.pipeline_parallel._models import build_moe_block, mse

    p = get_platform()
    r = p.rank()
    pp, ep, pp_rank, x, y = two_pipelines(p, 30)
    results = {}
    for overlap_b_f in (False, True):
        overlap = CommComputeOverlap(timeout_s=120.0)
        stages = []
        for s in (pp_rank, pp_rank + 2):
            moe = MoE(4, 2, group=ep)
            weights = moe_block_weights(moe, 100 + s)
            dispatch = overlap.wrap_dispatch(moe.dispatch) if overlap_b_f else moe.dispatch
            combine = overlap.wrap_combine(moe.combine, is_last_layer=True) if overlap_b_f else moe.combine
            stages.append(PipelineStage(build_moe_block(p, moe, weights, dispatch, combine), s, 4, group=pp))
        schedule = ScheduleInterleaved1F1B(stages, 4, mse, overlap_b_f=overlap_b_f, overlap=overlap)
        assert overlap_b_f == any(a.type.name == "OVERLAP_B_F" for a in schedule.actions), schedule.actions
        losses: list = []
        schedule.step(x, target=y, losses=losses)
        results[overlap_b_f] = ([float(p.to_numpy(v)) for v in losses],
                                {(s.stage_index, k): p.to_numpy(v) for s in stages for k, v in s.param_grads().items()})
    assert results[True][0] == results[False][0], (r, results)
    for key, grad in results[False][1].items():
        np.testing.assert_array_equal(results[True][1][key], grad, err_msg=f"rank {r} gradient {key}")


def test_pipeline_overlap_on_moe(run_on_ranks) -> None:
    run_on_ranks(check_pipeline_overlap_on_moe, world_size=4, timeout_s=300)


def overlap_step(overlap: CommComputeOverlap, log: list[str] | None = None):
    """A custom ``OVERLAP_B_F`` step function in the shape of MindFormers'
    ``_make_overlap_b_f_callback`` (its chunk brackets and the schedule/stage calls it
    makes), without its MindSpore-only ``set_enable_grad``."""
    from hyper_parallel.core.pipeline_parallel import HookRole

    def step(action, ctx) -> None:
        bwd_step, fwd_step = action.sub_steps
        schedule = ctx.schedule
        fwd_stage = schedule._stage_dict[fwd_step.stage_index]
        bwd_stage = schedule._stage_dict[bwd_step.stage_index]
        fwd_mi, bwd_mi = fwd_step.micro_index, bwd_step.micro_index
        coordinator = overlap.coordinator

        def fwd_fn() -> None:
            if coordinator.is_enabled():
                coordinator.rendezvous(HookRole.COMPUTE)
            schedule.wait_fwd_recv(fwd_stage.stage_index, fwd_mi)
            out = fwd_stage.forward_one_chunk(fwd_mi, ctx.arg_mbs[fwd_mi], ctx.kwarg_mbs[fwd_mi])
            schedule.update_losses(fwd_stage, out, ctx.losses)
            if coordinator.is_enabled():
                coordinator.notify_dispatched(HookRole.COMM)
                coordinator.rendezvous(HookRole.COMPUTE)

        def bwd_fn() -> None:
            schedule.wait_bwd_recv(bwd_stage.stage_index, bwd_mi)
            bwd_stage.backward_one_chunk(bwd_mi)
            if coordinator.is_enabled():
                coordinator.rendezvous(HookRole.COMPUTE)

        bwd_stage.recompute_one_chunk(bwd_mi)
        overlap.run(fwd_fn=fwd_fn, bwd_fn=bwd_fn)
        if log is not None:
            log.append((str(action), *overlap.coordinator.arrived))

    return step


class _Counting(HookCoordinator):
    """Counts each side's rendezvous of the latest pairing (``arrived``)."""

    def begin(self, forward_thread: int, backward_thread: int) -> None:
        super().begin(forward_thread, backward_thread)
        self.counts = {"forward": 0, "backward": 0}

    def _rendezvous(self, side: str, name: str) -> None:
        self.counts[side] += 1
        super()._rendezvous(side, name)

    @property
    def arrived(self) -> tuple[int, int]:
        return self.counts["forward"], self.counts["backward"]


def _moe_stage_block(p, moe, overlap, s: int, layers: int, checkpoint: bool):
    """Stage ``s``: ``layers`` MoE blocks (dispatch/combine wrapped by ``overlap``, the
    last combine ``D_LAST``), each checkpointed when ``checkpoint``."""
    from hyper_parallel import checkpoint_wrapper
    from tests.pipeline_parallel._models import build_moe_block, chain_modules

    blocks = []
    for layer in range(layers):
        weights = moe_block_weights(moe, 100 + 10 * s + layer)
        dispatch = overlap.wrap_dispatch(moe.dispatch) if overlap else moe.dispatch
        combine = overlap.wrap_combine(moe.combine, is_last_layer=layer == layers - 1) if overlap else moe.combine
        block = build_moe_block(p, moe, weights, dispatch, combine)
        blocks.append(checkpoint_wrapper(block) if checkpoint else block)
    return chain_modules(p, blocks)


def check_custom_overlap_step(schedule_name: str, checkpoint: bool) -> None:
    """4 ranks, 2 pipelines x 2 expert-parallel ranks, stages of two MoE blocks: the
    schedule's OVERLAP_B_F actions run by a registered custom step function in
    MindFormers' shape (chunk brackets, forward_one_chunk / backward_one_chunk on two
    threads) give exactly the losses and gradients of the same schedule without overlap;
    the function ran, and the two threads paired at every hook."""
    from hyper_parallel.core.pipeline_parallel import (MetaStepType, PipelineStage, Schedule1F1B,
                                                       ScheduleInterleaved1F1B)
    from tests.pipeline_parallel._models import mse

    p = get_platform()
    r = p.rank()
    pp, ep, pp_rank, x, y = two_pipelines(p, 40)
    stage_ids = (pp_rank,) if schedule_name == "1f1b" else (pp_rank, pp_rank + 2)
    results, ran = {}, []
    for mode in ("plain", "custom"):
        overlap = CommComputeOverlap(_Counting(timeout_s=120.0)) if mode == "custom" else None
        moe = MoE(4, 2, group=ep)
        stages = [PipelineStage(_moe_stage_block(p, moe, overlap, s, 2, checkpoint), s, len(stage_ids) * 2, group=pp)
                  for s in stage_ids]
        if schedule_name == "1f1b":
            schedule = Schedule1F1B(stages, 4, mse, overlap_b_f=mode == "custom")
        else:
            schedule = ScheduleInterleaved1F1B(stages, 4, mse, overlap_b_f=mode == "custom")
        if mode == "custom":
            schedule.register_custom_function(MetaStepType.OVERLAP_B_F, overlap_step(overlap, ran))
        losses: list = []
        schedule.step(x, target=y, losses=losses)
        results[mode] = ([float(p.to_numpy(v)) for v in losses],
                         {(s.stage_index, k): p.to_numpy(v) for s in stages for k, v in s.param_grads().items()})
    # two MoE layers per stage: A, B, C, D, A, B, C forward; C, B, A, D, C, B, A backward
    expected = [(str(a), 7, 7) for a in schedule.actions if a.type is MetaStepType.OVERLAP_B_F]
    assert ran == expected and ran, (r, ran, expected)
    assert results["custom"][0] == results["plain"][0], (r, results)
    for key, grad in results["plain"][1].items():
        np.testing.assert_array_equal(results["custom"][1][key], grad, err_msg=f"rank {r} gradient {key}")


@pytest.mark.parametrize("schedule_name,checkpoint", [("1f1b", False), ("interleaved", False), ("interleaved", True)])
def test_custom_overlap_step(run_on_ranks, schedule_name: str, checkpoint: bool) -> None:
    run_on_ranks(check_custom_overlap_step, schedule_name, checkpoint, world_size=4, timeout_s=300)
