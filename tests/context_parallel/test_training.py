"""A transformer block trained with context parallelism equals the single-process run
(loss and parameters after every SGD step), and ``AsyncContextParallel`` equals
``ContextParallel`` step by step.

Each rank holds a sequence shard of the inputs and targets; the loss is normalised by the
global token count, so the sum over ranks of the local parameter gradients (one
all-reduce) is the single-process gradient. float32: the sharded attention and the
summed gradients add in a different order, so values agree to ~1e-5 (5e-5 on MindSpore,
whose CPU ``exp`` is approximate), well below the ~1e-2 a wrong mask or offset causes.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import hyper_parallel as hp
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.platform import get_platform
from tests.context_parallel._models import block_weights, transformer_block

B, S, DIM, H, KV_HEADS, HEAD_DIM, HIDDEN = 2, 16, 16, 4, 2, 4, 24
DOCS = [0, 5, 12, 16]
LR = 0.2
CONFIGS = {  # name -> (style class, ulysses_degree, kv_exchange, load_balance, steps); 2 ranks
    "ring_load_balanced": (hp.ContextParallel, 1, "ring", True, 5),
    "ulysses": (hp.ContextParallel, 2, "allgather", False, 3),
    "async_ulysses": (hp.AsyncContextParallel, 2, "allgather", False, 3),
}


def _tol(p) -> dict:
    return dict(rtol=5e-5, atol=5e-5) if p.framework == "mindspore" else dict(rtol=2e-5, atol=2e-5)


def _train(p, model, x: np.ndarray, target: np.ndarray, steps: int, count: int, group=None) -> list:
    """SGD ``steps`` times on ``sum((model(x) - target)^2) / count``; returns per step
    ``(global loss, {name: parameter after the step})``. With ``group``, gradients and
    the loss are summed over it first."""
    history = []
    for _ in range(steps):
        named = list(p.named_parameters(model))

        def loss_fn(xt, tt):
            diff = model(xt) - tt
            return ((diff * diff).sum() / count).reshape(1)

        loss, backward = p.vjp(loss_fn, [p.from_numpy(x), p.from_numpy(target)], [param for _, param in named])
        _, grads = backward([p.from_numpy(np.ones(1, np.float32))])
        if group is not None:
            grads = [p.all_reduce(g, group=group).wait() for g in grads]
            loss = p.all_reduce(loss, group=group).wait()
        for (name, param), grad in zip(named, grads):
            p.set_parameter(model, name, p.make_parameter(p.detach(param) - grad * LR))
        history.append((float(p.to_numpy(loss)[0]), {n: p.to_numpy(t) for n, t in p.named_parameters(model)}))
    return history


def _assert_same_history(p, got: list, want: list, label: str) -> None:
    """Two ``_train`` histories agree step by step (loss and every parameter)."""
    for step, ((loss, params), (want_loss, want_params)) in enumerate(zip(got, want)):
        np.testing.assert_allclose(loss, want_loss, **_tol(p), err_msg=f"{label}: loss of step {step}")
        for pname, value in params.items():
            np.testing.assert_allclose(value, want_params[pname], **_tol(p), err_msg=f"{label}: {pname}")


def _sync_and_async(p, values: dict, mesh, x_local, t_local, steps: int, seen: list | None = None,
                    **style_kwargs) -> list:
    """``_train`` histories of the block under ``ContextParallel`` and under
    ``AsyncContextParallel`` (its projections hooked), both ``style_kwargs``; ``seen``
    collects the types of the q/k/v the attention's forward gets (a pre-hook registered
    after the style's)."""
    histories = []
    for style_cls in (hp.ContextParallel, hp.AsyncContextParallel):
        model = transformer_block(p, values, heads=H, head_dim=HEAD_DIM, cu_seqlens=DOCS)
        projections = (model.q_proj, model.k_proj, model.v_proj) if style_cls is hp.AsyncContextParallel else ()
        style_cls(**style_kwargs).apply(model.attn, mesh, *projections)
        if seen is not None:
            p.register_forward_pre_hook(model.attn, lambda m, args, kwargs: seen.append(
                (style_cls.__name__, [type(t).__name__ for t in args])), with_kwargs=True)
        histories.append(_train(p, model, x_local, t_local, steps, B * S * DIM, group=mesh.get_group()))
    return histories


