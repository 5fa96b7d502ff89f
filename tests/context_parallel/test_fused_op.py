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
from hyper_parallel.core.context_parallel.sharded_qkv import FUSED_LAYOUTS, attention_on_dtensors
from hyper_parallel.core.dtensor import init_device_mesh
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
    ``head_num`` that does not divide BSH's hidden size."""
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
    return messages


def test_fused_op_refusals(run_on_ranks) -> None:
    for messages in run_on_ranks(check_refusals, world_size=2, timeout_s=300):
        assert len(messages) == 4
