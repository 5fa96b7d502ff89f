"""Rank functions of ``tests/train/test_moe.py`` (importable by module path, as the harness
requires): the MoE decoder on the job's layouts against the single process."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hyper_parallel.core.dtensor.placement_types import chunk_bounds
from hyper_parallel.platform import get_platform
from hyper_parallel.train.config import PRESETS, Layout, TrainConfig
from hyper_parallel.train.data import rank_batch
from hyper_parallel.train.loop import _accumulate, setup, train
from hyper_parallel.train.model import parameter_shapes
from hyper_parallel.train.optim import local_tensor
from tests.train._parity_ranks import layout_config, local_shape
from tests.train._ranks import losses

#: Relative tolerance of the losses and global gradient norms: the dense layouts' (2e-5,
#: reasoned in ``_parity_ranks.check_against_reference``: the layouts' reductions are the
#: reference's float32 sums in other orders). The routing adds no arithmetic of its own
#: across ranks: each token is routed on the rank that holds it, by the same float32 GEMM
#: row and numpy's stable argsort, and the experts' rows are gathered and scattered
#: without arithmetic; only a near-tie between two experts' scores (below the few-ulp
#: differences of the router's input) could route a token differently, which the
#: per-step token counts compared exactly below would show.
LOSS_RTOL = 2e-5

#: The first step's gradients, from bit-identical weights: float32 sums in another order
#: (fully_shard's reduce-scatter averages two half-batch gradients where the reference sums
#: one batch; tensor parallelism adds two partial sums for the shared expert and attention),
#: ~1e-6 relative to the largest terms of each sum. An entry that nearly cancels is off
#: by that much of its tensor's scale, hence the absolute floor relative to the tensor's
#: largest gradient; the rest agree to 1e-4 relative (measured below 1e-5).
GRAD_RTOL, GRAD_ATOL_OF_MAX = 1e-4, 1e-5

MOE_FIELDS = ("moe_tokens_per_expert_max", "moe_tokens_per_expert_mean", "moe_dropped_tokens",
              "moe_tokens_per_expert_max_by_layer")


def moe_config(out: str, degrees: dict, balance: str, **changes: object) -> TrainConfig:
    """``moe-tiny`` (block 0 dense, block 1 MoE: 4 experts, top-2, a shared expert) with
    ``balance`` on the layout ``degrees``, three steps (``layout_config``); ``changes``:
    other ``TrainConfig`` fields."""
    model = dataclasses.replace(PRESETS["moe-tiny"], moe_balance=balance)
    tag = "".join(f"_{key}" for key in sorted(changes))
    return layout_config(f"{out}/{balance}{tag}", degrees, model=model, model_name="moe-tiny", **changes)


def moe_local_shape(name: str, shape: tuple[int, ...], cfg: TrainConfig, rank: int) -> tuple[int, ...]:
    """``local_shape``, except for the routed experts under ``--ep``: ``experts / ep`` whole
    experts on each rank (its ``dp_shard`` coordinate modulo ``ep``), then fully_shard's
    chunk of those over the other ``dp_shard / ep`` ranks times the ``cp`` ranks, outer
    ``dp_shard`` coordinate first (``expert_parallel_meshes``)."""
    lay = cfg.layout
    if lay.ep == 1 or ".moe.experts." not in name:
        return local_shape(name, shape, lay, rank)
    coords = dict(zip(Layout.AXES, np.unravel_index(rank, tuple(lay.degrees().values()))))
    shard = int(coords["dp_shard"]) // lay.ep * lay.cp + int(coords["cp"])
    return (chunk_bounds(shape[0] // lay.ep, lay.dp_shard // lay.ep * lay.cp, shard)[1], *shape[1:])


#: An initial balance bias that makes expert 0 every token's choice (router probabilities
#: of moe-tiny's initial weights lie within ~0.1 of each other): all (token, slot) rows of
#: the first slot go to expert 0, so one expert-parallel rank receives most of the rows
#: (the uneven all-to-all) and the aux-free updates start from a skewed load.
SKEWED_BIAS = np.asarray([1.0, 0.0, 0.0, 0.0], np.float32)


def _setup(cfg: TrainConfig, reference: bool, bias: np.ndarray | None) -> Any:
    """``setup`` with every MoE layer's balance bias set to ``bias`` (``None``: zero)."""
    run = setup(cfg, reference=reference)
    if bias is not None:
        for _, layer in run.moe:
            layer.expert_bias[:] = bias
    return run


