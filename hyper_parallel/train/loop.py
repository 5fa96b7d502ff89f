"""The training loop that runs on every rank.

Per step: this rank's share of the step's batch (``data.rank_batch``), forward and backward
through ``platform.vjp`` (the one backward entry of both frameworks), an AdamW step on the
local parameters, then metrics (rank 0 writes them), validation every ``eval_every`` steps
and a checkpoint every ``checkpoint_every`` steps and at the end.

Checkpoints hold each rank's unpadded pieces of the parameters and of AdamW's moments
under the decoder's parameter names, with their boxes in the global tensors
(``checkpoint_pieces``; ``checkpoint``'s notes), so ``--resume`` continues in any layout of
the same model: the same layout bit-identically, another one after resharding (each rank
reads the pieces overlapping its own; rank 0 prints that it reshards). The step is the
data position: batches depend only on ``(seed, step)`` (``data``).
"""

from __future__ import annotations

import contextlib

import secrets
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.core.context_parallel import context_parallel_shard
from hyper_parallel.core.dtensor import DeviceMesh
from hyper_parallel.core.fully_shard import Box, HSDPModule, local_boxes
from hyper_parallel.platform import Platform, get_platform
from hyper_parallel.train import checkpoint
from hyper_parallel.train.checkpoint_async import AsyncCheckpointer
from hyper_parallel.train.compile import apply_compile, check_compile_layout
from hyper_parallel.train.config import Layout, TrainConfig
from hyper_parallel.train.data import VALIDATION_STREAM, Batch, Corpus, rank_batch
from hyper_parallel.train.hf_weights import pretrained_source
from hyper_parallel.train.metrics import PLOT_FILE, ExtraLoggers, MetricsWriter, Progress, plot_losses
from hyper_parallel.train.model import build_model, initial_pieces, materialize_model
from hyper_parallel.train.moe_model import balance_step, moe_layers
from hyper_parallel.train.optim import AdamW, local_tensor, lr_at
from hyper_parallel.train.parallelize import (build_mesh, context_parallel_mesh, context_parallel_style,
                                              data_parallel_coordinate, parallelize)
from hyper_parallel.train.grad_norm import GlobalGradNorm, clip_coefficient
from hyper_parallel.train.pipeline import Pipeline, build_pipeline, forward_loss
from hyper_parallel.train.pipeline import train_step as pipeline_train_step
from hyper_parallel.train.precision import LossScaler, mixed_precision_policy, resolve_dtype
from hyper_parallel.train.preflight import no_checkpoint_message
from hyper_parallel.train.records import data_record, layout_record, model_record



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
    names: list[str] = field(default_factory=list)  # the decoder's name of each entry of params
    boxes: dict[str, Box] = field(default_factory=dict)  # name -> this rank's box (local_boxes)
    grad_norm: GlobalGradNorm | None = None  # the global gradient norm of params (see grad_norm.py)
    dtype: str = "fp32"  # --dtype, resolved (precision.resolve_dtype)
    scaler: LossScaler = field(default_factory=lambda: LossScaler(enabled=False))  # fp16: [Note: dynamic loss scaling]
    sync_units: list[Any] = field(default_factory=list)  # the fully_shard units (--grad-accum turns their sync off)
    moe: list[tuple[str, Any]] = field(default_factory=list)  # this rank's MoE sublayers (moe_model.moe_layers)
    balance_group: Any = None  # the ranks balance_step sums the routing counts over (None: this rank alone)


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


def _microbatches(batch: Batch, n: int) -> list[Batch]:
    """``batch`` (this rank's share) as ``n`` equal microbatches of consecutive sequences
    (``TrainConfig`` checks that ``n`` divides it)."""
    size = batch.tokens.shape[0] // n
    return [Batch(batch.tokens[i * size:(i + 1) * size], batch.targets[i * size:(i + 1) * size],
                  batch.positions[i * size:(i + 1) * size]) for i in range(n)]


