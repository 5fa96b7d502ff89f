"""A Llama-style block computed on DTensors equals the single-process block: token
embedding, RMSNorm, causal multi-head attention written out (q/k/v/o projections,
scores, softmax), SwiGLU MLP, output projection and cross-entropy loss; the loss, every
parameter gradient and one AdamW step (torch.optim.AdamW; MindSpore's AdamWeightDecay)
on the DTensor parameters.

The same model function runs on framework tensors (the reference) and on DTensors:
every op goes through ``hyper_parallel.core.dtensor.functional`` or the DTensor
operators. Parameters are framework parameters holding this rank's shard; the model
sees each as ``DTensor.from_local(param, mesh, placements, shape=global)`` (the
documented parameter mechanism), so the optimizer steps the framework parameter.

Layouts: tensor parallel over the whole mesh (q/k/v, w1/w3 and the output projection
column-wise, o and w2 row-wise; hidden 10 and vocab 11 leave uneven shards over 4), and
on a 2x2 mesh data parallel (batch sharded) x tensor parallel. Float32 data; the
tolerance allows the different summation orders of the sharded matmuls and reductions.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from hyper_parallel.core.dtensor import functional as F
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import expected_local
from tests.tensor_parallel._models import optimizer_step

DIM, HEADS, HEAD_DIM, HIDDEN, VOCAB, BATCH, SEQ = 6, 4, 3, 10, 11, 2, 5
TOL = {"rtol": 2e-4, "atol": 2e-5}

#: tensor-parallel placement of each parameter (the other mesh axis, if any, replicates)
TP_PLACEMENTS = {
    "embed": Replicate(), "attn_norm": Replicate(), "wq": Shard(0), "wk": Shard(0), "wv": Shard(0), "wo": Shard(1),
    "mlp_norm": Replicate(), "w1": Shard(0), "w3": Shard(0), "w2": Shard(1), "final_norm": Replicate(),
    "out": Shard(0),
}


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(21)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    return {
        "embed": w(VOCAB, DIM), "attn_norm": 1 + 0.1 * w(DIM), "wq": w(HEADS * HEAD_DIM, DIM),
        "wk": w(HEADS * HEAD_DIM, DIM), "wv": w(HEADS * HEAD_DIM, DIM), "wo": w(DIM, HEADS * HEAD_DIM),
        "mlp_norm": 1 + 0.1 * w(DIM), "w1": w(HIDDEN, DIM), "w3": w(HIDDEN, DIM), "w2": w(DIM, HIDDEN),
        "final_norm": 1 + 0.1 * w(DIM), "out": w(VOCAB, DIM),
    }


def rms_norm(x, weight, eps: float = 1e-5):
    return x * F.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def block(params: dict, ids, target, mask, trace: dict | None = None):
    """ids, target: int64 [batch, seq]; mask: additive causal mask [seq, seq]; ``trace``
    collects intermediate results by name."""
    trace = {} if trace is None else trace
    b, s = ids.shape
    x = F.embedding(ids, params["embed"])  # [b, s, dim]
    h = rms_norm(x, params["attn_norm"])

    def heads(w):
        return F.linear(h, w).reshape(b, s, HEADS, HEAD_DIM).transpose(1, 2)  # [b, heads, s, head_dim]

    q, k, v = heads(params["wq"]), heads(params["wk"]), heads(params["wv"])
    scores = (q @ k.transpose(2, 3)) * (HEAD_DIM ** -0.5) + mask
    attn = (F.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM)
    trace.update(q=q, scores=scores, attn=attn, attn_out=F.linear(attn, params["wo"]))
    x = x + trace["attn_out"]
    h = rms_norm(x, params["mlp_norm"])
    x = x + F.linear(F.silu(F.linear(h, params["w1"])) * F.linear(h, params["w3"]), params["w2"])
    logits = F.linear(rms_norm(x, params["final_norm"]), params["out"])  # [b, s, vocab]
    return F.cross_entropy(logits.reshape(b * s, VOCAB), target.reshape(b * s))


def check_llama_block(meshes: list[tuple[tuple[int, ...], tuple[str, ...]]]) -> None:
    p = get_platform()
    values = weights()
    rng = np.random.default_rng(4)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)
    target = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)
    mask = np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1)

    names = sorted(values)
    ref_params = [p.make_parameter(p.from_numpy(values[name])) for name in names]

    def ref_fn():
        return block(dict(zip(names, ref_params)), p.from_numpy(ids), p.from_numpy(target), p.from_numpy(mask))

    ref_loss, ref_backward = p.vjp(ref_fn, [], ref_params)
    _, ref_grads = ref_backward([p.full((), 1.0, p.dtype("float32"))])
    ref_grads = [p.to_numpy(g) for g in ref_grads]
    optimizer_step(p, ref_params, tuple(p.from_numpy(g) for g in ref_grads))
    ref_stepped = {name: p.to_numpy(param) for name, param in zip(names, ref_params)}

    for mesh_shape, axis_names in meshes:
        mesh = init_device_mesh(p.device_type, mesh_shape, mesh_dim_names=axis_names)
        coordinate = mesh.get_coordinate()
        data_axis = axis_names.index("dp") if "dp" in axis_names else None

        def placements(name: str) -> tuple:
            return tuple(TP_PLACEMENTS[name] if axis == "tp" else Replicate() for axis in axis_names)

        batch = tuple(Shard(0) if axis == "dp" else Replicate() for axis in axis_names)
        replicated = (Replicate(),) * mesh.ndim
        params = [p.make_parameter(p.from_numpy(expected_local(values[name], placements(name), mesh_shape, coordinate)))
                  for name in names]

        def fn(params=params, mesh=mesh):
            dparams = {name: DTensor.from_local(param, mesh, placements(name), shape=values[name].shape)
                       for name, param in zip(names, params)}

            def data(value, pl):
                return DTensor.from_local(p.from_numpy(expected_local(value, pl, mesh.shape, mesh.get_coordinate())),
                                          mesh, pl, shape=value.shape)

            trace: dict = {}
            loss = block(dparams, data(ids, batch), data(target, batch), data(mask, replicated), trace)
            assert isinstance(loss, DTensor) and loss.shape == (), repr(loss)
            # the heads stay sharded through attention: tensor parallelism, not replication
            tp = axis_names.index("tp")
            for name, placement in (("q", Shard(1)), ("scores", Shard(1)), ("attn", Shard(2)),
                                    ("attn_out", Partial("sum"))):
                assert trace[name].placements[tp] == placement, f"{name}: {trace[name]!r}"
            return loss.full_tensor()

        where = f"mesh {mesh_shape} {axis_names}"
        loss, backward = p.vjp(fn, [], params)
        np.testing.assert_allclose(p.to_numpy(loss), p.to_numpy(ref_loss), **TOL, err_msg=f"{where}: loss")
        _, grads = backward([p.full((), 1.0, p.dtype("float32"))])
        for name, grad, ref_grad in zip(names, grads, ref_grads):
            np.testing.assert_allclose(p.to_numpy(grad), expected_local(ref_grad, placements(name), mesh_shape,
                                                                        coordinate),
                                       **TOL, err_msg=f"{where}: gradient of {name}")
        optimizer_step(p, params, grads)
        for name, param in zip(names, params):
            np.testing.assert_allclose(p.to_numpy(param), expected_local(ref_stepped[name], placements(name),
                                                                         mesh_shape, coordinate),
                                       **TOL, err_msg=f"{where}: {name} after one AdamW step")
        assert data_axis is None or mesh.size(data_axis) == 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_llama_block(run_on_ranks, world_size: int) -> None:
    meshes = [((world_size,), ("tp",))] + ([((2, 2), ("dp", "tp"))] if world_size == 4 else [])
    run_on_ranks(check_llama_block, meshes, world_size=world_size, timeout_s=300)