def _first_step_gradients(cfg: TrainConfig, reference: bool = False,
                          bias: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """This rank's piece of every parameter's gradient of step 1 (the whole gradient with
    ``reference``), from a fresh ``_setup`` (collective unless ``reference``)."""
    p = get_platform()
    run = _setup(cfg, reference, bias)
    batch = rank_batch(run.corpus.train, cfg.seed, 1, cfg.batch_size, cfg.seq_len, run.dp_rank, run.dp_size)
    _, grads = _accumulate(run, batch)
    out = {}
    for name, grad in zip(run.names, run.optimizer.gradients(grads)):
        lengths = run.boxes[name].lengths  # fully_shard pads uneven shards: the box is the unpadded piece
        out[name] = p.to_numpy(local_tensor(grad))[tuple(slice(0, n) for n in lengths)]
    return out


def compare_with_reference(what: str, grads: dict[str, np.ndarray], boxes: dict[str, Any],
                           ref_grads: dict[str, np.ndarray], rows: list[dict], ref_rows: list[dict]) -> list[float]:
    """This rank's pieces ``grads`` (``boxes``) of the first step's gradients against the
    reference's whole ``ref_grads`` (``GRAD_*``), the losses, the last validation loss and
    the global gradient norms against the reference's rows (``LOSS_RTOL``), and the routing
    counts (``MOE_FIELDS``: integers summed over the ranks) and the balance biases' norms
    exactly. Returns the losses and the validation loss."""
    for name, grad in grads.items():
        box = boxes[name]
        expected = ref_grads[name][tuple(slice(s, s + n) for s, n in zip(box.starts, box.lengths))]
        scale = float(np.abs(ref_grads[name]).max())
        assert scale > 0, f"{name}: the reference's gradient is zero: the test would not see a wrong one"
        np.testing.assert_allclose(grad, expected, rtol=GRAD_RTOL, atol=GRAD_ATOL_OF_MAX * scale,
                                   err_msg=f"{what}: step-1 gradient of {name} vs single process")
    curve = [*losses(rows).tolist(), rows[-1]["val_loss"]]
    ref_curve = [*losses(ref_rows).tolist(), ref_rows[-1]["val_loss"]]
    np.testing.assert_allclose(curve, ref_curve, rtol=LOSS_RTOL, atol=0, err_msg=f"{what}: losses vs single process")
    np.testing.assert_allclose([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows], rtol=LOSS_RTOL,
                               atol=0, err_msg=f"{what}: global gradient norms vs single process")
    for field in MOE_FIELDS:
        assert [r[field] for r in rows] == [r[field] for r in ref_rows], (what, field)
    # aux-free: the biases move by +-rate on integer loads, the same on every layout
    assert [r.get("moe_bias_norm") for r in rows] == [r.get("moe_bias_norm") for r in ref_rows], what
    return curve


def check_moe_parity(out: str, cases: list[tuple]) -> list[dict]:
    """Each ``(degrees, balance[, changes])`` of ``cases`` (``moe_config``'s arguments;
    ``changes["initial_bias"]``: every MoE layer's starting balance bias, ``SKEWED_BIAS``
    for uneven loads) on this world against the single process (the reference runs
    without activation checkpointing, as the job's, and from the same bias) on
    the same seed and data: this rank's parameter shapes (``local_shape``: experts and
    router sharded by fully_shard over ``dp_shard``, replicated over ``tp``; the shared
    expert split by ``TP_PLAN``), its piece of the first step's gradients, the losses, the
    validation loss and the global gradient norms (``LOSS_RTOL``, ``GRAD_*``), and exactly
    the per-step routing counts and the aux-free balance bias after the run. Every rank runs
    the reference after all the layouts' collectives (it uses none) and checks its own
    pieces. Returns each case's ``{"losses": [...], "bias": [...]}``."""
    p = get_platform()
    got = []
    for degrees, balance, *changes in cases:
        options = dict(changes[0]) if changes else {}
        bias = options.pop("initial_bias", None)
        cfg = moe_config(out, degrees, balance, **options)
        assert cfg.layout.world_size == p.world_size(), degrees
        grads = _first_step_gradients(cfg, bias=bias)
        run = _setup(cfg, False, bias)
        shapes = parameter_shapes(cfg.model)
        assert sorted(run.names) == sorted(shapes), run.names
        for name, box in run.boxes.items():
            assert tuple(box.lengths) == moe_local_shape(name, shapes[name], cfg, p.rank()), (degrees, name, box)
        rows = train(cfg, write_outputs=False, run=run)
        got.append({"cfg": cfg, "grads": grads, "boxes": run.boxes, "rows": rows, "initial_bias": bias,
                    "bias": {name: layer.expert_bias.copy() for name, layer in run.moe}})
    results = []
    for case in got:
        cfg, rows = case["cfg"], case["rows"]
        what = f"{cfg.layout.describe()} {cfg.model.moe_balance}"
        ref_grads = _first_step_gradients(cfg, reference=True, bias=case["initial_bias"])
        ref_run = _setup(cfg, True, case["initial_bias"])
        ref_rows = train(cfg, reference=True, write_outputs=False, run=ref_run)
        curve = compare_with_reference(what, case["grads"], case["boxes"], ref_grads, rows, ref_rows)
        assert all(r["moe_dropped_tokens"] == 0 for r in rows), what
        if case["initial_bias"] is not None:  # the skew is real: expert 0 took every token's first slot
            assert rows[0]["moe_tokens_per_expert_max"] == cfg.batch_size * cfg.seq_len, (what, rows[0])
        if cfg.model.moe_balance == "aux-free":
            ref_bias = {name: layer.expert_bias for name, layer in ref_run.moe}
            assert sorted(case["bias"]) == sorted(ref_bias) and ref_bias, (what, sorted(case["bias"]))
            for name, bias in case["bias"].items():
                assert np.abs(bias).max() > 0, f"{what}: {name}'s bias never moved"
                np.testing.assert_array_equal(bias, ref_bias[name], err_msg=f"{what}: {name} balance bias")
        else:
            np.testing.assert_allclose([r["moe_aux_loss"] for r in rows], [r["moe_aux_loss"] for r in ref_rows],
                                       rtol=LOSS_RTOL, atol=0, err_msg=f"{what}: auxiliary loss vs single process")
        results.append({"losses": curve, "bias": {k: v.tolist() for k, v in case["bias"].items()}})
    return results


def check_resume_across_expert_parallel_degrees(out: str) -> list[float]:
    """moe-tiny on ``dp_shard 2 x ep 2`` for 2 steps (a checkpoint of each rank's two whole
    experts), then on every rank alone: a single-process resume of it to step 4 (the
    checkpoint resharded: every expert on one rank) against the single process run
    uninterrupted to step 4. The losses agree to ``LOSS_RTOL`` (the first two steps ran in
    another layout: float32 sums in other orders, see ``check_moe_parity``) and the balance
    biases exactly (integer routing counts). Returns the resumed losses."""
    return resume_in_one_process(moe_config(out, {"dp_shard": 2, "ep": 2}, "aux-free"))


def resume_in_one_process(cfg: TrainConfig) -> list[float]:
    """``cfg`` for 2 steps (its checkpoint at step 2), then on every rank alone a resume of
    it to step 4 against the single process run uninterrupted to step 4, as
    ``check_resume_across_expert_parallel_degrees`` describes. Returns the resumed losses."""
    cfg = cfg.replace(steps=2)
    train(cfg)  # writes its checkpoint at step 2 (collective)
    p = get_platform()
    alone = cfg.replace(steps=4, resume=True, out=f"{cfg.out}/resumed{p.rank()}", checkpoint_dir=str(cfg.checkpoint_path))
    resumed_run = setup(alone, reference=True)
    resumed = train(alone, reference=True, write_outputs=False, run=resumed_run)
    whole_run = setup(cfg.replace(steps=4), reference=True)
    whole = train(cfg.replace(steps=4), reference=True, write_outputs=False, run=whole_run)
    assert [r["step"] for r in resumed] == [3, 4], [r["step"] for r in resumed]
    np.testing.assert_allclose(losses(resumed), losses(whole)[2:], rtol=LOSS_RTOL, atol=0,
                               err_msg="resumed from ep 2 in one process vs one process throughout")
    for (name, layer), (_, ref) in zip(resumed_run.moe, whole_run.moe):
        np.testing.assert_array_equal(layer.expert_bias, ref.expert_bias, err_msg=f"{name} balance bias")
    return losses(resumed).tolist()


def check_hf_moe_parity(out: str, hf_config: str, degrees: dict, hf_balance: tuple = ()) -> list[float]:
    """An MoE ``--hf-config`` (the job's MoE decoder: ``hf_moe``) on the layout ``degrees``
    over this world against the single process, 3 steps, as ``check_moe_parity`` compares
    (``compare_with_reference``); ``hf_balance``: ``TrainConfig.hf_balance``. Returns the
    losses and the validation loss."""
    from tests.train._ranks import tiny_config

    cfg = tiny_config(f"{out}/hf_moe", nproc=get_platform().world_size(), layout=Layout(**degrees), steps=3,
                      eval_every=3, hf_config=hf_config, hf_balance=hf_balance)
    grads = _first_step_gradients(cfg)
    run = setup(cfg)
    rows = train(cfg, write_outputs=False, run=run)
    ref_grads = _first_step_gradients(cfg, reference=True)
    ref_rows = train(cfg, reference=True, write_outputs=False)
    if cfg.model.moe_balance == "aux-free":  # compare_with_reference compares them
        assert all(row["moe_bias_norm"] > 0 for row in rows), rows
    return compare_with_reference(f"--hf-config {cfg.layout.describe()}", grads, run.boxes, ref_grads, rows,
                                  ref_rows)


def check_pretrained_pieces(out: str, hf_config: str, whole: dict[str, np.ndarray], layouts: list[dict]) -> int:
    """Every parameter's piece on this rank equals its box of ``whole`` (the weights of the
    ``--hf-config`` folder) bit for bit, in each layout of ``layouts`` built on the meta
    device and on the host. Returns the pieces checked."""
    from tests.train._ranks import tiny_config

    p = get_platform()
    checked = 0
    for degrees in layouts:
        for init_device in ("meta", "host"):
            layout = Layout(**degrees)
            cfg = tiny_config(f"{out}/{layout.describe()}_{init_device}", nproc=layout.world_size, layout=layout,
                              hf_config=hf_config, init_device=init_device)
            run = setup(cfg)
            assert sorted(run.names) == sorted(whole), run.names
            for name, param in zip(run.names, run.params):
                box = run.boxes[name]
                got = p.to_numpy(local_tensor(param))[tuple(slice(0, n) for n in box.lengths)]
                want = whole[name][tuple(slice(s, s + n) for s, n in zip(box.starts, box.lengths))]
                np.testing.assert_array_equal(got, want, err_msg=f"{degrees} {init_device}: {name} {box}")
                checked += 1
    return checked


def check_hf_moe_run(out: str, hf_config: str, degrees: dict) -> list[float]:
    """An MoE ``--hf-config`` on the layout ``degrees`` (``--pp``, ``--ep-overlap``: the job's
    MoE decoder's layouts) for 3 steps, its checkpoint at the last, against the single
    process on every rank: losses, validation loss and gradient norms (``LOSS_RTOL``) and
    the routing counts exactly. Returns the losses and the validation loss."""
    from tests.train._ranks import tiny_config

    cfg = tiny_config(f"{out}/hf_moe_run", nproc=get_platform().world_size(), layout=Layout(**degrees), steps=3,
                      eval_every=3, hf_config=hf_config)
    rows = train(cfg)
    ref_rows = train(cfg, reference=True, write_outputs=False)
    what = f"--hf-config {cfg.layout.describe()}"
    curve = [*losses(rows).tolist(), rows[-1]["val_loss"]]
    np.testing.assert_allclose(curve, [*losses(ref_rows).tolist(), ref_rows[-1]["val_loss"]], rtol=LOSS_RTOL,
                               atol=0, err_msg=f"{what}: losses vs single process")
    np.testing.assert_allclose([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows], rtol=LOSS_RTOL,
                               atol=0, err_msg=f"{what}: gradient norms vs single process")
    for field in MOE_FIELDS:
        assert [r[field] for r in rows] == [r[field] for r in ref_rows], (what, field)
    # aux-free: the biases move by +-rate on integer loads, the same on every layout
    assert [r.get("moe_bias_norm") for r in rows] == [r.get("moe_bias_norm") for r in ref_rows], what
    return curve