def check_training() -> list[str]:
    p = get_platform()
    cp = p.world_size()
    mesh = init_device_mesh(p.device_type, (cp,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, S, DIM)).astype(np.float32)
    target = rng.standard_normal((B, S, DIM)).astype(np.float32)
    values = block_weights(DIM, H, KV_HEADS, HEAD_DIM, HIDDEN)
    count = B * S * DIM
    reference = _train(p, transformer_block(p, values, heads=H, head_dim=HEAD_DIM, cu_seqlens=DOCS), x, target, 5,
                       count)
    histories = {}
    for name, (style_cls, ud, exchange, lb, steps) in CONFIGS.items():
        model = transformer_block(p, values, heads=H, head_dim=HEAD_DIM, cu_seqlens=DOCS)
        style = style_cls(ulysses_degree=ud, kv_exchange=exchange, load_balance=lb)
        if style_cls is hp.AsyncContextParallel:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a silent fallback to the synchronous path would defeat the test
                style.apply(model.attn, mesh, model.q_proj, model.k_proj, model.v_proj)
        else:  # through a plan: ContextParallel composes with parallelize_module
            hp.parallelize_module(model, mesh, {"attn": style})
        x_local, t_local = (p.to_numpy(t) for t in hp.context_parallel_shard(
            [p.from_numpy(x), p.from_numpy(target)], [1, 1], mesh, load_balance=lb))
        histories[name] = _train(p, model, x_local, t_local, steps, count, group=mesh.get_group())
        for step, ((loss, params), (ref_loss, ref_params)) in enumerate(zip(histories[name], reference)):
            np.testing.assert_allclose(loss, ref_loss, **_tol(p), err_msg=f"{name}: loss of step {step}")
            for pname, value in params.items():
                np.testing.assert_allclose(value, ref_params[pname], **_tol(p),
                                           err_msg=f"{name}: {pname} after step {step}")
    _assert_same_history(p, histories["async_ulysses"], histories["ulysses"], "async vs sync")
    # Multi-query k/v (1 head < 2 ranks) take AsyncContextParallel's synchronous k/v path.
    mqa = block_weights(DIM, H, 1, HEAD_DIM, HIDDEN)
    x_local, t_local = (p.to_numpy(t) for t in hp.context_parallel_shard(
        [p.from_numpy(x), p.from_numpy(target)], [1, 1], mesh))
    sync, async_ = _sync_and_async(p, mqa, mesh, x_local, t_local, 1)
    _assert_same_history(p, async_, sync, "async vs sync MQA")
    return sorted(histories)


def test_training_matches_single_process(run_on_ranks) -> None:
    # 2 ranks: MindSpore pays seconds per training step at 4 (hybrid modes are swept in
    # test_context_parallel).
    assert run_on_ranks(check_training, world_size=2, timeout_s=600) == [sorted(CONFIGS)] * 2


def check_async_hybrid() -> None:
    """``AsyncContextParallel`` in hybrid mode (Ulysses 2 x ring 2 on 4 ranks), whose
    attention gets q/k/v as DTensors on the 2-D mesh ([Note: q/k/v as DTensors]), against
    ``ContextParallel``'s (checked against one process in ``test_context_parallel``): two
    SGD steps."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (p.world_size(),), mesh_dim_names=("cp",))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, S, DIM)).astype(np.float32)
    target = rng.standard_normal((B, S, DIM)).astype(np.float32)
    values = block_weights(DIM, H, KV_HEADS, HEAD_DIM, HIDDEN)
    x_local, t_local = (p.to_numpy(t) for t in hp.context_parallel_shard(
        [p.from_numpy(x), p.from_numpy(target)], [1, 1], mesh))
    seen: list = []
    sync, async_ = _sync_and_async(p, values, mesh, x_local, t_local, 2, seen, ulysses_degree=2, kv_exchange="ring")
    assert seen and all(names == ["DTensor"] * 3 for _, names in seen), seen
    _assert_same_history(p, async_, sync, "async vs sync hybrid")


def test_async_hybrid_matches_sync(run_on_ranks) -> None:
    run_on_ranks(check_async_hybrid, world_size=4, timeout_s=600)



#: handoff layout -> (seq_dim, head_dim) of q/k/v
HANDOFF_DIMS = {"BSHD": (1, 2), "SBND": (0, 2), "TND": (0, 1)}


def check_async_handoff(layout: str) -> None:
    """``AsyncContextParallel`` (Ulysses on 2 ranks) whose projections are identity "handoff"
    modules returning q/k/v in the attention's own layout (as MindFormers' multi-latent
    attention hands them on: sequence-first SBND / TND), against one process: two SGD steps
    (loss and every parameter), and ``ContextParallel`` on the same model alike."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (p.world_size(),), mesh_dim_names=("cp",))
    rng = np.random.default_rng(3)
    batch = 1 if layout == "TND" else B
    x = rng.standard_normal((batch, S, DIM)).astype(np.float32)
    target = rng.standard_normal((batch, S, DIM)).astype(np.float32)
    values = block_weights(DIM, H, KV_HEADS, HEAD_DIM, HIDDEN)
    count = batch * S * DIM
    reference = _train(p, transformer_block(p, values, heads=H, head_dim=HEAD_DIM, cu_seqlens=DOCS,
                                            handoff_layout=layout), x, target, 2, count)
    x_local, t_local = (p.to_numpy(t) for t in hp.context_parallel_shard(
        [p.from_numpy(x), p.from_numpy(target)], [1, 1], mesh))
    seq_dim, head_dim = HANDOFF_DIMS[layout]
    for style_cls in (hp.ContextParallel, hp.AsyncContextParallel):
        model = transformer_block(p, values, heads=H, head_dim=HEAD_DIM, cu_seqlens=DOCS, handoff_layout=layout)
        handoffs = (model.q_handoff, model.k_handoff, model.v_handoff) if style_cls is hp.AsyncContextParallel else ()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to the synchronous path would defeat the test
            style_cls(seq_dim=seq_dim, head_dim=head_dim).apply(model.attn, mesh, *handoffs)
        history = _train(p, model, x_local, t_local, 2, count, group=mesh.get_group())
        _assert_same_history(p, history, reference, f"{style_cls.__name__} {layout} handoffs")


@pytest.mark.parametrize("layout", sorted(HANDOFF_DIMS))
def test_async_handoff_layouts(run_on_ranks, layout) -> None:
    run_on_ranks(check_async_handoff, layout, world_size=2, timeout_s=600)
