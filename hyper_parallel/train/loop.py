"""The training loop that runs on every rank.

Per step: this rank's share of the step's batch (``data.rank_batch``), forward and backward
through ``platform.vjp`` (the one backward entry of both frameworks), an AdamW step on the
local parameters, then metrics (rank 0 writes them), validation every ``eval_every`` steps
and a checkpoint every ``checkpoint_every`` steps and at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel import context_parallel_shard
from hyper_parallel.core.dtensor import DeviceMesh
from hyper_parallel.platform import Platform, get_platform
from hyper_parallel.train import checkpoint
from hyper_parallel.train.config import Layout, TrainConfig
from hyper_parallel.train.data import Corpus, rank_batch
from hyper_parallel.train.metrics import PLOT_FILE, MetricsWriter, Progress, plot_losses
from hyper_parallel.train.model import build_model
from hyper_parallel.train.optim import AdamW, lr_at, set_parameter_values
from hyper_parallel.train.parallelize import (build_mesh, context_parallel_mesh, context_parallel_style,
                                              data_parallel_coordinate, parallelize)
from hyper_parallel.train.pipeline import Pipeline, build_pipeline, forward_loss
from hyper_parallel.train.pipeline import train_step as pipeline_train_step

#: validation batches are drawn with this stream id (train: 0), see data.global_batch
VALIDATION_STREAM = 1


@dataclass
class _Run:
    """What one rank holds during a run."""

    p: Platform
    cfg: TrainConfig
    layout: Layout
    mesh: DeviceMesh | None
    model: Any
    params: list[Any]
    optimizer: AdamW
    corpus: Corpus
    rank: int           # rank in the run's world (0 for a single-rank run)
    world: int          # ranks of the run (1 for a single-rank run)
    dp_rank: int
    dp_size: int
    dp_group: Any       # the group of the ranks whose losses are averaged: dp x cp (None for one)
    cp_mesh: DeviceMesh | None  # context_parallel_mesh: 1-D, 2-D for hybrid (None when cp == 1)
    pipe: Pipeline | None = None  # this rank's pipeline stages (None when pp == 1)


def _scalar(p: Platform, value: float) -> Any:
    return p.full((), value, p.dtype("float32"))


def _mean_over_dp(run: _Run, value: float) -> float:
    """The mean of a per-rank loss over the data-parallel and context-parallel ranks
    (all-reduce), so every rank reports the loss of the whole batch. Every rank holds the
    same number of tokens, so the mean of the per-rank means is the global mean."""
    ranks = run.dp_size * run.layout.cp
    if ranks == 1:
        return value
    total = run.p.all_reduce(run.p.from_numpy(np.asarray([value], np.float64)), "sum", group=run.dp_group).wait()
    return float(run.p.to_numpy(total)[0]) / ranks


def _mean_over_last_stage(run: _Run, value: float | None) -> float:
    """With pipeline parallelism: the mean of the last stage's per-rank losses (``value``
    there, ``None`` on the other stages), on every rank: one all-reduce (sum) over the
    world, divided by the ranks of a stage. Every rank holds the same number of tokens."""
    mine = np.asarray([0.0 if value is None else value], np.float64)
    total = run.p.all_reduce(run.p.from_numpy(mine), "sum").wait()
    return float(run.p.to_numpy(total)[0]) / (run.world // run.layout.pp)


def _peak_memory(run: _Run) -> list[int]:
    """Every rank's peak memory (``memory_stats().peak``) in bytes, gathered over the run's world as an
    all-reduce (sum) of one-hot vectors: all-reduce is native on every backend (MindSpore's
    CPU all-gather-into-tensor is emulated), and float64 holds byte counts exactly."""
    mine = float(run.p.memory_stats().peak)
    if run.world == 1:
        return [int(mine)]
    slots = np.zeros(run.world, np.float64)
    slots[run.rank] = mine
    gathered = run.p.all_reduce(run.p.from_numpy(slots), "sum").wait()
    return [int(v) for v in run.p.to_numpy(gathered)]


def _batch_tensors(run: _Run, batch: Any) -> list[Any]:
    """``[tokens, positions, targets]``, each ``[batch / dp, seq / cp]``: with context
    parallelism this rank's sequence shards (``context_parallel_shard``, the layout the
    attention hooks expect), positions included, so RoPE sees the positions it holds.
    The model's loss is then the mean over this rank's tokens."""
    p = run.p
    tensors = [p.from_numpy(batch.tokens), p.from_numpy(batch.positions), p.from_numpy(batch.targets)]
    if run.cp_mesh is None:
        return tensors
    return context_parallel_shard(tensors, [1, 1, 1], run.cp_mesh,
                                  load_balance=context_parallel_style(run.layout).load_balance)


def _train_step(run: _Run, step: int) -> float:
    cfg, p = run.cfg, run.p
    batch = rank_batch(run.corpus.train, cfg.seed, step, cfg.batch_size, cfg.seq_len, run.dp_rank, run.dp_size)
    lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)
    if run.pipe is not None:  # see [Note: pipeline gradients and loss]
        local = pipeline_train_step(run.pipe, _batch_tensors(run, batch))
        run.optimizer.step(run.pipe.gradients(), lr)
        return _mean_over_last_stage(run, local)
    loss, backward = p.vjp(run.model, _batch_tensors(run, batch), run.params)
    _, grads = backward([_scalar(p, 1.0)])
    run.optimizer.step(grads, lr)
    return _mean_over_dp(run, float(p.to_numpy(loss)))


def _validation_loss(run: _Run) -> float:
    cfg, p = run.cfg, run.p
    losses = []
    with p.no_grad():
        for index in range(cfg.eval_batches):
            batch = rank_batch(run.corpus.validation, cfg.seed, index, cfg.batch_size, cfg.seq_len, run.dp_rank,
                               run.dp_size, stream_id=VALIDATION_STREAM)
            if run.pipe is not None:
                losses.append(forward_loss(run.pipe, _batch_tensors(run, batch), cfg.model.dim))
            else:
                losses.append(float(p.to_numpy(run.model(*_batch_tensors(run, batch)))))
    if run.pipe is not None:
        return _mean_over_last_stage(run, None if losses[0] is None else float(np.mean(losses)))
    return _mean_over_dp(run, float(np.mean(losses)))


def _checkpoint_arrays(run: _Run) -> dict[str, np.ndarray]:
    arrays = {f"param.{i}": run.p.to_numpy(param) for i, param in enumerate(run.params)}
    arrays.update({f"optim.{key}": value for key, value in run.optimizer.state_arrays().items()})
    return arrays


def _restore(run: _Run, loaded: checkpoint.Loaded) -> None:
    set_parameter_values(run.p, run.params, [loaded.arrays[f"param.{i}"] for i in range(len(run.params))])
    run.optimizer.load_state_arrays({key[len("optim."):]: value for key, value in loaded.arrays.items()
                                     if key.startswith("optim.")})


def _layout_record(run: _Run) -> dict[str, Any]:
    return layout_record(run.cfg, run.layout)


def layout_record(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """What a checkpoint's shards depend on: the degrees and the model's sizes."""
    record: dict[str, Any] = {"degrees": layout.degrees(), "model": cfg.model_name, "dim": cfg.model.dim,
                              "n_layers": cfg.model.n_layers}
    if layout.pp > 1:  # the stages (and so each rank's parameters) depend on the schedule too
        record["pipeline_stages"] = layout.num_stages
    return record


def setup(cfg: TrainConfig, reference: bool = False) -> _Run:
    """Build this rank's model, optimizer and data for ``cfg`` (collective when the layout
    has more than one rank). ``reference``: ignore the layout and run on this rank alone
    (the single-process reference of ``--check-parity`` and of the tests)."""
    p = get_platform()
    layout = Layout() if reference else cfg.layout
    mesh = build_mesh(p, layout)
    rank, world = (0, 1) if mesh is None else (p.rank(), p.world_size())
    pipe = None
    # the attention hooks and the loader's sequence shards use this one mesh
    cp_mesh = context_parallel_mesh(mesh, layout)
    if layout.pp > 1:
        assert mesh is not None
        pipe = build_pipeline(p, cfg, build_model(p, cfg.model, cfg.seed), mesh, cp_mesh)
        model, params = pipe.modules, pipe.parameters()
    else:
        # the reference runs without activation checkpointing: it must not change the math
        model = parallelize(build_model(p, cfg.model, cfg.seed), mesh, layout, cp_mesh,
                            activation_checkpointing=cfg.activation_checkpointing and not reference)
        params = [param for _, param in p.named_parameters(model)]
    dp_rank, dp_size = data_parallel_coordinate(mesh)
    # a collective that creates a group: every rank makes it, even when it is not needed
    dp_group = (mesh["dp_replicate", "dp_shard", "cp"].flatten("dp_cp").get_group()
                if mesh is not None and dp_size * layout.cp > 1 else None)
    corpus = Corpus.load(cfg.data, cfg.seq_len + 1)
    optimizer = AdamW(p, params, cfg.lr, cfg.weight_decay)
    return _Run(p, cfg, layout, mesh, model, params, optimizer, corpus, rank, world, dp_rank, dp_size, dp_group,
                cp_mesh, pipe)


def train(cfg: TrainConfig, reference: bool = False, write_outputs: bool = True,
          run: _Run | None = None) -> list[dict[str, Any]]:
    """Run ``cfg`` on this rank and return the metrics rows of the steps it ran (the same
    list on every rank).

    Rank 0 writes ``<out>/metrics.jsonl``, shows the progress bar (``cfg.progress``) and
    plots ``<out>/loss.png`` when ``write_outputs``; every rank writes its checkpoint shard.
    With ``cfg.resume`` the run continues from the newest complete checkpoint, bit-identical
    to a run that was never interrupted (see ``data``'s note on deterministic batches).
    ``run``: what ``setup(cfg, reference)`` returned, if the caller already built it.
    """
    run = setup(cfg, reference) if run is None else run
    p = run.p
    start = 0
    ckpt_root = cfg.checkpoint_path
    if cfg.resume:
        loaded = checkpoint.load_latest(ckpt_root, _layout_record(run), run.world, run.rank)
        if loaded is not None:
            _restore(run, loaded)
            start = loaded.step
    leader = run.rank == 0 and write_outputs
    writer = MetricsWriter(cfg.run_dir, start) if leader else None
    progress = Progress(cfg.steps, start, leader and cfg.progress,
                        f"{p.name} {run.layout.describe()} {cfg.model_name}")
    rows: list[dict[str, Any]] = []
    tokens_per_step = cfg.batch_size * cfg.seq_len
    try:
        for step in range(start + 1, cfg.steps + 1):
            began = time.perf_counter()
            loss = _train_step(run, step)
            elapsed = time.perf_counter() - began
            row: dict[str, Any] = {"step": step, "loss": loss, "lr": lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps),
                                   "tokens_per_s": tokens_per_step / elapsed, "step_time_s": elapsed,
                                   "peak_memory_bytes": _peak_memory(run)}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                row["val_loss"] = _validation_loss(run)
            rows.append(row)
            if writer is not None:
                writer.write(row)
            progress.update(row)
            if write_outputs and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps):
                checkpoint.save(p, ckpt_root, step, _checkpoint_arrays(run), _layout_record(run), run.world, run.rank)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
    if leader and rows:
        from hyper_parallel.train.metrics import read_metrics

        plot_losses(read_metrics(writer.path), cfg.run_dir / PLOT_FILE,
                    f"hyper-parallel train: {cfg.model_name}, {run.layout.describe()}, {p.name}")
    return rows