def _accumulate(run: _Run, batch: Batch) -> tuple[float, list[Any]]:
    """Forward and backward of ``--grad-accum`` microbatches of ``batch``: this rank's mean
    loss and the gradients of the mean loss times the loss scale, summed over the
    microbatches (each backward is seeded with ``scale / n``; torch also sums them into
    ``.grad``). Every fully_shard unit reduces only in the last backward: the ones
    before accumulate their full gradients locally, unreduced (FSDP2's
    ``set_requires_gradient_sync(False)``), so a step issues one reduce-scatter per unit
    whatever ``n``."""
    p, n = run.p, run.cfg.grad_accum
    seed = _scalar(p, run.scaler.scale / n)
    loss_sum, total = 0.0, None
    for i, micro in enumerate(_microbatches(batch, n) if n > 1 else [batch]):
        if n > 1:
            for unit in run.sync_units:
                unit.set_requires_gradient_sync(i == n - 1, recurse=False)
        loss, backward = p.vjp(run.model, _batch_tensors(run, micro), run.params)
        _, grads = backward([seed])
        loss_sum += float(p.to_numpy(loss))
        total = list(grads) if total is None else [a + b for a, b in zip(total, grads)]
    assert total is not None
    return loss_sum / n, total


def _skip_step(run: _Run, grads: list[Any]) -> None:
    """Drop this step's gradients without an update (a float16 overflow): torch keeps them
    in ``.grad`` (``Optimizer.gradients``), which the next backward would add to, so they
    are set to zero in place (an assignment: zero times inf is nan); MindSpore keeps none."""
    with run.p.no_grad():
        for g in run.optimizer.gradients(grads):
            g[...] = 0


def _train_step(run: _Run, step: int) -> tuple[float, float]:
    """One step; returns the mean loss and the global gradient norm before clipping (inf
    when a float16 step overflowed and was skipped: [Note: dynamic loss scaling])."""
    cfg = run.cfg
    batch = rank_batch(run.corpus.train, cfg.seed, step, cfg.batch_size, cfg.seq_len, run.dp_rank, run.dp_size)
    lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.lr_schedule, cfg.min_lr)
    scale = run.scaler.scale
    if run.pipe is not None:  # see [Note: pipeline gradients and loss]
        local = pipeline_train_step(run.pipe, _batch_tensors(run, batch), scale)
        grads = run.pipe.gradients()
    else:
        local_loss, grads = _accumulate(run, batch)
    assert run.grad_norm is not None
    norm = run.grad_norm(run.optimizer.gradients(grads)) / scale
    if run.scaler.update(norm * scale):
        # unscaled and clipped in one factor (exactly 1 / 1 without scaling or clipping)
        run.optimizer.step(grads, lr, clip_coefficient(norm, cfg.max_norm) / scale)
    else:
        _skip_step(run, grads)
    if run.pipe is not None:
        return _mean_over_last_stage(run, local), norm
    return _mean_over_dp(run, local_loss), norm


def _validation_loss(run: _Run) -> float:
    cfg, p = run.cfg, run.p
    losses = []
    with p.no_grad():
        for index in range(cfg.eval_batches):
            batch = rank_batch(run.corpus.validation, cfg.seed, index, cfg.batch_size, cfg.seq_len, run.dp_rank,
                               run.dp_size, stream_id=VALIDATION_STREAM)
            if run.pipe is not None:
                losses.append(forward_loss(run.pipe, _batch_tensors(run, batch)))
            else:
                losses.append(float(p.to_numpy(run.model(*_batch_tensors(run, batch)))))
    if run.pipe is not None:
        return _mean_over_last_stage(run, None if losses[0] is None else float(np.mean(losses)))
    return _mean_over_dp(run, float(np.mean(losses)))


#: what a checkpoint holds per parameter: the values and AdamW's two moments (its shape)
CHECKPOINT_KINDS = ("param", "exp_avg", "exp_avg_sq")


