"""The configuration of a ``hyper-parallel train`` run: model sizes, parallel layout and
training settings, as frozen dataclasses validated at construction, before any rank starts.

Every invalid combination raises ``ValueError`` here, in the launching process, with the
argument, the value, the rule and the fix, so that no rank is ever started for a layout
that cannot run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from hyper_parallel.core.pipeline_parallel.schedule_table import SCHEDULES
from hyper_parallel.platform import requested_platform
from hyper_parallel.train.compile import check_compile
from hyper_parallel.train.hf_config import model_config, read_hf_config
from hyper_parallel.train.hf_weights import PretrainedWeights
from hyper_parallel.train.model_config import PRESETS, ModelConfig
from hyper_parallel.train.optim import LR_SCHEDULES
from hyper_parallel.train.precision import resolve_dtype

#: ``--cp-mode`` values (context parallelism: Ulysses all-to-all, ring attention,
#: all-gathered key/value, and the 2-D Ulysses x ring hybrid).
CP_MODES = ("ulysses", "ring", "allgather", "hybrid")

#: The ``ModelConfig`` fields an MoE ``--hf-config`` takes from the command line: how its
#: experts are balanced in training, not its shapes (``TrainConfig.hf_balance``).
HF_BALANCE_FIELDS = ("moe_balance", "moe_aux_loss_coef", "moe_bias_rate")

#: ``--cp-kv-exchange`` values: how ``--cp-mode hybrid`` exchanges key/value shards over
#: its ``cp_kv`` axis (``ContextParallel(kv_exchange=...)``).
CP_KV_EXCHANGES = ("ring", "allgather")

#: ``--pp-schedule`` values: the names of the core's schedule table
#: (``hyper_parallel.core.pipeline_parallel.schedule_table.SCHEDULES``: class, placement,
#: stages per rank of each).
PP_SCHEDULES = tuple(SCHEDULES)

#: ``--init-device`` values: build the model on the framework's meta device and give each
#: rank its pieces only, or whole on the host and cut (``TrainConfig.init_device``).
INIT_DEVICES = ("meta", "host")

#: The schedules with the zero-bubble I/W split of the backward (``weight_grad.py``).
ZERO_BUBBLE_SCHEDULES = tuple(name for name, entry in SCHEDULES.items() if entry.splits_backward)
#: the ``--pp-schedule``s ``--ep-overlap`` runs: those that pair a backward with a forward
#: (``OVERLAP_B_F``: 1F1B and interleaved 1F1B with ``overlap_b_f``, DualPipeV's own pairs)
EP_OVERLAP_SCHEDULES = ("1f1b", "interleaved-1f1b", "dualpipev")

#: Parallel features a layout may need, and whether ``hyper-parallel train`` runs them yet.
#: A layout that needs one that is not wired into the job is refused before any rank starts;
#: the value says why.
LANDED_FEATURES: dict[str, bool] = {
    "tensor parallel (--tp)": True,
    "context parallel (--cp)": True,
    "fully_shard (--dp-shard)": True,
    "HSDP / replicated data parallel (--dp-replicate)": True,
    "pipeline parallel (--pp)": True,
}

#: Why a feature that is not wired into the job yet is refused (shown in the message).
NOT_YET: dict[str, str] = {}


def default_ulysses_degree(cp: int, heads: int, kv_heads: int) -> int | None:
    """The Ulysses degree ``--cp-mode hybrid`` uses when ``--ulysses-degree`` is not given:
    the largest ``u`` with ``1 < u < cp`` that divides ``cp``, ``heads`` and ``kv_heads``
    (the query and key/value heads per tensor-parallel rank), or ``None`` if there is
    none. The largest, because the all-to-all axis is the inner (closest) one and a ring
    of ``cp / u`` ranks takes ``cp / u`` steps."""
    for u in range(cp - 1, 1, -1):
        if cp % u == 0 and heads % u == 0 and kv_heads % u == 0:
            return u
    return None


@dataclass(frozen=True)
class Layout:
    """Parallel degrees. Their product is the number of ranks.

    The mesh axes, outermost first, are ``pp, dp_replicate, dp_shard, cp, tp`` (tensor
    parallelism innermost: its collectives are on the critical path of every layer, so
    its ranks are the closest ones).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    cp_mode: str = "ulysses"
    pp_schedule: str = "1f1b"
    microbatches: int = 1
    #: ``--cp-mode hybrid`` only: ranks of the Ulysses (all-to-all) axis, ``1 < u < cp``
    #: dividing ``cp``; ``None``: derived by ``TrainConfig`` (``default_ulysses_degree``).
    ulysses_degree: int | None = None
    #: ``--cp-mode hybrid`` only: the key/value exchange over the other ``cp / u`` ranks.
    cp_kv_exchange: str = "ring"
    #: ``--ep``: expert-parallel degree, borrowed from the ``dp_shard`` ranks (not a mesh
    #: axis of its own, so not in ``AXES`` nor the world size): each MoE block's routed
    #: experts are sharded over it and tokens are sent to their experts' ranks.
    ep: int = 1
    #: ``--ep-overlap``: run each ``OVERLAP_B_F`` pair of ``--pp-schedule`` (one microbatch's
    #: backward beside the next one's forward) on two threads, the MoE dispatch/combine
    #: all-to-alls of each beside the other's compute ([Note: the overlap in the job] in
    #: ``train/pipeline.py``).
    ep_overlap: bool = False

    AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "microbatches", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}={value!r} must be a positive integer (1 disables that parallelism)")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"--cp-mode={self.cp_mode!r} is not a context-parallel mode; use one of {', '.join(CP_MODES)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"--pp-schedule={self.pp_schedule!r} is not a pipeline schedule; "
                             f"use one of {', '.join(PP_SCHEDULES)}")
        if self.cp_kv_exchange not in CP_KV_EXCHANGES:
            raise ValueError(f"--cp-kv-exchange={self.cp_kv_exchange!r} is not a key/value exchange; use one of "
                             f"{', '.join(CP_KV_EXCHANGES)}")
        if self.cp_mode != "hybrid" and (self.ulysses_degree is not None or self.cp_kv_exchange != "ring"):
            raise ValueError(f"--ulysses-degree and --cp-kv-exchange apply to --cp-mode hybrid only (got --cp-mode "
                             f"{self.cp_mode}); drop them or use --cp-mode hybrid")
        if self.cp_mode == "hybrid" and self.ulysses_degree is not None:
            u = self.ulysses_degree
            if not isinstance(u, int) or not 1 < u < self.cp or self.cp % u:
                raise ValueError(f"--ulysses-degree={u!r} with --cp={self.cp} must divide --cp and lie strictly "
                                 "between 1 and --cp (hybrid splits cp into cp / u key/value ranks x u Ulysses "
                                 "ranks); use --cp-mode ulysses for u = cp, --cp-mode ring|allgather for u = 1")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples of a batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def num_stages(self) -> int:
        """Pipeline stages: ``pp`` x the schedule's stages per rank (the core's table)."""
        return SCHEDULES[self.pp_schedule].num_stages(self.pp)

    def degrees(self) -> dict[str, int]:
        """``{axis: degree}`` in mesh order (outermost first)."""
        return {axis: getattr(self, axis) for axis in self.AXES}

    def describe(self) -> str:
        parts = [f"{axis}={degree}" for axis, degree in self.degrees().items() if degree > 1]
        if self.ep > 1:
            parts.append(f"ep={self.ep} (of dp_shard)")
        if self.ep_overlap:
            parts.append("ep-overlap")
        return " x ".join(parts) if parts else "single rank"

    def missing_features(self) -> list[str]:
        """Features this layout needs that have not landed (see ``LANDED_FEATURES``)."""
        needed = []
        if self.tp > 1:
            needed.append("tensor parallel (--tp)")
        if self.cp > 1:
            needed.append("context parallel (--cp)")
        if self.dp_shard > 1:
            needed.append("fully_shard (--dp-shard)")
        if self.dp_replicate > 1:
            needed.append("HSDP / replicated data parallel (--dp-replicate)")
        if self.pp > 1:
            needed.append("pipeline parallel (--pp)")
        return [name for name in needed if not LANDED_FEATURES[name]]


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        platform: ``"torch"`` or ``"mindspore"`` (or a full backend name, ``"torch-cuda"``); default:
            ``platform.requested_platform()`` (the selection rule: the environment variable, the
            framework imported, the only one installed, else MindSpore).
        nproc: ranks on this machine (``Layout.world_size`` must equal it).
        model: the model sizes (a preset or explicit).
        layout: the parallel degrees.
        seq_len: tokens per sequence.
        batch_size: sequences per optimizer step, over all data-parallel ranks together.
        steps: optimizer steps to reach (a resumed run continues up to this step).
        lr: peak learning rate (linear warmup over ``warmup_steps``, then ``lr_schedule``).
        weight_decay: AdamW's decoupled weight decay, on every parameter.
        lr_schedule: after warmup: ``cosine``, ``linear``, ``constant`` or ``wsd``
            (``optim.LR_SCHEDULES``), decaying to ``min_lr``.
        min_lr: the learning rate the schedule ends at (default ``lr / 10``).
        seed: seeds the initial weights (numpy's Philox, below 2**64) and the batch sampling.
        eval_every: validation loss every this many steps (and at the last step).
        eval_batches: batches averaged into one validation loss.
        checkpoint_every: checkpoint every this many steps and at the last step (0: only
            at the last step; ``checkpoint_due``).
        checkpoint_dir: where checkpoints go (``None``: ``<out>/checkpoints``).
        resume: continue from the newest complete checkpoint in ``checkpoint_dir``.
        keep_checkpoints: this run's checkpoints kept, the newest (0: all); older ones of the
            run are deleted after each save, never another run's (``checkpoint``'s [Note:
            retention]). Default ``checkpoint.KEEP``.
        run_id: recorded in every checkpoint of the run (``run_folder.new_run_id``). A
            resumed run takes over its checkpoint's; ``""`` otherwise: the ranks agree on one.
        async_checkpoint: write checkpoints in the background while training continues
            (``checkpoint_async``: the state is copied to host memory at the step, at most
            one save in flight, the last one complete before the run returns).
        out: the run folder (metrics, plot, logs).
        data: files or folders of text (empty: the running interpreter's standard library).
        activation_checkpointing: recompute each decoder block's activations in the
            backward instead of keeping them (step 3 of the layout chain; with ``--pp`` in
            every stage, recomputed inside each microbatch's backward).
        hf_config: a Hugging Face ``config.json`` or model folder: train that model
            (``train/hf_model.py``) instead of the job's decoder; ``model`` then holds its
            sizes (``hf_config.model_config``). A mixture of experts that the job's MoE
            decoder computes exactly (Mixtral, Qwen3-MoE: ``hf_moe``) trains as that decoder
            (``hf_module`` false), on either framework.
        dtype: the compute dtype, ``fp32``, ``bf16`` or ``fp16`` (``precision.DTYPES``; the
            parameters and AdamW's state stay float32, gradients are reduced in float32,
            fp16 scales the loss: [Note: the job's mixed precision] in ``precision``);
            ``None``: ``fp32`` on a CPU backend, ``bf16`` on an accelerator
            (``precision.resolve_dtype``, on each rank).
        grad_accum: microbatches of ``batch_size / grad_accum`` sequences per optimizer
            step, their gradients summed; fully_shard reduces only the last one's
            (``set_requires_gradient_sync``).
        log: where metrics go besides ``metrics.jsonl``: ``tensorboard`` and/or ``wandb``
            (offline) (``metrics.LOGGERS``).
        init_device: where the model is built before it is parallelized (``INIT_DEVICES``):
            ``meta``: on the framework's meta device, then each rank computes and holds
            only its pieces (``fully_shard.materialize``; [Note: the job's initial
            weights] in ``model``); ``host``: whole on each rank, cut, then each rank's
            pieces written in place (the old path: a rank briefly holds the whole model).
            ``None``: ``meta`` for the job's decoder (an MoE ``--hf-config`` too), ``host``
            with a dense ``--hf-config`` (a Hugging Face model's initial values are its own
            random draws, which no rank can compute piece by piece).
        compile: run each decoder block's local compute under the framework's compiler
            (``torch.compile`` / ``mindspore.jit``; [Note: what --compile compiles] in
            ``train/compile.py``); the layouts it cannot take are refused here.
        hf_balance: ``(field, value)`` pairs of ``HF_BALANCE_FIELDS`` (``--moe-balance``,
            ``--moe-aux-loss-coef``, ``--moe-bias-rate``) for an MoE ``--hf-config``: how its
            experts are balanced in training, set on the model it maps to (which otherwise
            trains with ``none``, as ``transformers`` does: [Note: Mixtral as the job's MoE
            decoder] in ``hf_moe``).
    """

    platform: str = field(default_factory=requested_platform)
    nproc: int = 4
    model: ModelConfig = field(default_factory=lambda: PRESETS["small"])
    model_name: str = "small"
    layout: Layout = field(default_factory=lambda: Layout(dp_shard=4))
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 150
    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    lr_schedule: str = "cosine"
    min_lr: float | None = None
    max_norm: float = 1.0
    seed: int = 0
    eval_every: int = 25
    eval_batches: int = 2
    checkpoint_every: int = 50
    checkpoint_dir: str | None = None
    resume: bool = False
    keep_checkpoints: int = 3
    run_id: str = ""
    async_checkpoint: bool = False
    out: str = "runs/latest"
    data: tuple[str, ...] = ()
    check_parity: bool = False
    timeout_s: float = 1800.0
    progress: bool = True
    activation_checkpointing: bool = False
    hf_config: str | None = None
    dtype: str | None = None
    grad_accum: int = 1
    log: tuple[str, ...] = ()
    init_device: str | None = None
    compile: bool = False
    hf_balance: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        unknown = [name for name, _ in self.hf_balance if name not in HF_BALANCE_FIELDS]
        if unknown or (self.hf_balance and self.hf_config is None):
            raise ValueError(f"hf_balance={self.hf_balance!r}: it sets {', '.join(HF_BALANCE_FIELDS)} of the model an "
                             "MoE --hf-config maps to; without --hf-config set them on model (the --moe-* flags)")
        if self.hf_config is not None:
            self._check_hf()
        if self.compile:
            check_compile(self.layout, moe=bool(self.model.moe_experts), hf_config=self.hf_module,
                          activation_checkpointing=self.activation_checkpointing)
        self._check_precision_and_knobs()
        self._check_moe()
        if self.platform.split("-")[0] not in ("torch", "mindspore"):
            raise ValueError(f"--platform={self.platform!r} must be torch or mindspore (or a backend name such as "
                             "torch-cuda, mindspore-ascend)")
        for name in ("nproc", "seq_len", "batch_size", "steps", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every={self.checkpoint_every!r} must be an integer >= 0 (K: a checkpoint "
                             "every K steps and at the last; 0: only at the last step)")
        if not isinstance(self.keep_checkpoints, int) or isinstance(self.keep_checkpoints, bool) \
                or self.keep_checkpoints < 0:
            raise ValueError(f"--keep-checkpoints={self.keep_checkpoints!r} must be an integer >= 0 (N: keep this "
                             "run's N newest checkpoints, deleting its older ones; 0: keep every checkpoint); use "
                             "--keep-checkpoints 0 to keep them all")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps={self.warmup_steps!r} must be an integer >= 0 (0: no warmup)")
        # numpy's SeedSequence (the weights, data.global_batch) takes non-negative integers only;
        # checked here so that no rank is started to fail on it
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"--seed={self.seed!r} must be an integer >= 0 (it seeds numpy.random.default_rng); "
                             "use --seed 0 or another non-negative integer")
        if self.seed >= 2 ** 64:  # the key of the initial weights' Philox stream (train/model.py)
            raise ValueError(f"--seed={self.seed} must be below 2**64 (it keys the Philox stream the initial weights "
                             "are drawn from); use a smaller non-negative integer")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr={self.lr!r} must be a positive number")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule={self.lr_schedule!r} is not a schedule; use one of "
                             f"{', '.join(LR_SCHEDULES)}")
        if self.min_lr is not None and not (0 <= self.min_lr <= self.lr and math.isfinite(self.min_lr)):
            raise ValueError(f"--min-lr={self.min_lr!r} must be a number in [0, --lr={self.lr!r}] (the learning rate "
                             "the schedule decays to); leave it out for --lr / 10")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay={self.weight_decay!r} must be a number >= 0 (0: no weight decay)")
        if not (self.max_norm >= 0 and math.isfinite(self.max_norm)):
            raise ValueError(f"--max-norm={self.max_norm!r} must be a number >= 0 (0 turns gradient clipping off)")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout={self.timeout_s!r} must be a positive number of seconds")
        lay, mod = self.layout, self.model
        if lay.world_size != self.nproc:
            raise ValueError(
                f"the layout {lay.describe()} needs {lay.world_size} ranks (dp_replicate {lay.dp_replicate} x dp_shard "
                f"{lay.dp_shard} x tp {lay.tp} x cp {lay.cp} x pp {lay.pp}) but --nproc={self.nproc}; make the product "
                f"of the degrees equal --nproc")
        if mod.n_heads % lay.tp or mod.n_kv_heads % lay.tp:
            raise ValueError(
                f"--tp={lay.tp} must divide the query heads ({mod.n_heads}) and the key/value heads "
                f"({mod.n_kv_heads}) of --model {self.model_name}: tensor parallelism gives each rank whole heads; "
                f"use a --tp that divides {math.gcd(mod.n_heads, mod.n_kv_heads)}")
        if mod.hidden_dim % lay.tp:
            raise ValueError(f"--tp={lay.tp} must divide the MLP hidden size {mod.hidden_dim} of --model "
                             f"{self.model_name}")
        if lay.cp > 1:
            # Ulysses trades sequence shards for head shards; the load-balanced ring splits each
            # sequence into 2 * cp chunks.
            if lay.cp_mode == "ulysses" and (mod.n_heads // lay.tp) % lay.cp:
                raise ValueError(f"--cp={lay.cp} with --cp-mode {lay.cp_mode} must divide the query heads per "
                                 f"tensor-parallel rank ({mod.n_heads // lay.tp}); use --cp-mode ring or a smaller --cp")
            if lay.cp_mode == "ulysses" and (mod.n_kv_heads // lay.tp) % lay.cp:
                raise ValueError(f"--cp={lay.cp} with --cp-mode ulysses must divide the key/value heads per "
                                 f"tensor-parallel rank ({mod.n_kv_heads // lay.tp}); use --cp-mode ring or a smaller --cp")
            if lay.cp_mode == "hybrid":
                self._check_hybrid()
            if self.seq_len % (2 * lay.cp):
                raise ValueError(f"--seq-len={self.seq_len} must be divisible by 2 x --cp = {2 * lay.cp} "
                                 "(each context-parallel rank takes two load-balanced chunks of every sequence)")
        if lay.pp > 1:
            stages = lay.num_stages
            if stages > mod.n_layers:
                per = f" ({stages // lay.pp} per rank with --pp-schedule {lay.pp_schedule})" \
                    if stages > lay.pp else ""
                raise ValueError(f"--pp={lay.pp} makes {stages} pipeline stages{per} but --model {self.model_name} has "
                                 f"{mod.n_layers} layers; each stage needs at least one layer: use a smaller --pp or "
                                 "a model with more layers (--n-layers)")
            if lay.microbatches < lay.pp:
                raise ValueError(f"--microbatches={lay.microbatches} must be >= --pp={lay.pp}: with fewer microbatches "
                                 "than stages some stage is always idle; use --microbatches "
                                 f"{lay.pp} or more")
            try:  # the schedule's own rule (interleaved: a multiple of --pp; DualPipeV: >= 2 x --pp)
                SCHEDULES[lay.pp_schedule].generate(lay.pp, lay.microbatches)
            except ValueError as err:
                raise ValueError(f"--microbatches={lay.microbatches} does not fit --pp-schedule {lay.pp_schedule} "
                                 f"with --pp={lay.pp}: {err}") from None
            if mod.tie_embeddings:
                raise ValueError("--tie-embeddings cannot be pipelined: the embedding sits on the first stage and the "
                                 "output head on the last, so the shared weight's gradient would have to be summed "
                                 "across stages; drop --tie-embeddings or --pp")
        elif lay.microbatches != 1:
            raise ValueError(f"--microbatches={lay.microbatches} applies to pipeline parallelism only; give --pp 2 or "
                             "more, or leave --microbatches at 1")
        if self.batch_size % (lay.dp * lay.microbatches):
            raise ValueError(
                f"--batch-size={self.batch_size} must be divisible by the data-parallel degree ({lay.dp}) x "
                f"--microbatches ({lay.microbatches}) = {lay.dp * lay.microbatches}: each data-parallel rank takes "
                "an equal share of every batch")
        if self.batch_size % (lay.dp * self.grad_accum):
            raise ValueError(
                f"--batch-size={self.batch_size} must be divisible by the data-parallel degree ({lay.dp}) x "
                f"--grad-accum ({self.grad_accum}) = {lay.dp * self.grad_accum}: each data-parallel rank splits its "
                "share of every batch into --grad-accum equal microbatches")
        if self.seq_len > mod.max_seq_len:
            raise ValueError(f"--seq-len={self.seq_len} exceeds the rotary tables of --model {self.model_name} "
                             f"(max_seq_len {mod.max_seq_len})")

    def _check_precision_and_knobs(self) -> None:
        """``--dtype``, ``--grad-accum`` and ``--log`` (the batch divisibility is checked
        with the layout's)."""
        from hyper_parallel.train.metrics import LOGGERS, missing_logger_package

        if self.dtype is not None:
            resolve_dtype(self.dtype, "cpu")  # the value (ValueError naming --dtype)
        if self.dtype not in (None, "fp32"):
            if self.hf_module:
                raise ValueError(f"--dtype {self.dtype} applies to the job's decoder; --hf-config trains in "
                                 "float32: use --dtype fp32 (or leave --dtype out on CPU)")
        if not isinstance(self.grad_accum, int) or isinstance(self.grad_accum, bool) or self.grad_accum < 1:
            raise ValueError(f"--grad-accum={self.grad_accum!r} must be a positive integer (1: no accumulation)")
        if self.grad_accum > 1 and self.layout.pp > 1:
            raise ValueError(f"--grad-accum={self.grad_accum} cannot be combined with --pp={self.layout.pp}: a "
                             "pipeline accumulates over its microbatches already; use --microbatches "
                             f"{self.layout.microbatches * self.grad_accum} instead")
        if self.init_device not in (None, *INIT_DEVICES):
            raise ValueError(f"--init-device={self.init_device!r} is not a build device; use one of "
                             f"{', '.join(INIT_DEVICES)}")
        if self.init_device == "meta" and self.hf_module:
            raise ValueError("--init-device meta builds the job's decoder; a --hf-config model draws its initial "
                             "values whole (Hugging Face's own init), so it builds on the host: leave --init-device "
                             "out or use --init-device host")
        for name in self.log:
            if name not in LOGGERS:
                raise ValueError(f"--log={name!r} is not a logger; use one of {', '.join(LOGGERS)} (metrics.jsonl "
                                 "is always written)")
            missing = missing_logger_package(name)
            if missing is not None:
                raise ValueError(f"--log {name} needs the {missing} package, which is not installed here: pip "
                                 f"install {missing} (or pip install -e '.[logging]'), or drop --log {name}")

    def _check_moe(self) -> None:
        """A mixture-of-experts model (``--moe-experts N``, ``train/moe_model.py``) against the
        layout and the run: what the job composes with MoE blocks today, the rest refused."""
        mod, lay = self.model, self.layout
        if lay.ep > 1:
            self._check_expert_parallel()
        if lay.ep_overlap:
            self._check_ep_overlap()
        if not mod.moe_experts:
            return
        hidden = mod.moe_shared_experts * mod.expert_hidden_dim
        if mod.moe_shared_experts and hidden % lay.tp:
            raise ValueError(f"--tp={lay.tp} must divide the shared experts' width {hidden} (--moe-shared-experts "
                             f"{mod.moe_shared_experts} x expert width {mod.expert_hidden_dim}): tensor parallelism "
                             "splits the shared expert like the dense MLP; use a --tp dividing it")
        if lay.pp > 1 and mod.moe_balance == "aux-loss":
            # the last stage's loss holds the cross-entropy only: an earlier stage's balance loss
            # would need its gradient seeded inside that stage's backward (and its value carried
            # to the last stage for the reported loss), which the job's pipeline does not do
            raise ValueError(f"--moe-balance aux-loss cannot be combined with --pp={lay.pp} yet: the balance loss of "
                             "an MoE block on an earlier stage does not reach the last stage's loss; use --moe-balance "
                             "aux-free with --pp")
        if self.activation_checkpointing and mod.moe_balance == "aux-loss":
            # the balance loss is read off each MoE block after the forward, outside the block's
            # checkpointed region: its gradient would have to reach back into a region whose
            # activations were dropped, which is not checked on either framework
            raise ValueError("--moe-balance aux-loss cannot be combined with --activation-checkpointing yet: the "
                             "auxiliary loss leaves the checkpointed blocks beside their output; use --moe-balance "
                             "aux-free with --activation-checkpointing, or drop it")
        if lay.cp > 1 and mod.moe_balance == "aux-loss":
            raise ValueError(f"--moe-balance aux-loss cannot be combined with --cp={lay.cp}: the balance loss is taken "
                             "per sequence, and a context-parallel rank holds part of each; use --moe-balance "
                             "aux-free with --cp")

    def _check_expert_parallel(self) -> None:
        """``--ep N``: an MoE model whose experts divide over ``N`` ranks of the ``dp_shard``
        axis, in the layouts the job runs with expert parallelism today."""
        mod, lay = self.model, self.layout
        if not mod.moe_experts:
            raise ValueError(f"--ep={lay.ep} shards the routed experts of a mixture-of-experts model, but --model "
                             f"{self.model_name} is dense; give --moe-experts N (or --model moe-tiny|moe-small), or "
                             "drop --ep")
        if mod.moe_experts % lay.ep:
            raise ValueError(f"--ep={lay.ep} must divide --moe-experts={mod.moe_experts}: each expert-parallel rank "
                             f"holds moe_experts / ep whole experts; use an --ep dividing {mod.moe_experts}")
        if lay.dp_shard % lay.ep:
            raise ValueError(f"--ep={lay.ep} must divide --dp-shard={lay.dp_shard}: the expert-parallel ranks are "
                             "borrowed from the sharded data-parallel axis (dp_shard / ep groups of ep ranks, the "
                             f"experts fully_shard'ed over the groups); use an --ep dividing {lay.dp_shard}")

    def _check_ep_overlap(self) -> None:
        """``--ep-overlap``: the two-thread pairs need MoE blocks whose dispatch and combine
        communicate (``--ep`` >= 2), a pipeline schedule with ``OVERLAP_B_F`` pairs, and the
        layouts whose collectives the pairs keep in one order on every rank."""
        mod, lay = self.model, self.layout
        if not mod.moe_experts or lay.ep < 2:
            what = f"--model {self.model_name} is dense" if not mod.moe_experts else f"--ep={lay.ep}"
            raise ValueError(f"--ep-overlap overlaps the expert-parallel all-to-alls of an MoE model, but {what}: "
                             "give an MoE model (--model moe-tiny|moe-small or --moe-experts N) with --ep 2 or more "
                             "(dispatch and combine communicate nothing without it), or drop --ep-overlap")
        if lay.pp < 2:
            raise ValueError(f"--ep-overlap pairs one microbatch's forward with another's backward inside a pipeline "
                             f"schedule, but --pp={lay.pp}; give --pp 2 or more with --pp-schedule "
                             f"{' or '.join(EP_OVERLAP_SCHEDULES)}, or drop --ep-overlap")
        if lay.pp_schedule not in EP_OVERLAP_SCHEDULES:
            raise ValueError(f"--ep-overlap cannot run with --pp-schedule {lay.pp_schedule}: it has no "
                             f"forward/backward pairs to overlap; use --pp-schedule {' or '.join(EP_OVERLAP_SCHEDULES)}")

    def _check_hf(self) -> None:
        """``--hf-config``: ``model`` becomes the sizes of its configuration
        (``hf_config.model_config``), which the layout is checked against; a torch model
        (``transformers``), installed, unless it maps to the job's MoE decoder (``hf_moe``)."""
        import importlib.util

        source = read_hf_config(self.hf_config)
        # frozen dataclass: the derived sizes are recorded once, here, before any rank starts
        object.__setattr__(self, "model", model_config(source, self.seq_len))
        object.__setattr__(self, "model_name", f"hf:{source.model_type}")
        if self.hf_balance:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name, _ in self.hf_balance)
            if not self.model.moe_experts:
                raise ValueError(f"{flags} choose how a mixture of experts is balanced, but --hf-config "
                                 f"{self.hf_config!r} is a dense {source.model_type} model: drop {flags}")
            object.__setattr__(self, "model", dataclasses.replace(self.model, **dict(self.hf_balance)))
        if not self.hf_module:  # the job's own decoder: any platform, no transformers
            if source.weights_dir is not None:  # the files' headers, here, before any rank starts
                PretrainedWeights.open(source.weights_dir, self.model, source.model_type)
            return

        if self.platform.split("-")[0] != "torch":
            raise ValueError(f"--hf-config trains a Hugging Face transformers model, a torch module: it needs "
                             f"--platform torch (or torch-cuda, torch-npu), not {self.platform!r}")
        if importlib.util.find_spec("transformers") is None:
            raise ValueError("--hf-config needs the transformers package: pip install -e '.[transformers]'")

    def _check_hybrid(self) -> None:
        """``--cp-mode hybrid``: fill in the derived Ulysses degree (``default_ulysses_degree``)
        or check the given one against the heads per tensor-parallel rank, which the
        all-to-all over the Ulysses axis splits (q's and k/v's alike)."""
        lay, mod = self.layout, self.model
        heads, kv_heads = mod.n_heads // lay.tp, mod.n_kv_heads // lay.tp
        if lay.ulysses_degree is None:
            u = default_ulysses_degree(lay.cp, heads, kv_heads)
            if u is None:
                raise ValueError(f"--cp={lay.cp} with --cp-mode hybrid: no Ulysses degree u with 1 < u < {lay.cp} "
                                 f"divides --cp, the query heads ({heads}) and the key/value heads ({kv_heads}) per "
                                 "tensor-parallel rank; use --cp-mode ring|allgather|ulysses, or a --cp with such "
                                 "a divisor (4 or more)")
            # frozen dataclass: the derived degree is recorded once, here, before any rank starts
            object.__setattr__(self, "layout", dataclasses.replace(lay, ulysses_degree=u))
            return
        u = lay.ulysses_degree
        if heads % u or kv_heads % u:
            raise ValueError(f"--ulysses-degree={u} must divide the query heads ({heads}) and the key/value heads "
                             f"({kv_heads}) per tensor-parallel rank: the all-to-all gives each Ulysses rank whole "
                             f"heads; use a --ulysses-degree dividing {math.gcd(heads, kv_heads)}")

    def refuse_unlanded(self) -> None:
        """Raise if the layout needs a parallel feature, or a composition of features, that
        is not in the package yet."""
        lay = self.layout
        missing = lay.missing_features()
        if missing:
            reasons = "; ".join(f"{name}: {NOT_YET[name]}" for name in missing)
            raise ValueError(
                f"the layout {lay.describe()} needs {', '.join(missing)}, which hyper-parallel train does not "
                f"support yet ({reasons}); layouts that run today: a single rank, tensor parallelism "
                "(--tp N --nproc N), sharded data parallelism (--dp-shard S, with --dp-replicate R for HSDP, "
                "--nproc R*S), both combined (--tp T --dp-shard S [--dp-replicate R], --nproc R*S*T), context "
                "parallelism with any of those (--cp C, --nproc R*S*C*T) and pipeline parallelism with any of those "
                "(--pp P, --nproc P*R*S*C*T)")

    def checkpoint_due(self, step: int) -> bool:
        """Whether ``step`` (1-based) ends with a checkpoint: every ``checkpoint_every``
        steps and always the last (``checkpoint_every == 0``: the last only), so a run
        that finishes can be continued with a larger ``--steps`` and ``--resume``."""
        return step == self.steps or (self.checkpoint_every > 0 and step % self.checkpoint_every == 0)

    @property
    def run_dir(self) -> Path:
        return Path(self.out)

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else self.run_dir / "checkpoints"

    def replace(self, **changes: object) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    @property
    def hf_module(self) -> bool:
        """Whether the run trains ``transformers``' own model (a torch module: ``hf_model``):
        a dense ``--hf-config``. False without ``--hf-config`` and for an MoE one, which maps
        to the job's decoder (``hf_config.model_config`` gives experts in that case only)."""
        return self.hf_config is not None and not self.model.moe_experts

    @property
    def build_on_meta(self) -> bool:
        """Whether the model is built on the meta device (``init_device`` resolved)."""
        return (self.init_device or ("host" if self.hf_module else "meta")) == "meta"

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> TrainConfig:
        values = dict(values)
        values["model"] = ModelConfig(**values["model"])  # type: ignore[arg-type]
        values["layout"] = Layout(**values["layout"])  # type: ignore[arg-type]
        values["data"] = tuple(values.get("data", ()))  # type: ignore[arg-type]
        values["log"] = tuple(values.get("log", ()))  # type: ignore[arg-type]
        return cls(**values)  # type: ignore[arg-type]
