"""Context parallelism against single-device attention: outputs and the gradients of q, k
and v, for every mode x causal x load balance x BSHD/BNSD x MHA/GQA/MQA x packed documents,
on cp = 2 and 4 (hybrid 2 x 2). The configurations are swept inside one rank function per
world size (MindSpore pays seconds per multi-rank call).

Tolerance: the reference is attention over the whole sequence in float64 numpy (outputs
and q/k/v gradients), and the inputs are float64: the platform's kernels compute float64
inputs in float64 end to end (softmax statistics, the log-sum-exp merge of partial results
and the gradient accumulators included), so every mode agrees with the reference to
float64 rounding of sums of O(1) values: 1e-10. A wrong mask or offset moves values by
~1e-1; float32 statistics would show as ~1e-7.
"""

from __future__ import annotations

import numpy as np
import pytest

import hyper_parallel as hp
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.platform import get_platform
from tests.context_parallel import _models
from tests.context_parallel._models import core_attention, keyword_attention

B, S, H, D = 2, 16, 4, 8
DOCS = [0, 3, 9, 16]  # documents crossing shard boundaries for cp = 2 and 4, with and without load balance
MODES = {  # name -> (ulysses_degree as a fraction of cp: None = all, kv_exchange)
    "ulysses": ("all", "allgather"), "allgather": (1, "allgather"), "ring": (1, "ring"),
    "hybrid_allgather": (2, "allgather"), "hybrid_ring": (2, "ring"),
}


def _tol(p) -> dict:
    return dict(rtol=1e-10, atol=1e-10)  # float64 end to end; see the module doc


