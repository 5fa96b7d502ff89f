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
from hyper_parallel.core.pipeline_parallel import CommComputeOverlap
from hyper_parallel.platform import get_platform

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
    alone = p.split_group([[i] for i in range(n)])  # the one-rank reference layer
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


def check_pipeline_overlap_on_moe() -> None:
    """4 ranks: 2 pipelines of 2 ranks (interleaved, 4 MoE-block stages) whose stages'
    experts are sharded over the 2 pipelines. OVERLAP_B_F pairs run a forward and a
    backward on two threads meeting at the blocks' dispatch/combine hooks; losses and
    every gradient equal the same schedule without the overlap, exactly."""
    from hyper_parallel.core.pipeline_parallel import PipelineStage, ScheduleInterleaved1F1B
    from tests.pipeline_parallel._models import build_moe_block, mse

    p = get_platform()
    r = p.rank()
    pp = p.split_group([[0, 1], [2, 3]])
    ep = p.split_group([[0, 2], [1, 3]])
    pp_rank, ep_rank = p.rank(pp), p.rank(ep)
    rng = np.random.default_rng(30 + ep_rank)  # each pipeline its own batch
    x = p.from_numpy(rng.standard_normal((8, DIM)).astype(np.float32))
    y = p.from_numpy(rng.standard_normal((8, DIM)).astype(np.float32))
    results = {}
    for overlap_b_f in (False, True):
        overlap = CommComputeOverlap(timeout_s=120.0)
        stages = []
        for s in (pp_rank, pp_rank + 2):
            moe = MoE(4, 2, group=ep)
            w = np.random.default_rng(100 + s)
            weights = {"pre": (w.standard_normal((DIM, DIM)) / 2).astype(np.float32),
                       "router": w.standard_normal((4, DIM)).astype(np.float32)}
            experts = {f"{k}_{e}": (w.standard_normal(shape) / 2).astype(np.float32)
                       for e in range(4) for k, shape in (("w1", (DIM, HIDDEN)), ("w2", (HIDDEN, DIM)))}
            for l, e in enumerate(moe.expert_range):
                weights[f"w1_{l}"], weights[f"w2_{l}"] = experts[f"w1_{e}"], experts[f"w2_{e}"]
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