def checkpoint_pieces(run: _Run, state: dict[str, np.ndarray]) -> dict[str, checkpoint.Piece]:
    """``{"<kind>/<fqn>": Piece}``: this rank's pieces of every parameter and of its AdamW
    moments (``state``: ``optimizer.state_arrays()``; see ``[Note:
    layout-independent pieces]`` in ``checkpoint``)."""
    pieces = {}
    for i, (name, param) in enumerate(zip(run.names, run.params)):
        box = run.boxes[name]
        locals_ = {"param": run.p.to_numpy(local_tensor(param)), "exp_avg": state.get(f"exp_avg.{i}"),
                   "exp_avg_sq": state.get(f"exp_avg_sq.{i}")}
        for kind, local in locals_.items():
            if local is not None:  # torch has no moments for a parameter that never had a gradient
                pieces[f"{kind}/{name}"] = checkpoint.Piece(box, local)
    for key, layer in _moe_bias_keys(run).items():  # replicated: the lowest rank holding it writes it
        pieces[key] = checkpoint.Piece(_whole_box(layer.expert_bias), layer.expert_bias.copy())
    return pieces


def _moe_bias_keys(run: _Run) -> dict[str, Any]:
    """``{"moe_bias/<layer>.expert_bias": layer}``: each MoE layer's aux-free balance bias
    (``moe_model``; host float32 ``[experts]``, the same on every rank), saved and restored
    beside the parameters, so that a resumed run routes as the uninterrupted one."""
    return {f"moe_bias/{name}.expert_bias": layer for name, layer in run.moe}


def _whole_box(value: np.ndarray) -> Box:
    return Box(value.shape, (0,) * value.ndim, value.shape)


def save_checkpoint(run: _Run, root: Path, step: int, saver: AsyncCheckpointer | None = None) -> Path:
    """Write the checkpoint of ``step`` under ``root`` (collective: barriers), with the
    layout, the model, the data stream and the optimizer step in its index; returns its
    folder. ``saver``: start it in the background instead (``checkpoint_async``; the
    state is copied to host memory here, the folder appears once the write completes)."""
    state = run.optimizer.state_arrays()
    meta = {"layout": layout_record(run.cfg, run.layout), "model": model_record(run.cfg),
            "data": data_record(run.cfg), "optimizer_step": int(state["step"]), "run": run.cfg.run_id}
    pieces = checkpoint_pieces(run, state)  # host copies: training goes on without touching them
    keep = run.cfg.keep_checkpoints  # [Note: retention] in checkpoint: only this run's, never this one
    if saver is not None:
        saver.save(root, step, pieces, meta, keep=keep)
        return root / f"step_{step:08d}"
    return checkpoint.save(run.p, root, step, pieces, meta, run.world, run.rank, keep=keep)


def load_checkpoint(run: _Run, root: Path) -> checkpoint.Loaded | None:
    """This rank's pieces of the newest complete checkpoint under ``root`` (any layout,
    either framework, either format; ``None`` if there is none). Collective: one
    all-reduce per checkpoint examined (``checkpoint``'s [Note: shared verification])."""
    boxes = {f"{kind}/{name}": run.boxes[name] for name in run.names for kind in CHECKPOINT_KINDS}
    boxes.update({key: _whole_box(layer.expert_bias) for key, layer in _moe_bias_keys(run).items()})
    return checkpoint.load_latest(run.p, root, boxes, layout_record(run.cfg, run.layout), model_record(run.cfg),
                                  run.world, run.rank)


