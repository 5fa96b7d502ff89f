"""Rank functions of ``tests/train/test_moe_pipeline.py`` (importable by module path, as the
harness requires): the MoE decoder cut into pipeline stages (``--pp``, with and without
``--ep``) against the single process."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hyper_parallel.platform import get_platform
from hyper_parallel.train.config import PRESETS, Layout, TrainConfig
from hyper_parallel.train.data import rank_batch
from hyper_parallel.train.loop import _batch_tensors, setup, train
from hyper_parallel.train.optim import local_tensor
from hyper_parallel.train.pipeline import train_step
from tests.train._moe_ranks import (GRAD_ATOL_OF_MAX, GRAD_RTOL, LOSS_RTOL, MOE_FIELDS, _first_step_gradients,
                                    compare_with_reference, resume_in_one_process)
from tests.train._parity_ranks import layout_config
from tests.train._ranks import losses


def moe_pipeline_config(out: str, degrees: dict, moe_every: int = 1, n_layers: int = 2,
                        activation_checkpointing: bool = False) -> TrainConfig:
    """``moe-tiny`` (4 experts, top-2, a shared expert; aux-free) with ``n_layers`` blocks, every
    ``moe_every``-th one MoE (1: each stage holds an MoE block; 2: block 0 dense, so the first
    stage of two holds none), on the pipeline layout ``degrees``, three steps."""
    model = dataclasses.replace(PRESETS["moe-tiny"], moe_every=moe_every, n_layers=n_layers)
    tag = (f"moe-every{moe_every}-layers{n_layers}-{degrees.get('pp_schedule', '1f1b')}"
           f"{'-overlap' if degrees.get('ep_overlap') else ''}{'-ckpt' if activation_checkpointing else ''}")
    layout = Layout(**degrees)  # a batch of 4 sequences, or one per data-parallel rank and microbatch
    return layout_config(f"{out}/{tag}", degrees, model=model, model_name="moe-tiny",
                         batch_size=max(4, layout.dp * layout.microbatches),
                         activation_checkpointing=activation_checkpointing)


def _pipeline_first_step_gradients(cfg: TrainConfig) -> tuple[dict[str, np.ndarray], Any]:
    """This rank's piece of every parameter of its stages' gradient of step 1 (``run.pipe``'s
    gradients after one scheduled step, not applied), from a fresh ``setup`` (collective)."""
    p = get_platform()
    run = setup(cfg)
    batch = rank_batch(run.corpus.train, cfg.seed, 1, cfg.batch_size, cfg.seq_len, run.dp_rank, run.dp_size)
    assert run.pipe is not None
    train_step(run.pipe, _batch_tensors(run, batch))
    out = {}
    for name, grad in zip(run.names, run.pipe.gradients()):
        lengths = run.boxes[name].lengths  # fully_shard pads uneven shards: the box is the unpadded piece
        out[name] = p.to_numpy(local_tensor(grad))[tuple(slice(0, n) for n in lengths)]
    for _, layer in run.moe:  # the step's counts are not balance_step'ed: drop them with the run
        layer.counts.reset()
    return out, run.boxes


def check_moe_pipeline_parity(out: str, cases: list[tuple[dict, int, int]]) -> list[dict]:
    """Each ``(degrees, moe_every, n_layers[, activation_checkpointing])`` of ``cases``
    (``moe_pipeline_config``) on this
    world against the single process on the same seed and data: this rank's piece of the
    first step's gradients (its stages' parameters; ``GRAD_*`` of ``_moe_ranks``), the
    losses, the validation loss and the global gradient norms (``LOSS_RTOL``: the pipeline's
    microbatch sums and fully_shard's per-microbatch reduce-scatters are the reference's
    float32 sums in other orders, as for the dense pipelines), and exactly the per-step
    routing counts of every MoE layer (every rank reports all layers, its stages' or not)
    and the aux-free biases of this rank's layers after the run. Every rank runs the
    references after all the layouts' collectives. Returns each case's losses and biases."""
    got = []
    for degrees, moe_every, n_layers, *checkpointing in cases:
        cfg = moe_pipeline_config(out, degrees, moe_every, n_layers, bool(checkpointing and checkpointing[0]))
        assert cfg.layout.world_size == get_platform().world_size() and cfg.layout.pp > 1, degrees
        grads, boxes = _pipeline_first_step_gradients(cfg)
        run = setup(cfg)
        rows = train(cfg, write_outputs=False, run=run)
        got.append({"cfg": cfg, "grads": grads, "boxes": boxes, "rows": rows,
                    "bias": {name: layer.expert_bias.copy() for name, layer in run.moe}})
    results = []
    for case in got:
        cfg, rows = case["cfg"], case["rows"]
        lay = cfg.layout
        what = f"{lay.describe()} {lay.pp_schedule} moe_every={cfg.model.moe_every}"
        ref_grads = _first_step_gradients(cfg, reference=True)
        ref_run = setup(cfg, reference=True)
        ref_rows = train(cfg, reference=True, write_outputs=False, run=ref_run)
        assert case["grads"], f"{what}: this rank holds no parameter"
        curve = compare_with_reference(what, case["grads"], case["boxes"], ref_grads, rows, ref_rows)
        # float32 biases moved by identical integers: exact
        assert [r["moe_bias_norm"] for r in rows] == [r["moe_bias_norm"] for r in ref_rows], what
        assert len(rows[0]["moe_tokens_per_expert_max_by_layer"]) == len(ref_run.moe) > 0, what
        ref_bias = dict((name, layer.expert_bias) for name, layer in ref_run.moe)
        for name, bias in case["bias"].items():
            assert np.abs(bias).max() > 0, f"{what}: {name}'s bias never moved"
            np.testing.assert_array_equal(bias, ref_bias[name], err_msg=f"{what}: {name} balance bias")
        results.append({"losses": curve, "bias_norms": [r["moe_bias_norm"] for r in rows]})
    return results


def check_overlap_matches_plain(out: str, degrees: dict, moe_every: int = 1, n_layers: int = 2,
                                activation_checkpointing: bool = False) -> dict:
    """``degrees`` with ``ep_overlap`` against the same pipeline without it: the schedule
    has ``OVERLAP_B_F`` pairs (the two threads ran), the first step's gradients of this
    rank's pieces agree to float32 summation order (``GRAD_*``: the overlap reduce-scatters
    each unit's summed gradient once where the plain run reduce-scatters per microbatch,
    [Note: the overlap in the job]), and three steps' losses and gradient norms to
    ``LOSS_RTOL``, routing counts and balance biases exactly. Returns the largest relative
    difference of the gradients and of the losses."""
    overlapped = moe_pipeline_config(out, {**degrees, "ep_overlap": True}, moe_every, n_layers,
                                     activation_checkpointing)
    plain = moe_pipeline_config(f"{out}/plain", degrees, moe_every, n_layers, activation_checkpointing)
    runs = {}
    for cfg in (overlapped, plain):
        grads, boxes = _pipeline_first_step_gradients(cfg)
        run = setup(cfg)
        if cfg is overlapped:
            assert any(a.type.name == "OVERLAP_B_F" for a in run.pipe.schedule.actions), run.pipe.schedule.actions
        rows = train(cfg, write_outputs=False, run=run)
        if cfg is overlapped and run.moe:  # this rank's MoE stages met at the dispatch/combine hooks
            assert run.pipe.schedule.overlap.coordinator.paired > 0, "the overlapped pairs never met at a hook"
        runs[cfg is overlapped] = (grads, rows, {name: layer.expert_bias.copy() for name, layer in run.moe})
    (grads, rows, bias), (ref_grads, ref_rows, ref_bias) = runs[True], runs[False]
    what = f"{overlapped.layout.describe()} {overlapped.layout.pp_schedule}"
    grad_diff = 0.0
    for name, grad in grads.items():
        scale = float(np.abs(ref_grads[name]).max())
        np.testing.assert_allclose(grad, ref_grads[name], rtol=GRAD_RTOL, atol=GRAD_ATOL_OF_MAX * scale,
                                   err_msg=f"{what}: step-1 gradient of {name} vs the run without --ep-overlap")
        grad_diff = max(grad_diff, float(np.abs(grad - ref_grads[name]).max()) / scale)
    for field in (*MOE_FIELDS, "moe_bias_norm"):
        assert [r[field] for r in rows] == [r[field] for r in ref_rows], (what, field)
    for name in ref_bias:
        np.testing.assert_array_equal(bias[name], ref_bias[name], err_msg=f"{what}: {name} balance bias")
    curve, ref_curve = losses(rows), losses(ref_rows)
    np.testing.assert_allclose(curve, ref_curve, rtol=LOSS_RTOL, atol=0, err_msg=f"{what}: losses vs without overlap")
    np.testing.assert_allclose([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows], rtol=LOSS_RTOL,
                               atol=0, err_msg=f"{what}: gradient norms vs without overlap")
    return {"grad_max_rel_diff": grad_diff, "loss_max_rel_diff": float(np.max(np.abs(curve / ref_curve - 1)))}


def check_pipeline_resume_in_one_process(out: str, degrees: dict) -> list[float]:
    """A checkpoint of the MoE pipeline ``degrees`` (an MoE block on each stage; each stage's
    ranks write its layers' pieces and balance biases) resumed in one process (resharded:
    every stage on one rank) as one process would have continued
    (``_moe_ranks.resume_in_one_process``)."""
    return resume_in_one_process(moe_pipeline_config(out, degrees))