def positions(seq: int, cp: int, rank: int, load_balance: bool) -> np.ndarray:
    """Test-side statement of the layout: chunk ``rank`` of ``cp``, or head-tail chunks
    ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""
    if not load_balance:
        return np.array_split(np.arange(seq), cp)[rank]
    chunks = np.array_split(np.arange(seq), 2 * cp)
    return np.concatenate([chunks[rank], chunks[2 * cp - 1 - rank]])


def reference_mask(seq: int, causal: bool, docs: list[int] | None) -> np.ndarray:
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = (j <= i) if causal else np.ones((seq, seq), bool)
    if docs is not None:
        doc = np.repeat(np.arange(len(docs) - 1), np.diff(docs))
        allowed = allowed & (doc[i] == doc[j])
    return allowed


#: (causal, load_balance, packed documents): every pair of the three, and all three
#: together, per mode (the full product costs MindSpore minutes; see the module doc).
COMBOS = ((False, False, False), (True, False, False), (True, True, True), (False, True, True), (True, True, False))
ULYSSES_COMBOS = ((False, False, True), (True, False, False), (True, False, True))


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, allowed: np.ndarray) -> list:
    """Single-device attention and its q/k/v gradients in float64 numpy (BSHD, GQA by
    ``h // (heads / kv_heads)``): ``[out, dq, dk, dv]``."""
    q, k, v, dout = (a.astype(np.float64).transpose(0, 2, 1, 3) for a in (q, k, v, dout))  # [B, H, S, D]
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = q.shape[-1] ** -0.5
    scores = np.where(allowed, q @ kr.transpose(0, 1, 3, 2) * scale, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = probs @ vr
    dv = probs.transpose(0, 1, 3, 2) @ dout
    dp = dout @ vr.transpose(0, 1, 3, 2)
    ds = probs * (dp - (dout * out).sum(-1, keepdims=True))
    dq, dk = ds @ kr * scale, ds.transpose(0, 1, 3, 2) @ q * scale

    def fold(g: np.ndarray) -> np.ndarray:  # sum the gradients of the query heads sharing a kv head
        return g.reshape(g.shape[0], -1, group, *g.shape[2:]).sum(2)

    return [a.transpose(0, 2, 1, 3) for a in (out, dq, fold(dk), fold(dv))]


def cases(cp: int) -> list[tuple]:
    """(mode, causal, load_balance, docs, layout, kv_heads): layouts alternate and head
    counts cycle MHA/GQA/MQA so every mode meets each."""
    out = []
    for mode in MODES:
        if mode.startswith("hybrid") and cp < 4:
            continue
        for causal, lb, docs in ULYSSES_COMBOS if mode == "ulysses" else COMBOS:
            i = len(out)
            out.append((mode, causal, lb, docs, ("BSHD", "BNSD")[i % 2], (H, 2, 1)[i % 3]))
    return out


def _vjp_many(p, fns: list, inputs: list[list]) -> tuple[list, list]:
    """Run every ``fns[i](*inputs[i])`` inside one ``vjp`` and return (outputs, backward)."""
    flat = [t for group in inputs for t in group]

    def run(*args):
        outs, at = [], 0
        for fn, group in zip(fns, inputs):
            outs.append(fn(*args[at:at + len(group)]))
            at += len(group)
        return tuple(outs)

    return p.vjp(run, flat)


def check_modes(only: tuple[str, ...] = ()) -> int:
    """Every case of ``cases(world)`` (of the modes in ``only``, when given): forward,
    unshard and q/k/v gradients vs the float64 reference. The cases of a mode share one
    ``vjp``: MindSpore pays ~0.5 s per ``vjp``. No framework work runs between the
    collectives of one call but the cases' own, so a slow reference on one rank does not
    hold its peers inside a collective."""
    p = get_platform()
    cp, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (cp,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(7)
    todo = [c for c in cases(cp) if not only or c[0] in only]
    labels, refs, modules, cp_inputs, cp_douts, checks = [], [], [], [], [], []
    for mode, causal, lb, docs, layout, kv_heads in todo:
        label = f"{mode} causal={causal} load_balance={lb} docs={docs} {layout} kv_heads={kv_heads} cp={cp}"
        cu = DOCS if docs else None
        q = rng.standard_normal((B, S, H, D))
        k = rng.standard_normal((B, S, kv_heads, D))
        v = rng.standard_normal((B, S, kv_heads, D))
        dout = rng.standard_normal((B, S, H, D))
        refs.append(reference(q, k, v, dout, reference_mask(S, causal, cu)))

        seq_dim, head_dim = (1, 2) if layout == "BSHD" else (2, 1)
        lay = (lambda a: a) if layout == "BSHD" else (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
        ud_frac, exchange = MODES[mode]
        ud = cp if ud_frac == "all" else ud_frac
        style = hp.ContextParallel(seq_dim=seq_dim, head_dim=head_dim, ulysses_degree=ud, kv_exchange=exchange,
                                   load_balance=lb)
        modules.append(style.apply(core_attention(p, causal=causal, cu_seqlens=cu, layout=layout), mesh))
        full = [p.from_numpy(lay(a)) for a in (q, k, v, dout)]
        shards = hp.context_parallel_shard(full, [seq_dim] * 4, mesh, load_balance=lb)
        pos = positions(S, cp, r, lb)
        for got, want in zip(shards, (q, k, v, dout)):
            np.testing.assert_array_equal(p.to_numpy(got), lay(want[:, pos]), err_msg=f"shard: {label}")
        cp_inputs.append([p.from_numpy(p.to_numpy(t)) for t in shards[:3]])
        cp_douts.append(shards[3])
        labels.append(label)
        checks.append((seq_dim, lay, pos, lb))

    # One vjp per mode: a single vjp over every case of the world-4 sweep made MindSpore's
    # CPU all-gather fail ("CollectiveWait failed") where per-mode batches pass.
    for mode in dict.fromkeys(c[0] for c in todo):
        idx = [i for i, c in enumerate(todo) if c[0] == mode]
        cp_outs, cp_back = _vjp_many(p, [modules[i] for i in idx], [cp_inputs[i] for i in idx])
        cp_grads, _ = cp_back([cp_douts[i] for i in idx])
        for j, i in enumerate(idx):
            label, (seq_dim, lay, pos, lb) = labels[i], checks[i]
            ref = refs[i]
            got = [cp_outs[j], *cp_grads[3 * j:3 * j + 3]]
            for name, value, want in zip(("out", "dq", "dk", "dv"), got, ref):
                np.testing.assert_allclose(p.to_numpy(value), lay(want[:, pos]), **_tol(p),
                                           err_msg=f"{name}: {label}")
            gathered, = hp.context_parallel_unshard([cp_outs[j]], [seq_dim], mesh, load_balance=lb)
            np.testing.assert_allclose(p.to_numpy(gathered), lay(ref[0]), **_tol(p), err_msg=f"unshard: {label}")
    return len(todo)


# world 4 in two calls: a call holds its cases' graphs, and MindSpore on a busy 2-core
# host needs minutes for all of them (the timeout still catches a hang).
@pytest.mark.parametrize("world_size, only", [(2, ()), (4, ("ulysses", "allgather", "ring")),
                                              (4, ("hybrid_allgather", "hybrid_ring"))])
def test_modes_match_single_device(run_on_ranks, world_size: int, only: tuple[str, ...]) -> None:
    expected = len([c for c in cases(world_size) if not only or c[0] in only])
    assert run_on_ranks(check_modes, only, world_size=world_size, timeout_s=600) == [expected] * world_size


def check_keywords() -> int:
    """q/k/v passed by keyword (all three, or k/v only with q positional) and ``cu_seqlens``
    as a keyword of the module call, in each mode of a 1-D mesh: output and q/k/v
    gradients vs the float64 reference."""
    p = get_platform()
    cp, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (cp,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(11)
    calls = {  # qkv_kwarg_names -> how the module is called
        ("query", "key", "value"): lambda m, q, k, v: m(query=q, key=k, value=v, cu_seqlens=DOCS),
        (None, "key", "value"): lambda m, q, k, v: m(q, key=k, value=v, cu_seqlens=DOCS),
    }
    count = 0
    for mode in ("ulysses", "allgather", "ring"):
        for names, call in calls.items():
            ud_frac, exchange = MODES[mode]
            lb = mode == "ring"
            style = hp.ContextParallel(ulysses_degree=cp if ud_frac == "all" else ud_frac, kv_exchange=exchange,
                                       qkv_kwarg_names=names, load_balance=lb)
            module = style.apply(keyword_attention(p, causal=True), mesh)
            q, k, v, dout = (rng.standard_normal((B, S, h, D)) for h in (H, 2, 2, H))
            ref = reference(q, k, v, dout, reference_mask(S, True, DOCS))
            shards = hp.context_parallel_shard([p.from_numpy(a) for a in (q, k, v, dout)], [1] * 4, mesh,
                                               load_balance=lb)
            out, back = p.vjp(lambda q_, k_, v_: call(module, q_, k_, v_), shards[:3])
            grads, _ = back([shards[3]])
            pos = positions(S, cp, r, lb)
            for name, value, want in zip(("out", "dq", "dk", "dv"), [out, *grads], ref):
                np.testing.assert_allclose(p.to_numpy(value), want[:, pos], **_tol(p),
                                           err_msg=f"{name}: {mode} qkv_kwarg_names={names}")
            count += 1
    return count


def test_keyword_arguments(run_on_ranks) -> None:
    assert run_on_ranks(check_keywords, world_size=2, timeout_s=300) == [6, 6]


def _saved_bytes(p, ctx) -> int:
    """Bytes of every tensor a custom function's ``ctx`` keeps (attributes and tuples)."""
    total = 0
    for value in vars(ctx).values():
        for item in value if isinstance(value, tuple) else (value,):
            if p.is_tensor(item):
                total += p.to_numpy(item).nbytes
    return total


def check_ring_saved_state(exchange: str) -> list[int]:
    """Ring attention, and all-gather attention (the same function with gathered blocks,
    [Note: all-gather as a ring source]), keep for backward this rank's q, k, v, output
    and float32 lse, and nothing else of tensor size: the bytes kept halve from cp = 2 to
    cp = 4 for one global sequence (keeping the K/V blocks of other ranks would keep them
    constant)."""
    from types import SimpleNamespace

    from hyper_parallel.core.context_parallel.ring import RingAttention, RingSpec

    p = get_platform()
    seq, kv_heads = 32, 2
    rng = np.random.default_rng(5)
    world = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("dp", "cp"))
    measured = []
    for mesh in (world["cp"], init_device_mesh(p.device_type, (4,), mesh_dim_names=("cp",))):
        cp = mesh.size()
        plan = hp.ContextParallel(ulysses_degree=1, kv_exchange=exchange, load_balance=True).resolve(mesh)
        q = p.from_numpy(rng.standard_normal((B, seq // cp, H, D)).astype(np.float32))
        k, v = (p.from_numpy(rng.standard_normal((B, seq // cp, kv_heads, D)).astype(np.float32)) for _ in "kv")
        ctx = SimpleNamespace()
        with p.no_grad():
            out = RingAttention.forward(ctx, p, q, k, v, RingSpec(plan, seq, True, None, None))
        expected = sum(p.to_numpy(t).nbytes for t in (q, k, v, out)) + B * H * (seq // cp) * 4  # lse: float32
        assert _saved_bytes(p, ctx) == expected, (cp, _saved_bytes(p, ctx), expected)
        measured.append(_saved_bytes(p, ctx))
    assert measured[0] == 2 * measured[1], measured
    return measured


@pytest.mark.parametrize("exchange", ["ring", "allgather"])
def test_ring_saves_only_local_blocks(run_on_ranks, exchange: str) -> None:
    per_rank = (B * 16 * (2 * H + 2 * 2) * D + B * H * 16) * 4  # cp = 2: q, out, k, v, lse of 16 positions
    assert run_on_ranks(check_ring_saved_state, exchange, world_size=4) == [[per_rank, per_rank // 2]] * 4


def check_bsh() -> int:
    """3-D BSH q/k/v (MindFormers' colossal layout) with ``ulysses_degree=1``: all-gather
    and ring K/V exchange, causal, with and without load balance, against the float64
    reference; Ulysses on 3-D inputs is refused before any collective."""
    p = get_platform()
    cp, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (cp,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(5)
    count = 0
    for exchange in ("allgather", "ring"):
        for lb in (False, True):
            style = hp.ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1, kv_exchange=exchange,
                                       load_balance=lb)
            module = style.apply(_models.bsh_attention(p, heads=H, causal=True), mesh)
            q, k, v, dout = (rng.standard_normal((B, S, H, D)) for _ in range(4))
            ref = reference(q, k, v, dout, reference_mask(S, True, None))
            shards = hp.context_parallel_shard([p.from_numpy(a.reshape(B, S, H * D)) for a in (q, k, v, dout)],
                                               [1] * 4, mesh, load_balance=lb)
            out, back = p.vjp(module, shards[:3])
            grads, _ = back([shards[3]])
            pos = positions(S, cp, r, lb)
            for name, value, want in zip(("out", "dq", "dk", "dv"), [out, *grads], ref):
                np.testing.assert_allclose(p.to_numpy(value), want[:, pos].reshape(B, len(pos), H * D), **_tol(p),
                                           err_msg=f"{name}: BSH {exchange} load_balance={lb}")
            count += 1
    ulysses = hp.ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=cp).apply(
        _models.bsh_attention(p, heads=H, causal=True), mesh)
    x = p.from_numpy(np.zeros((B, S // cp, H * D)))
    with pytest.raises(ValueError, match="3-D q/k/v .* need ulysses_degree=1"):
        ulysses(x, x, x)
    return count


def test_bsh_qkv(run_on_ranks) -> None:
    assert run_on_ranks(check_bsh, world_size=2, timeout_s=300) == [4, 4]


def check_tnd() -> int:
    """3-D TND q/k/v (``[tokens, heads, head_dim]``, MindFormers' packed-document layout:
    ``seq_dim=0, head_dim=1``) with packed documents, causal, in every mode (Ulysses,
    all-gather, ring; hybrid on 4 ranks) against the float64 reference."""
    p = get_platform()
    cp, r = p.world_size(), p.rank()
    mesh = init_device_mesh(p.device_type, (cp,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(6)
    count = 0
    modes = [(cp, "allgather"), (1, "allgather"), (1, "ring")] + ([(2, "ring")] if cp == 4 else [])
    for ulysses, exchange in modes:
        style = hp.ContextParallel(seq_dim=0, head_dim=1, ulysses_degree=ulysses, kv_exchange=exchange)
        module = style.apply(_models.tnd_attention(p, causal=True, cu_seqlens=DOCS), mesh)
        q, k, v, dout = (rng.standard_normal((1, S, H, D)) for _ in range(4))
        ref = reference(q, k, v, dout, reference_mask(S, True, DOCS))
        shards = hp.context_parallel_shard([p.from_numpy(a[0]) for a in (q, k, v, dout)], [0] * 4, mesh)
        out, back = p.vjp(module, shards[:3])
        grads, _ = back([shards[3]])
        pos = positions(S, cp, r, False)
        for name, value, want in zip(("out", "dq", "dk", "dv"), [out, *grads], ref):
            np.testing.assert_allclose(p.to_numpy(value), want[0, pos], **_tol(p),
                                       err_msg=f"{name}: TND ulysses={ulysses} {exchange}")
        count += 1
    return count


@pytest.mark.parametrize("world", [2, 4])
def test_tnd_qkv(run_on_ranks, world) -> None:
    assert run_on_ranks(check_tnd, world_size=world, timeout_s=300) == [3 + (world == 4)] * world


def check_tensor_parallel_heads() -> int:
    """[Note: context parallelism over tensor-parallel heads]: 4 ranks, (tp 2, cp 2). q/k/v
    reach the ContextParallel module as DTensors on the tp mesh with their heads sharded
    (``Shard(2)``, as MindFormers' tensor parallelism hands its core attention this rank's
    sequence piece); each tp rank runs context parallelism on its own heads and the output
    comes back a DTensor on the tp mesh placed like q. Output and q/k/v gradients against
    the float64 reference, every mode a cp of 2 has, causal, with and without load balance,
    MHA and GQA; inconsistent placements are refused."""
    from hyper_parallel import DTensor, Replicate, Shard

    p = get_platform()
    r = p.rank()
    mesh = init_device_mesh(p.device_type, (2, 2), mesh_dim_names=("tp", "cp"))
    tp_mesh, cp_mesh = mesh["tp"], mesh["cp"]
    tp, cp = tp_mesh.get_local_rank(), cp_mesh.get_local_rank()
    rng = np.random.default_rng(11)
    count = 0
    for mode, lb, kv_heads in (("allgather", False, H), ("ring", True, 2), ("ulysses", False, H)):
        ud_frac, exchange = MODES[mode]
        style = hp.ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=2 if ud_frac == "all" else ud_frac,
                                   kv_exchange=exchange, load_balance=lb)
        module = style.apply(core_attention(p, causal=True), cp_mesh)
        q = rng.standard_normal((B, S, H, D))
        k, v = (rng.standard_normal((B, S, kv_heads, D)) for _ in range(2))
        dout = rng.standard_normal((B, S, H, D))
        ref = reference(q, k, v, dout, reference_mask(S, True, None))
        pos = positions(S, 2, cp, lb)

        def mine(a: np.ndarray) -> np.ndarray:  # this rank's sequence piece and heads
            heads = a.shape[2] // 2
            return np.ascontiguousarray(a[:, pos, tp * heads:(tp + 1) * heads])

        def fn(*pieces):
            qkv = [DTensor.from_local(t, tp_mesh, (Shard(2),)) for t in pieces]
            out = module(*qkv)
            assert isinstance(out, DTensor) and out.device_mesh == tp_mesh and tuple(out.placements) == (Shard(2),)
            assert tuple(out.shape) == (B, len(pos), H, D), out.shape
            return out.to_local()

        out, back = p.vjp(fn, [p.from_numpy(mine(a)) for a in (q, k, v)])
        grads, _ = back([p.from_numpy(mine(dout))])
        for name, value, want in zip(("out", "dq", "dk", "dv"), [out, *grads], ref):
            np.testing.assert_allclose(p.to_numpy(value), mine(want), **_tol(p),
                                       err_msg=f"{name}: {mode} load_balance={lb} kv_heads={kv_heads} rank {r}")
        count += 1
    x = p.from_numpy(np.zeros((B, S // 2, H // 2, D)))
    sharded, replicated = DTensor.from_local(x, tp_mesh, (Shard(2),)), DTensor.from_local(x, tp_mesh, (Replicate(),))
    module = hp.ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1).apply(core_attention(p, causal=True), cp_mesh)
    with pytest.raises(NotImplementedError, match="their meshes or placements differ"):
        module(sharded, sharded, replicated)
    with pytest.raises(NotImplementedError, match="some of q, k, v are DTensors and some plain tensors"):
        module(sharded, x, x)
    with pytest.raises(NotImplementedError, match="the sequence dim 1 is sharded already"):
        seq_sharded = DTensor.from_local(x, tp_mesh, (Shard(1),))
        module(seq_sharded, seq_sharded, seq_sharded)
    return count


def test_tensor_parallel_heads(run_on_ranks) -> None:
    assert run_on_ranks(check_tensor_parallel_heads, world_size=4, timeout_s=600) == [3] * 4
