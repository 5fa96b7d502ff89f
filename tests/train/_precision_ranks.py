"""Rank functions of ``tests/train/test_precision.py`` and ``test_grad_accum.py``
(importable by module path, as the harness requires)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.tensor_ops import dtype_name
from hyper_parallel.platform import get_platform
from hyper_parallel.train.config import PRESETS, Layout
from hyper_parallel.train.loop import _train_step, setup, train
from hyper_parallel.train.optim import local_tensor
from hyper_parallel.train.precision import DTYPES, LossScaler
from tests.collective_counts import count_collectives
from tests.train._ranks import losses, tiny_config

#: Relative tolerance of a low-precision run on several ranks against one process in the
#: same dtype, over three steps. Both compute every matrix product in the dtype (8 bits of
#: mantissa for bfloat16: a relative rounding of 2^-9 = 2e-3 per product; 11 for float16,
#: 5e-4) from the same float32 master weights; what differs is where sums are split: the
#: row-parallel projections of --tp add tp partial products, each rounded to the dtype,
#: before the all-reduce (in the dtype), and a rank of --dp-shard runs its GEMMs on half
#: the batch (another blocking of the same dot products). Each of those moves an activation
#: by an ulp of the dtype, i.e. the loss (a mean over 128 tokens of a softmax of those
#: activations) by far less than an ulp (the errors of 128 tokens average out); AdamW's
#: first steps move each weight by ~lr whatever the gradient's size, so the three losses
#: stay close. Measured on torch: bfloat16 3e-5 at most (dp-shard 2, tp 2, dp-shard 2 x
#: cp 2 ring, tp 2 x dp-shard 2, dp-replicate 2 x dp-shard 2), float16 2e-6; MindSpore
#: float16 2e-6. The bounds leave a 30x / 100x margin for other CPUs' kernel paths. The
#: gradients themselves are reduced in float32 on both sides.
LOW_PRECISION_RTOL = {"bf16": 1e-3, "fp16": 2e-4}


def dtype_parity(out: str, dtype: str, layouts: list[dict]) -> list[list[float]]:
    """Each layout of the world, three steps in ``dtype``, then one process in ``dtype``
    and one in float32 (rank 0): the parameters and AdamW's moments stay float32, the
    layouts match one process in the dtype (``LOW_PRECISION_RTOL``), a block's projection
    really computes in the dtype, and the curve stays near float32's. Returns
    ``[layout losses..., reference losses, float32 losses]`` (rank 0; the layouts' on others)."""
    p = get_platform()
    curves = []
    for degrees in layouts:
        layout = Layout(**degrees)
        cfg = tiny_config(f"{out}/{dtype}_{layout.describe()}", nproc=p.world_size(), layout=layout, steps=3,
                          eval_every=3, dtype=dtype)
        run = setup(cfg)
        assert run.dtype == dtype
        seen: set[str] = set()  # the dtype a block's projection computes in
        p.register_forward_hook(run.model.layers[0].attention.wq,
                                lambda module, args, out: seen.add(dtype_name(out.dtype)))
        got = losses(train(cfg, write_outputs=False, run=run))
        assert seen == {DTYPES[dtype]}, (degrees, seen)
        # the master weights and the optimizer's moments are float32 (the gradients were too)
        assert {dtype_name(local_tensor(param).dtype) for param in run.params} == {"float32"}
        state = run.optimizer.state_arrays()
        assert {a.dtype for k, a in state.items() if k != "step"} == {np.dtype(np.float32)}, state.keys()
        curves.append(got.tolist())
    if p.rank() != 0:
        return curves
    ref_cfg = tiny_config(f"{out}/{dtype}_ref", steps=3, eval_every=3, dtype=dtype)
    ref = losses(train(ref_cfg, reference=True, write_outputs=False))
    fp32 = losses(train(ref_cfg.replace(dtype="fp32"), reference=True, write_outputs=False))
    for degrees, got in zip(layouts, curves):
        np.testing.assert_allclose(got, ref, rtol=LOW_PRECISION_RTOL[dtype], atol=0,
                                   err_msg=f"--dtype {dtype} on {degrees} vs one process in {dtype}")
    # the dtype's rounding stays small: the same curve as float32 (measured 1e-7 to 1e-4)
    np.testing.assert_allclose(ref, fp32, rtol=1e-3, atol=0, err_msg=f"{dtype} vs float32, one process")
    return curves + [ref.tolist(), fp32.tolist()]


def loss_scaling(out: str) -> dict:
    """float16's dynamic loss scaling on one process: a scale that overflows skips the step
    (parameters and AdamW's step count unchanged, the scale halved, the gradients dropped:
    the same batch then gives exactly the update of a run that never overflowed) and a
    finite one steps."""
    p = get_platform()
    cfg = tiny_config(f"{out}/fp16", steps=3, dtype="fp16")
    run = setup(cfg, reference=True)
    before = [p.to_numpy(local_tensor(param)).copy() for param in run.params]
    run.scaler = LossScaler(enabled=True, scale=2.0 ** 100)  # overflows float16 (and float32)
    _, norm = _train_step(run, 1)
    assert not np.isfinite(norm) and run.scaler.scale == 2.0 ** 99, (norm, run.scaler)
    assert int(run.optimizer.state_arrays()["step"]) == 0
    for old, param in zip(before, run.params):
        np.testing.assert_array_equal(p.to_numpy(local_tensor(param)), old)
    run.scaler = LossScaler(enabled=True, scale=1024.0)
    loss, norm = _train_step(run, 1)
    assert np.isfinite(norm) and run.scaler.good_steps == 1
    after_skip = [p.to_numpy(local_tensor(param)).copy() for param in run.params]
    fresh = setup(cfg, reference=True)
    fresh.scaler = LossScaler(enabled=True, scale=1024.0)
    fresh_loss, fresh_norm = _train_step(fresh, 1)
    assert (loss, norm) == (fresh_loss, fresh_norm)
    for got, param in zip(after_skip, fresh.params):
        np.testing.assert_array_equal(got, p.to_numpy(local_tensor(param)))
    rows = train(cfg.replace(steps=4), reference=True, write_outputs=False)
    assert [row["loss_scale"] for row in rows] == [2.0 ** 16] * 4, rows
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    return {"losses": [row["loss"] for row in rows]}


def grad_accum_parity(out: str, layouts: list[dict]) -> list[list[float]]:
    """``--grad-accum 2`` on each layout against one process without accumulation (rank 0),
    float32, three steps, and the collectives of one step: with accumulation each
    fully_shard unit reduce-scatters once per step, as without (only the last microbatch's
    backward reduces), while the forward all-gathers twice as often.

    Tolerance: float32; the mean of two microbatch means is the batch mean, its gradient
    the sum of two half-batch gradients, each a different blocking of the same sums: a few
    ulps per step, which AdamW's sign-like first steps keep below 2e-5 relative (as the
    layouts' own parity tests, ``tests/train/_ranks.py``)."""
    p = get_platform()
    curves, counts = [], []
    for degrees in layouts:
        layout = Layout(**degrees)
        per_step = []
        for accum in (1, 2):
            cfg = tiny_config(f"{out}/accum{accum}_{layout.describe()}", nproc=p.world_size(), layout=layout,
                              steps=3, eval_every=3, grad_accum=accum)
            run = setup(cfg)
            _, calls = count_collectives(lambda: _train_step(run, 1))
            per_step.append(calls)
        if layout.dp_shard > 1:  # fully_shard's reduce-scatters (tp alone has none)
            assert per_step[0]["reduce_scatter_tensor"] > 0, per_step
            assert per_step[1]["reduce_scatter_tensor"] == per_step[0]["reduce_scatter_tensor"], per_step
            assert per_step[1]["all_gather_into_tensor"] > per_step[0]["all_gather_into_tensor"], per_step
        counts.append(per_step)
        curves.append(losses(train(cfg, write_outputs=False)).tolist())
    if p.rank() == 0:
        ref = losses(train(tiny_config(f"{out}/ref", steps=3, eval_every=3), reference=True, write_outputs=False))
        for degrees, got in zip(layouts, curves):
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=0, err_msg=f"--grad-accum 2 on {degrees}")
        one = losses(train(tiny_config(f"{out}/ref2", steps=3, eval_every=3, grad_accum=2), reference=True,
                           write_outputs=False))
        np.testing.assert_allclose(one, ref, rtol=2e-5, atol=0, err_msg="--grad-accum 2 on one process")
    return curves


