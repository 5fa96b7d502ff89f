"""Rank functions of the ``hyper-parallel train`` tests (importable by module path, as the
harness requires)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np

from hyper_parallel.core.dtensor.placement_types import chunk_bounds
from hyper_parallel.platform import get_platform
from hyper_parallel.train.config import PRESETS, Layout, ModelConfig, TrainConfig
from hyper_parallel.train.loop import setup, train
from hyper_parallel.train.optim import local_tensor
from hyper_parallel.train.model import parameter_shapes, stage_layers
from hyper_parallel.core.process_groups import barrier


#: A small real corpus (the standard library's json package, ~60 KB): reading the whole
#: standard library costs about a second per run, which the tests repeat many times.
TEST_DATA = (str(Path(json.__file__).parent),)


def tiny_config(out: str, tp: int = 1, steps: int = 4, **changes: object) -> TrainConfig:
    """A run of the ``tiny`` preset (a fraction of a second per step on CPU)."""
    values = dict(data=TEST_DATA, nproc=tp, layout=Layout(tp=tp), model=PRESETS["tiny"],
                  model_name="tiny", seq_len=32, batch_size=4, steps=steps, lr=3e-3, warmup_steps=2, eval_every=2,
                  eval_batches=1, checkpoint_every=0, out=out, progress=False)
    values.update(changes)
    # ``platform=`` given: no backend is resolved here (a test's launching process builds configs too)
    values.setdefault("platform", get_platform().framework)
    return TrainConfig(**values)  # type: ignore[arg-type]


def losses(rows: list[dict]) -> np.ndarray:
    return np.asarray([row["loss"] for row in rows], np.float64)


def grad_norms(rows: list[dict]) -> np.ndarray:
    """The global gradient norm before clipping of each step (``grad_norm.py``)."""
    return np.asarray([row["grad_norm"] for row in rows], np.float64)


def check_clipping_parity(name: str, got: np.ndarray, ref: np.ndarray, max_norm: float) -> None:
    """A layout's global gradient norms against the single-process reference's, which must
    exceed ``max_norm`` at some step (so the parity of the losses includes clipping).

    Tolerance: 2e-5 relative, as the losses': the pieces' squared norms are the reference's
    sum in another order (replicas counted once, [Note: the global gradient norm of
    pieces]), over gradients that differ by the layouts' few ulps per step."""
    assert max(ref) > max_norm, f"the reference's norms {ref.tolist()} never reach --max-norm {max_norm}: no clipping"
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=0, err_msg=f"{name}: global gradient norms vs single process")