def restore(run: _Run, loaded: checkpoint.Loaded) -> None:
    """Set the parameters and the AdamW state from ``loaded`` (this rank's pieces)."""
    arrays = loaded.arrays
    run.optimizer.load_parameter_values([arrays[f"param/{name}"] for name in run.names])
    state: dict[str, np.ndarray] = {"step": np.asarray(loaded.manifest["optimizer_step"], np.int64)}
    for i, name in enumerate(run.names):
        for kind in ("exp_avg", "exp_avg_sq"):
            if f"{kind}/{name}" in arrays:
                state[f"{kind}.{i}"] = arrays[f"{kind}/{name}"]
    run.optimizer.load_state_arrays(state)
    for key, layer in _moe_bias_keys(run).items():
        if key not in arrays:
            raise ValueError(f"--resume: checkpoint {loaded.path} lacks {key}, the balance bias of an MoE layer of this "
                             "run's model; resume with the run that wrote it or start a new --checkpoint-dir")
        layer.expert_bias[:] = arrays[key]


def setup(cfg: TrainConfig, reference: bool = False) -> _Run:
    """Build this rank's model, optimizer and data for ``cfg`` (collective when the layout
    has more than one rank). ``reference``: ignore the layout and run on this rank alone
    (the single-process reference of ``--check-parity`` and of the tests)."""
    p = get_platform()
    layout = Layout() if reference else cfg.layout
    if cfg.compile and not reference:  # on every rank, before the first collective
        check_compile_layout(p, layout)
    mesh = build_mesh(p, layout)
    rank, world = (0, 1) if mesh is None else (p.rank(), p.world_size())
    pipe = None
    # --dtype (the default by device; float32 with --hf-config: TrainConfig)
    dtype = resolve_dtype(cfg.dtype, p.device_type) if not cfg.hf_module else "fp32"
    mp_policy = mixed_precision_policy(dtype)
    # the attention hooks and the loader's sequence shards use this one mesh
    cp_mesh = context_parallel_mesh(mesh, layout)
    # --init-device meta: built and parallelized on the meta device, then each rank computes
    # its pieces alone (materialize_model); host: whole, cut, pieces written in place below
    meta = cfg.build_on_meta
    scope = p.module_types().meta_device() if meta else contextlib.nullcontext()
    # an MoE --hf-config folder's weights in place of the seed's draw (None: the draw)
    source = None if cfg.hf_module else pretrained_source(cfg.hf_config, cfg.model)
    if layout.pp > 1:
        assert mesh is not None
        if cfg.hf_module:
            from hyper_parallel.train.hf_model import load_hf_model

            whole = load_hf_model(cfg.hf_config, cfg.seed)
            pipe = build_pipeline(p, cfg, whole, mesh, cp_mesh)
        else:
            with scope:
                whole = build_model(p, cfg.model, cfg.seed, values=False, meta=meta)
                pipe = build_pipeline(p, cfg, whole, mesh, cp_mesh, mp_policy)
            if meta:
                materialize_model(p, cfg.model, cfg.seed, pipe.modules, source)
        model, params = pipe.modules, pipe.parameters()
        # the stages keep the decoder's parameter names (model.build_stage), in pipe.parameters() order
        names = [name for module in pipe.modules for name, _ in p.named_parameters(module)]
        boxes = {name: box for module in pipe.modules for name, box in local_boxes(module).items()}
    elif cfg.hf_module:
        from hyper_parallel.train.hf_model import build_hf_model

        model = build_hf_model(p, cfg.hf_config, cfg.seed, mesh, layout, cp_mesh,
                               activation_checkpointing=cfg.activation_checkpointing and not reference)
        # the Hugging Face names (checkpoints, norms), without the wrapper's prefix
        names, params = (list(items) for items in zip(*p.named_parameters(model.hf)))
        boxes = local_boxes(model.hf)
    else:
        # the reference runs without activation checkpointing: it must not change the math
        with scope:
            model = parallelize(build_model(p, cfg.model, cfg.seed, values=False, meta=meta), mesh, layout,
                                cp_mesh, activation_checkpointing=cfg.activation_checkpointing and not reference,
                                mp_policy=mp_policy)
        if meta:
            materialize_model(p, cfg.model, cfg.seed, [model], source)
        if cfg.compile and not reference:  # the reference runs eagerly: --check-parity checks the compiler
            apply_compile(p, model)
        names, params = (list(items) for items in zip(*p.named_parameters(model)))
        boxes = local_boxes(model)
    dp_rank, dp_size = data_parallel_coordinate(mesh)
    # a collective that creates a group: every rank makes it, even when it is not needed
    dp_group = (mesh["dp_replicate", "dp_shard", "cp"].flatten("dp_cp").get_group()
                if mesh is not None and dp_size * layout.cp > 1 else None)
    corpus = Corpus.load(cfg.data, cfg.seq_len + 1)
    optimizer = AdamW(p, params, cfg.lr, cfg.weight_decay)
    if not cfg.hf_module and not meta:
        # each rank its pieces, in place: [Note: the job's initial weights]
        optimizer.load_parameter_values(initial_pieces(cfg.model, cfg.seed, boxes, names, source))
    grad_norm = GlobalGradNorm(p, names, boxes, world)  # collective when world > 1
    sync_units = [module for _, module in p.named_modules(model) if isinstance(module, HSDPModule)] \
        if pipe is None else []
    moe: list[tuple[str, Any]] = []
    balance_group = dp_group
    if cfg.model.moe_experts:  # the job's MoE decoder (hf_module: dense)
        moe = moe_layers(p, model) if pipe is None else [layer for module in pipe.modules
                                                         for layer in moe_layers(p, module)]
        if pipe is not None:  # [Note: MoE stages] in pipeline.py: every stage's layers in one all-reduce
            assert mesh is not None
            balance_group = mesh["pp", "dp_replicate", "dp_shard", "cp"].flatten("pp_dp_cp").get_group()
    return _Run(p, cfg, layout, mesh, model, params, optimizer, corpus, rank, world, dp_rank, dp_size, dp_group,
                cp_mesh, pipe, names, boxes, grad_norm, dtype, LossScaler(enabled=dtype == "fp16"), sync_units, moe,
                balance_group)


