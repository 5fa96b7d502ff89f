"""Rank functions of ``tests/train/test_layout_parity.py`` (importable by module path, as
the harness requires): many layouts per call, because a MindSpore multi-rank call costs
seconds and each worker ~430 MB."""

from __future__ import annotations

from fnmatch import fnmatch

import numpy as np

from hyper_parallel.core.dtensor.placement_types import chunk_bounds
from hyper_parallel.core.tensor_parallel import ColwiseParallel, RowwiseParallel
from hyper_parallel.platform import get_platform
from hyper_parallel.train.config import Layout, TrainConfig
from hyper_parallel.train.loop import setup, train
from hyper_parallel.train.model import parameter_shapes
from hyper_parallel.train.parallelize import TP_PLAN
from tests.train._ranks import local_shapes, losses, tiny_config

#: Relative tolerance of torch against MindSpore on the same seed, data and layout.
#: Both frameworks start from bit-identical float32 weights (one numpy generator) and see
#: the same batches; the layouts' collectives and their order are the same code (core),
#: so only the rank-local kernels differ:
#:
#: - MindSpore's CPU ``exp`` is ~2.7e-6 relative-approximate. The cross-entropy is
#:   ``log(sum(exp(logit - max))) - logit``: a relative error e on every term moves the log
#:   by at most e, 2.7e-6 absolute, i.e. 5e-7 relative to a loss of 5.5 nats. The exps of
#:   the attention softmax and of SiLU perturb activations by the same relative order,
#:   which the next GEMMs carry through.
#: - GEMM accumulation orders differ: a float32 dot product of K <= 64 terms is off by
#:   ~sqrt(K) x 2^-24 = 5e-7 relative, typically.
#:
#: So the first loss differs by ~1e-6 relative at most (measured 3.9-4.1e-7 on every layout).
#: The gradients inherit ~1e-6 relative differences; AdamW's update ``lr * m / sqrt(v)``
#: does not depend on a gradient's scale, so the parameters move apart by ~1e-6 of a step
#: per step (a near-zero gradient entry whose sign flips moves more, but touches the loss
#: only to second order), and a few steps keep the losses within the first step's
#: difference (measured 4-5e-7 at every step and for the validation losses, at lr 3e-3;
#: the pipeline launches of test_train.py at lr 1e-2 stay within 1e-5 too). 1e-5 leaves a
#: 10x margin over the bound for another CPU's kernel paths.
CROSS_FRAMEWORK_RTOL = 1e-5

#: Steps of every parity run: the first AdamW steps (warmup 2) and one more, long enough
#: for a wrong gradient to show in the loss, short enough for MindSpore's CPU ranks.
STEPS = 3


def layout_config(out: str, degrees: dict, **changes: object) -> TrainConfig:
    """The ``tiny`` run of ``degrees`` (``Layout`` keyword arguments) on its world, three
    steps, one validation loss at the end: the configuration both frameworks run, in
    ``<out>/<degrees>``. ``changes``: other ``TrainConfig`` fields (``platform=`` outside a rank)."""
    layout = Layout(**degrees)
    name = "_".join(f"{key}{value}" for key, value in sorted(degrees.items()))
    return tiny_config(f"{out}/{name}", nproc=layout.world_size, layout=layout, steps=STEPS, eval_every=STEPS,
                       **changes)


def local_shape(name: str, shape: tuple[int, ...], layout: Layout, rank: int) -> tuple[int, ...]:
    """The shape of parameter ``name`` (global ``shape``) on ``rank`` of ``layout`` (no
    pipeline): ``TP_PLAN`` splits colwise weights ``[out, in]`` by rows and rowwise ones by
    columns over ``tp``, then fully_shard keeps the rank's chunk of the rows over
    ``dp_shard x cp`` (``dp_replicate`` replicates)."""
    dims = list(shape)
    module = name.rsplit(".", 1)[0]
    for pattern, style in TP_PLAN.items():
        if fnmatch(module, pattern) and layout.tp > 1:
            if type(style) is ColwiseParallel:
                dims[0] //= layout.tp
            elif type(style) is RowwiseParallel:
                dims[1] //= layout.tp
            else:
                raise AssertionError(f"{name}: TP style {style!r} unknown to this test")
    coords = dict(zip(Layout.AXES, np.unravel_index(rank, tuple(layout.degrees().values()))))
    shard = int(coords["dp_shard"]) * layout.cp + int(coords["cp"])
    dims[0] = chunk_bounds(dims[0], layout.dp_shard * layout.cp, shard)[1]
    return tuple(dims)