def checkpointed_dtype(out: str, dtype: str, degrees: dict) -> list[float]:
    """``degrees`` in ``dtype`` with and without activation checkpointing: the same losses
    exactly (the recomputation repeats the forward's casts and operations on the same
    values; the hooks of [Note: the job's mixed precision] run again inside it)."""
    p = get_platform()
    layout = Layout(**degrees)
    curves = []
    for checkpointing in (False, True):
        cfg = tiny_config(f"{out}/{dtype}_ac{int(checkpointing)}", nproc=p.world_size(), layout=layout, steps=3,
                          eval_every=3, dtype=dtype, activation_checkpointing=checkpointing)
        curves.append(losses(train(cfg, write_outputs=False)).tolist())
    np.testing.assert_array_equal(curves[1], curves[0], err_msg=f"{degrees} in {dtype} with checkpointing")
    return curves[1]


def pipeline_dtype(out: str, dtype: str, degrees: dict) -> dict:
    """A pipeline layout in ``dtype`` with sequences longer than 256 (``small``, seq 320):
    every stage after the first receives the positions in float32, unrounded (a bfloat16
    cast rounds integers above 256), its blocks compute in the dtype, and the losses match
    one process in the dtype (rank 0 compares; ``LOW_PRECISION_RTOL``)."""
    p = get_platform()
    layout = Layout(**degrees)
    cfg = tiny_config(f"{out}/{dtype}_{layout.describe()}", nproc=p.world_size(), layout=layout, steps=2,
                      eval_every=2, dtype=dtype, model=PRESETS["small"], model_name="small", seq_len=320)
    run = setup(cfg)
    assert run.pipe is not None and run.dtype == dtype
    received: list[tuple[str, float, bool]] = []  # (dtype, largest position, all integral)
    computed: set[str] = set()
    for module, index in zip(run.pipe.modules, run.pipe.indices):
        if index > 0:
            def record(module: Any, args: Any) -> None:
                positions = p.to_numpy(args[1])
                received.append((dtype_name(args[1].dtype), float(positions.max()),
                                  bool(np.all(positions == np.round(positions)))))
            p.register_forward_pre_hook(module, record)
        block = next(iter(module.layers.values()))
        p.register_forward_hook(block.attention.wq, lambda module, args, out: computed.add(dtype_name(out.dtype)))
    got = losses(train(cfg, write_outputs=False, run=run))
    assert computed == {DTYPES[dtype]}, computed
    if any(index > 0 for index in run.pipe.indices):
        assert received and all(kind == "float32" and whole for kind, _, whole in received), received
        assert max(largest for _, largest, _ in received) > 256, "no position above 256: the check saw nothing"
    if p.rank() == 0:
        ref = losses(train(cfg, reference=True, write_outputs=False))
        np.testing.assert_allclose(got, ref, rtol=LOW_PRECISION_RTOL[dtype], atol=0,
                                   err_msg=f"--dtype {dtype} on {degrees} vs one process in {dtype}")
    return {"received": received, "losses": got.tolist()}