def _announce(run: _Run, loaded: checkpoint.Loaded) -> None:
    """Rank 0 names the checkpoint it continues from and says when the resume reshards;
    every rank warns when the data stream changes."""
    message = checkpoint.reshard_message(loaded.path, loaded.manifest, layout_record(run.cfg, run.layout), run.world)
    if run.rank == 0:
        print(f"--resume: continuing from checkpoint {loaded.path} (step {loaded.step})", file=sys.stderr, flush=True)
        if message is not None:
            print(message, file=sys.stderr, flush=True)
    saved, now = loaded.manifest.get("data"), data_record(run.cfg)
    if saved is not None and saved != now:
        warnings.warn(f"--resume: checkpoint {loaded.path} was written by a run with {saved}, this run has {now}: "
                      "the batches after the resume differ from the interrupted run's", RuntimeWarning, stacklevel=3)


def _agree_run_id(run: _Run) -> str:
    """A run id every rank agrees on: rank 0's random 48 bits (exact in float64), summed by
    one all-reduce over the ranks (the others add zero). Collective when ``world > 1``."""
    drawn = np.zeros(1, np.float64)
    if run.rank == 0:
        drawn[0] = secrets.randbits(48)
    if run.world > 1:
        drawn = run.p.to_numpy(run.p.all_reduce(run.p.from_numpy(drawn), "sum").wait())
    return f"{int(drawn[0]):012x}"