def layout_losses(out: str, layouts: list[dict]) -> list[list[float]]:
    """Each layout's ``[losses of the steps..., validation loss]`` on this rank (the same on
    every rank: losses are averaged over the data- and context-parallel ranks, pipelines
    give the last stage's loss to every rank), one layout after the other on this world.
    For the torch vs MindSpore comparison: nothing is compared here."""
    curves = []
    for degrees in layouts:
        cfg = layout_config(out, degrees)
        rows = train(cfg, write_outputs=False)
        curves.append([*losses(rows).tolist(), rows[-1]["val_loss"]])
    return curves


def check_against_reference(out: str, layouts: list[dict]) -> list[list[float]]:
    """Each layout (no pipeline) on this world against the single-process reference on the
    same seed and data: every parameter is this rank's shard (``local_shape``), and the
    losses and the validation loss match the reference's. Returns each layout's
    ``[losses..., validation loss]``.

    Tolerance: float32, 2e-5 relative over three steps, as for the layouts of
    ``tests/train/_ranks.py`` (and reasoned there): tensor parallelism's partial sums, the
    data- and context-parallel gradient averages (reduce-scatter, all-reduce over
    replicas) and the context-parallel split softmax (partial results merged by their
    log-sum-exp) are the reference's sums in other orders, a few ulps per step; AdamW's
    sign-like first steps can amplify a flipped near-zero gradient a little. All-to-alls
    and all-gathers move values without arithmetic."""
    p = get_platform()
    curves, configs, norms = [], [], []
    for degrees in layouts:
        cfg = layout_config(out, degrees)
        assert cfg.layout.pp == 1 and cfg.layout.world_size == p.world_size(), degrees
        run = setup(cfg)
        shapes = dict(parameter_shapes(cfg.model))
        local = local_shapes(p, run.model, shapes)
        assert sorted(local) == sorted(shapes), sorted(local)
        for name, shape in shapes.items():
            assert local[name] == local_shape(name, shape, cfg.layout, p.rank()), (degrees, name, local[name], shape)
        rows = train(cfg, write_outputs=False, run=run)
        curves.append([*losses(rows).tolist(), rows[-1]["val_loss"]])
        norms.append([row["grad_norm"] for row in rows])
        configs.append(cfg)
    # The reference uses no collectives: rank 0 runs it after every layout's collectives (a
    # rank waiting in a collective for rank 0's reference would time out). It ignores the
    # layout, so one run serves every layout.
    if p.rank() == 0:
        ref_rows = train(configs[0], reference=True, write_outputs=False)
        ref = [*losses(ref_rows).tolist(), ref_rows[-1]["val_loss"]]
        ref_norms = [row["grad_norm"] for row in ref_rows]
        # --max-norm 1.0 (the default) clips these steps: the parity includes clipping
        assert max(ref_norms) > configs[0].max_norm, ref_norms
        for cfg, got, got_norms in zip(configs, curves, norms):
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=0,
                                       err_msg=f"{cfg.layout.describe()} ({cfg.layout.cp_mode}) vs single process "
                                               "(losses, then the validation loss)")
            # the global gradient norm (every rank's pieces, replicas counted once) is the
            # reference's, to the same float32 sums-in-other-orders tolerance
            np.testing.assert_allclose(got_norms, ref_norms, rtol=2e-5, atol=0,
                                       err_msg=f"{cfg.layout.describe()} ({cfg.layout.cp_mode}) vs single process "
                                               "(global gradient norms)")
    return curves


def run_losses(cfg_values: dict) -> list[list[float]]:
    """The run of ``cfg_values`` (``TrainConfig.to_dict()``, any layout of this world) on
    this rank, without writing outputs: ``[losses, validation losses]`` (the same on every
    rank). For the torch vs MindSpore comparison of a run launched on the other framework."""
    rows = train(TrainConfig.from_dict(cfg_values), write_outputs=False)
    return [losses(rows).tolist(), [row["val_loss"] for row in rows if "val_loss" in row]]