def check_layout_parity(out: str) -> list[float]:
    """Tensor parallelism over the whole world against the single-process reference on the
    same seed and data: the parameters are this rank's shards, and the loss curves agree.
    On 4 ranks also tp 2 x dp-shard 2 (fully_shard over the dp submesh of the TP model),
    in this rank function because MindSpore pays seconds per multi-rank call.

    Tolerance: float32. The row-parallel projections add ``tp`` partial sums where the
    reference does one GEMM, a few-ulp difference per step; AdamW's first steps are close
    to ``lr * sign(grad)``, so a flipped sign of a near-zero gradient entry can move the next
    loss by more than an ulp. Four steps stay within 2e-5 relative (measured: tp 2 exact,
    tp 4 1e-7 on torch)."""
    p = get_platform()
    n, r = p.world_size(), p.rank()
    cfg = tiny_config(f"{out}/tp{n}", tp=n)
    run = setup(cfg)
    # the run really is sharded: wq holds n_heads / tp heads on this rank
    shapes = dict(parameter_shapes(cfg.model))
    local = local_shapes(p, run.model, shapes)
    np.testing.assert_equal(local["layers.0.attention.wq.weight"][0], shapes["layers.0.attention.wq.weight"][0] // n)
    np.testing.assert_equal(local["layers.0.feed_forward.w2.weight"][1],
                            shapes["layers.0.feed_forward.w2.weight"][1] // n)
    run_rows = train(cfg, write_outputs=False, run=run)
    got = losses(run_rows)
    got_norms = grad_norms(run_rows)
    assert len(got) == cfg.steps and np.all(np.isfinite(got)), got
    val = [row["val_loss"] for row in run_rows if "val_loss" in row]
    assert len(val) == 2, run_rows
    if n == 1:
        # the single-rank layout is the reference's own code path: check that it learns
        assert got[-1] < got[0] - 0.05, got
        return got.tolist()
    if n == 4:
        # tp 2 x dp-shard 2: fully_shard over the dp submesh shards each rank's TP shard again
        both = cfg.replace(out=f"{out}/tp2_dp2", layout=Layout(tp=2, dp_shard=2))
        run = setup(both)
        local = local_shapes(p, run.model, shapes)
        # [rows, cols] -> TP shard -> Shard(0) over dp: 1 / 4 of each sharded weight
        wq, w2 = shapes["layers.0.attention.wq.weight"], shapes["layers.0.feed_forward.w2.weight"]
        emb = shapes["tok_embeddings.weight"]
        assert local["layers.0.attention.wq.weight"] == (wq[0] // 4, wq[1]), local
        assert local["layers.0.feed_forward.w2.weight"] == (w2[0] // 2, w2[1] // 2), local
        assert local["tok_embeddings.weight"] == (chunk_bounds(emb[0], 2, r // 2)[1], emb[1]), local
        both_rows = train(both, write_outputs=False, run=run)
        both_got = losses(both_rows)
        # tp 2 x cp 2 (Ulysses over the 4 local heads of each TP rank): fully_shard over the
        # flattened (dp_shard, cp) submesh of each TP coordinate averages the gradients over cp
        tp_cp = cfg.replace(out=f"{out}/tp2_cp2", layout=Layout(tp=2, cp=2, cp_mode="ulysses"))
        run = setup(tp_cp)
        local = local_shapes(p, run.model, shapes)
        assert local["layers.0.attention.wq.weight"] == (wq[0] // 4, wq[1]), local
        tp_cp_rows = train(tp_cp, write_outputs=False, run=run)
        tp_cp_got = losses(tp_cp_rows)
    # the reference uses no collectives: rank 0 runs it after every layout's collectives
    if r == 0:
        ref_rows = train(cfg, reference=True, write_outputs=False)
        ref = losses(ref_rows)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=0, err_msg=f"tp {n} vs single process")
        check_clipping_parity(f"tp {n}", got_norms, grad_norms(ref_rows), cfg.max_norm)
        if n == 4:
            # Tolerance: as for tp and dp-shard alone (2e-5 relative over four steps): the TP
            # partial sums and the dp gradient average are the same sums in other orders.
            np.testing.assert_allclose(both_got, ref, rtol=2e-5, atol=0, err_msg="tp 2 x dp-shard 2 vs single process")
            # Tolerance: as above; Ulysses' all-to-alls move values without arithmetic, the
            # cp gradient average is one more sum in another order (measured 1.3e-7 on torch).
            np.testing.assert_allclose(tp_cp_got, ref, rtol=2e-5, atol=0, err_msg="tp 2 x cp 2 vs single process")
            check_clipping_parity("tp 2 x dp-shard 2", grad_norms(both_rows), grad_norms(ref_rows), cfg.max_norm)
            check_clipping_parity("tp 2 x cp 2", grad_norms(tp_cp_rows), grad_norms(ref_rows), cfg.max_norm)
    return got.tolist()


#: ``tiny`` with sizes that do not divide by 4: the key/value projections (18 rows) and the
#: SwiGLU input projections (66 rows) are uneven chunks over 4 ranks (5, 5, 5, 3 and
#: 17, 17, 17, 15), which fully_shard pads to equal shards.
UNEVEN_MODEL = ModelConfig(dim=36, n_layers=2, n_heads=6, n_kv_heads=3, hidden_dim=66, max_seq_len=256)


def check_data_parallel_parity(out: str, layouts: list[dict], uneven: bool = True) -> list[list[float]]:
    """Sharded data parallelism (fully_shard, FSDP2 order: each block then the root),
    HSDP and context parallelism (with fully_shard over the flattened (dp_shard, cp) mesh)
    against the single-process reference on the same seed and data, one layout after
    the other in this rank function (MindSpore pays seconds per multi-rank call).

    For each layout: every parameter is this rank's shard (``ceil(rows / (dp_shard * cp))``
    rows, padded), each rank trains on its share of every batch (cp: its sequence shards),
    the reported loss is the mean over the data- and context-parallel ranks, and the curve
    matches the reference. Context parallelism adds the attention's split softmax (partial
    results merged in float32 by their log-sum-exp): a few more ulps, measured 1.1e-7 on
    torch for dp-shard 2 x cp 2 (ring).

    Tolerance: float32. Each rank's loss is the mean over its share of the batch and the
    gradients are averaged over the ranks by reduce-scatter (and all-reduce over replicas):
    the same sum in another order, a few ulps per step; AdamW's first steps are close to
    ``lr * sign(grad)``, so a flipped sign of a near-zero gradient entry moves the next loss
    a little more than an ulp. Three steps stay within 2e-5 relative (measured on torch:
    8.6e-8 for dp-shard 4 and for dp-replicate 2 x dp-shard 2).

    ``uneven=False``: the ``tiny`` preset instead of ``UNEVEN_MODEL`` (whose 3 key/value
    heads no Ulysses degree of the hybrid cp mode divides)."""
    p = get_platform()
    n = p.world_size()
    runs = []
    for degrees in layouts:
        layout = Layout(**degrees)
        assert layout.world_size == n, (degrees, n)
        model = dict(model=UNEVEN_MODEL, model_name="tiny+uneven") if uneven else {}
        cfg = tiny_config(f"{out}/{layout.describe()}-{layout.cp_mode}", nproc=n, layout=layout, steps=3, eval_every=3,
                          **model)
        run = setup(cfg)
        shapes = dict(parameter_shapes(cfg.model))
        local = local_shapes(p, run.model, shapes)
        assert sorted(local) == sorted(shapes), sorted(local)
        coords = dict(zip(Layout.AXES, np.unravel_index(p.rank(), tuple(layout.degrees().values()))))
        shard = int(coords["dp_shard"]) * layout.cp + int(coords["cp"])  # cp: fully_shard over (dp_shard, cp)
        for name, shape in shapes.items():
            rows = chunk_bounds(shape[0], layout.dp_shard * layout.cp, shard)[1]
            assert local[name] == (rows, *shape[1:]), (name, local[name], shape)
        rows = train(cfg, write_outputs=False, run=run)
        runs.append((cfg, losses(rows), grad_norms(rows)))
    # The references use no collectives, so rank 0 alone runs them, after every layout's
    # collectives are done (a rank waiting in a collective for rank 0's reference would time out).
    # The reference ignores the layout, so one run serves every layout.
    ref_rows = train(runs[0][0], reference=True, write_outputs=False) if p.rank() == 0 else []
    for cfg, got, got_norms in runs if p.rank() == 0 else []:
        np.testing.assert_allclose(got, losses(ref_rows), rtol=2e-5, atol=0,
                                   err_msg=f"{cfg.layout.describe()} vs single process")
        check_clipping_parity(f"{cfg.layout.describe()} {cfg.layout.cp_mode}", got_norms, grad_norms(ref_rows),
                              cfg.max_norm)
    return [got.tolist() for _, got, _ in runs]


def check_resume(out: str) -> None:
    """Resume reproduces the uninterrupted run bit for bit; a checkpoint cut off mid-write
    (and a crashed save's leftover temporary folder) is skipped for the previous one.
    The run is sharded by fully_shard over the world (checkpoints hold padded local shards
    and their optimizer moments)."""
    p = get_platform()
    n, r = p.world_size(), p.rank()
    cfg = tiny_config(out, nproc=n, layout=Layout(dp_shard=n), steps=4, checkpoint_every=2)
    full = losses(train(cfg))
    ckpt = cfg.checkpoint_path
    assert sorted(x.name for x in ckpt.iterdir()) == ["step_00000002", "step_00000004"], list(ckpt.iterdir())

    # interrupted after step 2's checkpoint: step 4's never happened
    barrier() if n > 1 else None
    if r == 0:
        shutil.rmtree(ckpt / "step_00000004")
    barrier() if n > 1 else None
    resumed = losses(train(cfg.replace(resume=True)))
    np.testing.assert_array_equal(resumed, full[2:], err_msg="resumed from step 2")

    # step 4's checkpoint exists again; cut one shard off mid-write, and leave a crashed save behind
    barrier() if n > 1 else None
    if r == 0:
        shard = ckpt / "step_00000004" / f"rank_{n - 1:05d}.safetensors"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        (ckpt / ".step_00000009.tmp").mkdir()
        (ckpt / ".step_00000009.tmp" / "rank_00000.safetensors").write_bytes(b"partial")
    barrier() if n > 1 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = losses(train(cfg.replace(resume=True)))
    messages = [str(w.message) for w in caught if "unusable" in str(w.message)]
    assert len(messages) == 1 and "step_00000004" in messages[0] and "cut off" in messages[0], messages
    np.testing.assert_array_equal(fallback, full[2:], err_msg="fell back to step 2")
    if r == 0:
        from hyper_parallel.train.metrics import read_metrics

        rows = read_metrics(Path(out) / "metrics.jsonl")
        assert [row["step"] for row in rows] == [1, 2, 3, 4], rows
        np.testing.assert_array_equal(losses(rows), full)
        assert (Path(out) / "loss.png").stat().st_size > 1000


def check_dp_shard_parity_and_resume(out: str) -> list[float]:
    """dp-shard over the world (2 ranks), and cp over the world (all-gathered K/V), against
    the reference, then resume and cut-off
    checkpoints of that layout (one rank function: MindSpore pays seconds per call)."""
    check_resume(f"{out}/resume")
    # last: rank 0 runs the reference after the collectives (see check_data_parallel_parity)
    n = get_platform().world_size()
    return check_data_parallel_parity(f"{out}/parity", [{"dp_shard": n}, {"cp": n, "cp_mode": "allgather"}])[0]


#: ``tiny`` with 4 layers: interleaved 1F1B over 2 pipeline ranks runs 4 stages of one block.
PIPELINE_MODEL = ModelConfig(dim=32, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=64, max_seq_len=256)


def check_pipeline_parity(out: str, layouts: list[dict], resume: bool = False) -> list[list[float]]:
    """Pipeline parallelism (``--pp``, alone or composed with ``--tp``, ``--dp-replicate``,
    ``--dp-shard``, ``--cp``: every stage module runs the chain TP -> CP -> fully_shard over
    its own pipeline coordinate's submeshes) against the single-process reference on the
    same seed and data, one layout after the other (MindSpore pays seconds per multi-rank
    call). For each layout: this rank holds only its stages' parameters, split as
    ``pipeline_local_shapes`` says, and the training and validation losses match the
    reference's. ``resume``: the first layout also checkpoints at step 2 and resumes from it
    bit-identically.

    Tolerance: float32. The last stage's loss is the mean of the microbatch means (equal
    microbatches: the mean over the tokens, summed in another order) and the gradients are
    the microbatches' gradients (each scaled by 1 / microbatches), summed, and with
    dp-shard averaged over the ranks by one reduce-scatter per microbatch: the same sums
    in other orders, a few ulps per step, which AdamW's sign-like first steps can amplify
    a little. The row-parallel projections add ``tp`` partial sums, replicas are averaged by
    all-reduce, the attention's softmax is split across cp ranks and merged by log-sum-exp:
    more sums in other orders. Three steps stay within 2e-5 relative, as for the other
    layouts (measured on torch: pp 2 1F1B 8.6e-8, pp 2 interleaved 4.3e-8, pp 2 x dp-shard 2
    GPipe 1.1e-7)."""
    p = get_platform()
    n = p.world_size()
    runs = []
    for degrees in layouts:
        layout = Layout(**degrees)
        assert layout.world_size == n, (degrees, n)
        # one block per stage: the least work a stage's neighbours wait for
        model = (PIPELINE_MODEL, "tiny-4-layers") if layout.num_stages == 4 else (PRESETS["tiny"], "tiny")
        cfg = tiny_config(f"{out}/{layout.describe()}-{layout.pp_schedule}-{layout.cp_mode}", nproc=n,
                          layout=layout, steps=3, eval_every=3, model=model[0], model_name=model[1],
                          checkpoint_every=2 if resume and not runs else 0)
        run = setup(cfg)
        # this rank's parameters: its stages' blocks (and the embedding / the head), sharded
        got_shapes = sorted(tuple(local_tensor(param).shape) for param in run.params)
        assert got_shapes == pipeline_local_shapes(cfg, p.rank()), got_shapes
        rows = train(cfg, write_outputs=resume and not runs, run=run)
        got = losses(rows)
        val = rows[-1]["val_loss"]
        if resume and not runs:
            resumed = losses(train(cfg.replace(resume=True, steps=3), write_outputs=False))
            assert resumed.size == 0, resumed  # step 3's checkpoint is the newest: nothing left to run
            barrier()
            if p.rank() == 0:
                shutil.rmtree(cfg.checkpoint_path / "step_00000003")
            barrier()
            resumed = losses(train(cfg.replace(resume=True), write_outputs=False))
            np.testing.assert_array_equal(resumed, got[2:], err_msg="resumed from step 2")
        runs.append((cfg, got, val, grad_norms(rows)))
    return compare_pipeline_runs(runs)


def compare_pipeline_runs(runs: list[tuple[TrainConfig, np.ndarray, float, np.ndarray]]) -> list[list[float]]:
    """Rank 0 compares each ``(cfg, training losses, final validation loss, global gradient
    norms)`` with the single-process reference's within 2e-5 relative (the tolerance of the
    callers' docstrings; the norms: ``check_clipping_parity``); the reference ignores the
    layout, so one runs per model. It runs after every layout's collectives (see
    check_data_parallel_parity). Returns the losses."""
    if get_platform().rank() == 0:
        references = {}
        for cfg, got, val, got_norms in runs:
            if cfg.model_name not in references:
                ref_rows = train(cfg, reference=True, write_outputs=False)
                references[cfg.model_name] = (losses(ref_rows), ref_rows[-1]["val_loss"], grad_norms(ref_rows))
            ref, ref_val, ref_norms = references[cfg.model_name]
            name = f"{cfg.layout.describe()} {cfg.layout.pp_schedule} {cfg.layout.cp_mode}"
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=0, err_msg=f"{name} vs single process")
            np.testing.assert_allclose(val, ref_val, rtol=2e-5, atol=0, err_msg=f"{name} validation loss")
            check_clipping_parity(name, got_norms, ref_norms, cfg.max_norm)
    return [got.tolist() for _, got, _, _ in runs]


def reference_losses(cfg_values: dict) -> list[list[float]]:
    """The single-process reference of a run (``TrainConfig.to_dict()``): its training
    losses and its validation losses, on this rank alone (no collectives)."""
    cfg = TrainConfig.from_dict(cfg_values)
    rows = train(cfg, reference=True, write_outputs=False)
    return [losses(rows).tolist(), [row["val_loss"] for row in rows if "val_loss" in row]]


def local_shapes(p, model, shapes: dict) -> dict:
    """``{name: local shape}`` of a parallelized model, after checking that every parameter
    has the model's global shape (the DTensor parameters of fully_shard and TP do)."""
    out = {}
    for name, param in p.named_parameters(model):
        assert tuple(param.shape) == tuple(shapes[name]), (name, tuple(param.shape), shapes[name])
        out[name] = tuple(local_tensor(param).shape)
    return out


def pipeline_local_shapes(cfg: TrainConfig, rank: int) -> list[tuple[int, ...]]:
    """The shapes of the parameters rank ``rank`` of ``cfg``'s pipeline layout holds (sorted):
    its stages' parameters (``stage_layers``: the embedding on stage 0, the norm and head on
    the last), each split by the layout chain. Tensor parallelism (``TP_PLAN``): q/k/v and
    w1/w3 keep ``rows / tp`` rows, wo and w2 ``cols / tp`` columns; then fully_shard keeps
    its chunk of the rows over ``dp_shard x cp`` (dp_replicate holds replicas)."""
    lay = cfg.layout
    coords = dict(zip(Layout.AXES, np.unravel_index(rank, tuple(lay.degrees().values()))))
    shapes = parameter_shapes(cfg.model)
    ranges = stage_layers(cfg.model.n_layers, lay.num_stages)
    # loop placement (stage s on pipeline rank s % pp), or ZB-V's and DualPipeV's V (stages r
    # and 2 pp - 1 - r), written out here as an independent check of the core's table
    mine = [coords["pp"], 2 * lay.pp - 1 - coords["pp"]] if lay.pp_schedule in ("zbv", "dualpipev") else \
        [s for s in range(lay.num_stages) if s % lay.pp == coords["pp"]]
    out = []
    for s in mine:
        for name, shape in shapes.items():
            if not ((name == "tok_embeddings.weight" and s == 0)
                    or (name in ("norm.weight", "output.weight") and s == lay.num_stages - 1)
                    or any(name.startswith(f"layers.{i}.") for i in ranges[s])):
                continue
            local = list(shape)
            if any(name.endswith(f".{w}.weight") for w in ("wq", "wk", "wv", "w1", "w3")):
                local[0] //= lay.tp
            elif name.endswith((".wo.weight", ".w2.weight")):
                local[1] //= lay.tp
            shard = int(coords["dp_shard"]) * lay.cp + int(coords["cp"])
            local[0] = chunk_bounds(local[0], lay.dp_shard * lay.cp, shard)[1]
            out.append(tuple(local))
    return sorted(out)