def train(cfg: TrainConfig, reference: bool = False, write_outputs: bool = True,
          run: _Run | None = None) -> list[dict[str, Any]]:
    """Run ``cfg`` on this rank and return the metrics rows of the steps it ran (the same
    list on every rank).

    Rank 0 writes ``<out>/metrics.jsonl``, shows the progress bar (``cfg.progress``) and
    plots ``<out>/loss.png`` when ``write_outputs``; every rank writes its checkpoint shard
    (in the background with ``cfg.async_checkpoint``; the last one is complete on return).
    With ``cfg.resume`` the run continues from the newest complete checkpoint, bit-identical
    to a run that was never interrupted (see ``data``'s note on deterministic batches).
    ``run``: what ``setup(cfg, reference)`` returned, if the caller already built it.
    """
    run = setup(cfg, reference) if run is None else run
    p = run.p
    start = 0
    ckpt_root = cfg.checkpoint_path
    if cfg.resume:
        loaded = load_checkpoint(run, ckpt_root)
        if loaded is None:
            # the command line refuses this before any rank starts (preflight.check_resume); a
            # rank gets here when the folder is not shared with it, or lost its checkpoints since
            raise ValueError(f"rank {run.rank}: {no_checkpoint_message(cfg)}")
        _announce(run, loaded)
        restore(run, loaded)
        start = loaded.step
        # the resumed run continues the checkpoint's run: its retention covers those checkpoints
        run_id = str(loaded.manifest.get("run") or cfg.run_id)
    else:
        run_id = cfg.run_id
    if not run_id and write_outputs:  # inside torchrun/msrun, or resuming a checkpoint without an id
        run_id = _agree_run_id(run)
    if run_id != run.cfg.run_id:
        run.cfg = run.cfg.replace(run_id=run_id)
    leader = run.rank == 0 and write_outputs
    writer = MetricsWriter(cfg.run_dir, start) if leader else None
    extra = ExtraLoggers(cfg.log, cfg.run_dir, cfg.to_dict(), cfg.run_dir.name) if leader and cfg.log else None
    progress = Progress(cfg.steps, start, leader and cfg.progress,
                        f"{p.name} {run.layout.describe()} {cfg.model_name} {run.dtype}")
    rows: list[dict[str, Any]] = []
    # [Note: asynchronous save] in checkpoint_async: barriers on this thread, files in the background
    saver = AsyncCheckpointer(p, run.world, run.rank) if cfg.async_checkpoint and write_outputs else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    try:
        for step in range(start + 1, cfg.steps + 1):
            began = time.perf_counter()
            loss, grad_norm = _train_step(run, step)
            elapsed = time.perf_counter() - began
            row: dict[str, Any] = {"step": step, "loss": loss, "grad_norm": grad_norm,
                                   "lr": lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.lr_schedule, cfg.min_lr),
                                   "tokens_per_s": tokens_per_step / elapsed, "step_time_s": elapsed,
                                   "peak_memory_bytes": _peak_memory(run), "dtype": run.dtype}
            if run.scaler.enabled:  # the scale the next step's backward is seeded with
                row["loss_scale"] = run.scaler.scale
            # every rank of an MoE model, also a pipeline rank whose stages hold no MoE block (the
            # all-reduce spans every stage); before validation: it routes with the updated biases
            if cfg.model.moe_experts:
                row.update(balance_step(p, run.moe, run.balance_group, cfg.model).row())
            if step % cfg.eval_every == 0 or step == cfg.steps:
                row["val_loss"] = _validation_loss(run)
            rows.append(row)
            if writer is not None:
                writer.write(row)
            if extra is not None:
                extra.write(row)
            progress.update(row)
            if write_outputs and cfg.checkpoint_due(step):
                save_checkpoint(run, ckpt_root, step, saver)
        if saver is not None:
            saver.wait()  # the last checkpoint is complete before the run returns
    finally:
        progress.close()
        if writer is not None:
            writer.close()
        if extra is not None:
            extra.close()
    if leader and rows:
        from hyper_parallel.train.metrics import read_metrics

        plot_losses(read_metrics(writer.path), cfg.run_dir / PLOT_FILE,
                    f"hyper-parallel train: {cfg.model_name}, {run.layout.describe()}, {p.name}")
    return rows
