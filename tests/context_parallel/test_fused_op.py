"""A fused attention op called on the q/k/v DTensors a ``ContextParallel`` module receives
([Note: q/k/v as DTensors] in ``core/context_parallel/sharded_qkv``): the module hands them
to ``attention_on_dtensors``, as a backend's translation of its fused op does (MindSpore's
``FlashAttentionScore``: ``tests/mindformers/test_gptmodel_cp.py`` runs MindFormers' own
``FlashAttention`` cell through it). Every fused-kernel layout (BSH, SBH, BNSD, BSND, TND)
x all-gather / ring (hybrid for the layouts with a head dim on 4 ranks) x causal / packed
documents / none, against the float64 reference of ``test_context_parallel`` (tolerance
there: float64 end to end, 1e-10); and what is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

import hyper_parallel as hp
from hyper_parallel.core.context_parallel.fused_attention import (attention_on_dtensors, attention_on_local_shards,
                                                                  independent_shards_problem)
from hyper_parallel.core.context_parallel.sharded_qkv import FUSED_LAYOUTS
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.dtensor.layout import Layout
from hyper_parallel.platform import get_platform
from tests.context_parallel import _models
from tests.context_parallel.test_context_parallel import DOCS, D, H, S, _tol, positions, reference, reference_mask

B = 2


def to_layout(a: np.ndarray, layout: str) -> np.ndarray:
    """A BSHD array in ``layout`` (TND: batch 1, dropped)."""
    if layout in ("BSH", "SBH"):
        a = a.reshape(*a.shape[:2], -1)
        return a if layout == "BSH" else a.transpose(1, 0, 2)
    if layout == "BNSD":
        return a.transpose(0, 2, 1, 3)
    return a[0] if layout == "TND" else a


def fused_module(p, layout: str, causal: bool, cu_seqlens, seen: list):
    """A core-attention module whose forward is one fused op on its q/k/v in ``layout``
    (``attention_on_dtensors``, standing in for a backend's translation); ``seen`` collects
    whether each call got DTensors."""

    def forward(q, k, v):
        seen.append(all(isinstance(t, hp.DTensor) for t in (q, k, v)))
        return attention_on_dtensors(q, k, v, layout=layout, head_num=H, is_causal=causal, scale=None,
                                     cu_seqlens=cu_seqlens, op="test fused op")

    return _models._qkv_module(p, forward, "FusedOpAttention")


def check_layouts() -> int:
    p = get_platform()
    cp, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (cp,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(11)
    count = 0
    for i, layout in enumerate(FUSED_LAYOUTS):
        _, seq_dim, head_dim = FUSED_LAYOUTS[layout]
        modes = [(1, "allgather"), (1, "ring")]
        if head_dim is not None and cp == 4:
            modes.append((2, "ring"))
        for j, (ulysses, exchange) in enumerate(modes):
            causal = (i + j) % 3 != 2
            docs = DOCS if layout == "TND" or (i + j) % 2 else None
            lb = docs is None and causal and exchange == "ring"
            kv_heads = (H, 2)[(i + j) % 2] if layout != "TND" or ulysses == 1 else H
            batch = 1 if layout == "TND" else B
            q = rng.standard_normal((batch, S, H, D))
            k, v = (rng.standard_normal((batch, S, kv_heads, D)) for _ in range(2))
            dout = rng.standard_normal((batch, S, H, D))
            ref = reference(q, k, v, dout, reference_mask(S, causal, docs))
            seen: list = []
            style = hp.ContextParallel(seq_dim=seq_dim, head_dim=head_dim if head_dim is not None else 2,
                                       ulysses_degree=ulysses, kv_exchange=exchange, load_balance=lb)
            module = style.apply(fused_module(p, layout, causal, docs, seen), mesh)
            shards = hp.context_parallel_shard([p.from_numpy(to_layout(a, layout)) for a in (q, k, v, dout)],
                                               [seq_dim] * 4, mesh, load_balance=lb)
            out, back = p.vjp(module, shards[:3])
            grads, _ = back([shards[3]])
            assert seen == [True], seen
            assert not isinstance(out, hp.DTensor), "the post-hook hands back this rank's piece"
            pos = positions(S, cp, r, lb)
            label = f"{layout} ulysses={ulysses} {exchange} causal={causal} docs={docs} lb={lb} kv_heads={kv_heads}"
            for name, value, want in zip(("out", "dq", "dk", "dv"), [out, *grads], ref):
                np.testing.assert_allclose(p.to_numpy(value), to_layout(want[:, pos], layout), **_tol(p),
                                           err_msg=f"{name}: {label}")
            count += 1
    return count


@pytest.mark.parametrize("world", [2, 4])
def test_fused_op_layouts_match_single_device(run_on_ranks, world) -> None:
    assert run_on_ranks(check_layouts, world_size=world, timeout_s=400) == [10 + 3 * (world == 4)] * world


def check_refusals() -> list[str]:
    """Outside a ContextParallel module; plain tensors inside one; an unknown layout; a
    ``head_num`` that does not divide BSH's hidden size; q/k/v handed to the module as
    DTensors already."""
    p = get_platform()
    cp = p.world_size()
    mesh = init_device_mesh(p.device_type, (cp,), mesh_dim_names=("cp",))
    x = p.from_numpy(np.zeros((B, S // cp, H * D)))
    messages = []
    with pytest.raises(ValueError, match="only inside a module under ContextParallel") as e:
        attention_on_dtensors(x, x, x, layout="BSH", head_num=H, is_causal=True, scale=None)
    messages.append(str(e.value))

    def plain(q, k, v):
        return attention_on_dtensors(q.to_local(), k.to_local(), v.to_local(), layout="BSH", head_num=H,
                                     is_causal=True, scale=None)

    def bad_layout(q, k, v):
        return attention_on_dtensors(q, k, v, layout="BHSD", head_num=H, is_causal=True, scale=None)

    def bad_heads(q, k, v):
        return attention_on_dtensors(q, k, v, layout="BSH", head_num=3, is_causal=True, scale=None)

    for forward, pattern in ((plain, "must be the DTensors"), (bad_layout, "input layout 'BHSD'"),
                             (bad_heads, "head_num=3 does not divide")):
        module = hp.ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1).apply(
            _models._qkv_module(p, forward, "Refused"), mesh)
        with pytest.raises(ValueError, match=pattern) as e:
            module(x, x, x)
        messages.append(str(e.value))
    # q/k/v that are DTensors on the context-parallel mesh itself: refused in the pre-hook
    module = hp.ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1).apply(
        _models._qkv_module(p, lambda q, k, v: q, "Refused"), mesh)
    heads = hp.DTensor.from_local(x, mesh, [hp.Shard(2)])
    with pytest.raises(NotImplementedError, match="arrive as DTensors .* on the context-parallel mesh itself") as e:
        module(heads, heads, heads)
    messages.append(str(e.value))
    return messages


def test_fused_op_refusals(run_on_ranks) -> None:
    for messages in run_on_ranks(check_refusals, world_size=2, timeout_s=300):
        assert len(messages) == 5


def _local_piece(a: np.ndarray, mesh, placements) -> np.ndarray:
    """This rank's piece of ``a`` under ``placements`` (``Layout.slice_area``)."""
    area = Layout.of(mesh, placements, a.shape).slice_area(get_platform().rank())
    return a[tuple(slice(b, e) for b, e in area)]


def check_local_shards() -> int:
    """``attention_on_local_shards`` (a fused op on batch- and head-sharded DTensors, tensor
    parallelism's q/k/v): every layout, sharded by batch, by heads (merged ``H`` for BSH /
    SBH), by both on a 2-D mesh (4 ranks), GQA, causal / documents, against the float64
    reference on this rank's rows and heads; the gradient of each local piece is this rank's
    piece of the reference's."""
    p = get_platform()
    world = p.world_size()
    mesh = init_device_mesh(p.device_type, (2, world // 2) if world == 4 else (world,),
                            mesh_dim_names=("a", "b") if world == 4 else ("a",))
    rng = np.random.default_rng(12)
    count = 0
    for i, layout in enumerate(FUSED_LAYOUTS):
        batch_dim, _, heads = FUSED_LAYOUTS[layout]
        head_dim = 2 if heads is None else heads
        shardings = [(hp.Shard(head_dim),)] + ([] if batch_dim is None else [(hp.Shard(batch_dim),)])
        if world == 4:
            shardings = [(hp.Shard(head_dim), hp.Replicate())] + (
                [] if batch_dim is None else [(hp.Shard(batch_dim), hp.Shard(head_dim))])
        for j, placements in enumerate(shardings):
            causal = (i + j) % 2 == 0
            docs = DOCS if layout == "TND" else None
            kv_heads = (H, 2)[(i + j) % 2] if world == 2 or j == 0 else H
            batch = 1 if layout == "TND" else B * 2
            q = rng.standard_normal((batch, S, H, D))
            k, v = (rng.standard_normal((batch, S, kv_heads, D)) for _ in range(2))
            dout = rng.standard_normal((batch, S, H, D))
            ref = [to_layout(a, layout) for a in reference(q, k, v, dout, reference_mask(S, causal, docs))]
            full = [to_layout(a, layout) for a in (q, k, v, dout)]
            pieces = [p.from_numpy(np.ascontiguousarray(_local_piece(a, mesh, placements))) for a in full]

            def attend(ql, kl, vl):
                dts = [hp.DTensor.from_local(t, mesh, placements, shape=a.shape) for t, a in zip((ql, kl, vl), full)]
                out = attention_on_local_shards(*dts, layout=layout, head_num=H, is_causal=causal, scale=None,
                                                cu_seqlens=docs, op="test")
                assert tuple(out.shape) == ref[0].shape and tuple(out.placements) == tuple(placements)
                return out.to_local()

            out, back = p.vjp(attend, pieces[:3])
            grads, _ = back([pieces[3]])
            label = f"{layout} {placements} causal={causal} kv_heads={kv_heads}"
            for name, value, want in zip(("out", "dq", "dk", "dv"), [out, *grads], ref):
                np.testing.assert_allclose(p.to_numpy(value), _local_piece(want, mesh, placements), **_tol(p),
                                           err_msg=f"{name}: {label}")
            count += 1
    # what each rank cannot do alone: a sharded sequence; heads that do not split evenly
    x = hp.DTensor.from_local(p.from_numpy(np.zeros((B, S // world, H, D))), mesh,
                              (hp.Shard(1),) + (hp.Replicate(),) * (mesh.ndim - 1))
    assert "neither its batch nor its head dim" in independent_shards_problem(x, x, x, "BSND", H)
    kv = hp.DTensor.from_local(p.from_numpy(np.zeros((B, S, 1, D))), mesh,
                               (hp.Shard(2),) + (hp.Replicate(),) * (mesh.ndim - 1), shape=(B, S, mesh.size(0), D))
    q = hp.DTensor.from_local(p.from_numpy(np.zeros((B, S, H // mesh.size(0), D))), mesh,
                              (hp.Shard(2),) + (hp.Replicate(),) * (mesh.ndim - 1))
    assert independent_shards_problem(q, kv, kv, "BSND", H) is None
    with pytest.raises(ValueError, match="placements differ"):
        attention_on_local_shards(q, x, x, layout="BSND", head_num=H, is_causal=True, scale=None)
    return count


@pytest.mark.parametrize("world", [2, 4])
def test_local_shards_match_single_device(run_on_ranks, world) -> None:
    assert run_on_ranks(check_local_shards, world_size=world, timeout_s=400) == [9] * world
