"""``hyper-parallel train``: the command line of the main job (and ``hyper-parallel export``,
a checkpoint as a Hugging Face model folder: ``train/export.py``; ``generate`` and ``eval``, a
checkpoint's text and loss on one rank: ``train/generate.py``, ``train/evaluate.py``).

Outside a launcher it validates the configuration (every error before any rank starts),
starts the ranks through the framework's launcher (``launch.py``) and, with
``--check-parity``, runs the single-process reference and compares the loss curves.
Inside torchrun/msrun it runs this process's rank in place, so the same command scales to
many machines::

    hyper-parallel train                                  # small model, 4 CPU ranks, tp 4
    hyper-parallel train --platform mindspore --tp 2 --steps 50
    torchrun --nproc-per-node 8 -m hyper_parallel.train.cli train --tp 8 --run-name tp8

Each run writes its own folder (``runs/<date>-<time>``, ``runs/latest`` linking to the newest;
``--out``/``--run-name`` to name it): ``run_folder.py``.

(inside a launcher the world size is the launcher's: ``WORLD_SIZE`` or ``MS_WORKER_NUM``;
``--nproc`` is not needed there, and torchrun's own parser would take it for its
``--nproc-per-node``.)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
from typing import Any

from hyper_parallel.core.pipeline_parallel.schedule_table import SCHEDULES
from hyper_parallel.platform import requested_platform
from hyper_parallel.train import preflight, run_folder
from hyper_parallel.train.checkpoint import KEEP, complete_steps
from hyper_parallel.train.config import (CP_KV_EXCHANGES, CP_MODES, HF_BALANCE_FIELDS, INIT_DEVICES, PRESETS,
                                         Layout, ModelConfig, TrainConfig)
from hyper_parallel.train.model_config import MOE_BALANCES, MOE_DEFAULTS
from hyper_parallel.train.metrics import LOGGERS, METRICS_FILE, read_metrics
from hyper_parallel.train.optim import LR_SCHEDULES, WSD_DECAY_FRACTION
from hyper_parallel.train.precision import DTYPES

#: The layout of a run without layout flags, on ``--nproc`` ranks: sharded data
#: parallelism (fully_shard over every rank, ``dp_shard = nproc``).
DEFAULT_LAYOUT_AXIS = "dp_shard"
LAYOUT_FLAGS = ("dp_replicate", "dp_shard", "tp", "cp", "pp")


TRAIN_DESCRIPTION = """\
Train a Llama-style decoder as a byte-level language model across N ranks of this machine,
with the parallel layout given by the degrees below (their product is the number of ranks).
Every bad combination is refused before any rank starts.

examples:
  hyper-parallel train                                   # small model, 4 CPU ranks, fully sharded (dp-shard 4)
  hyper-parallel train --nproc 1 --tp 1                  # one rank
  hyper-parallel train --platform mindspore --tp 2 --steps 50
  hyper-parallel train --tp 2 --check-parity             # and compare with a single-process run
  hyper-parallel train --list-presets                    # the model presets and their sizes
  torchrun --nproc-per-node 8 -m hyper_parallel.train.cli train --tp 8 --run-name tp8

Each run writes its own folder (runs/<date>-<time>, or --out / --run-name; runs/latest links
to the newest): config.json, metrics.jsonl, loss.png, checkpoints/. Inside torchrun or msrun
the command runs this process's rank, the world size is the launcher's and --nproc is not
needed. More: docs/train.md.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and each flag's default after its help (unless the
    help says it already, or there is none: a switch, or a value derived at run time)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] \
                or action.default is argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


class _ListPresets(argparse.Action):
    """``--list-presets``: print every ``--model`` preset's sizes and parameter count, exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the --model presets (sizes, parameters) and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from hyper_parallel.train.model import parameter_shapes

        rows = [f"{'preset':<9} {'dim':>5} {'layers':>6} {'heads':>5} {'kv heads':>8} {'hidden':>6} "
                f"{'max seq':>7} {'parameters':>12}"]
        for name, m in PRESETS.items():
            count = sum(math.prod(shape) for shape in parameter_shapes(m).values())
            rows.append(f"{name:<9} {m.dim:>5} {m.n_layers:>6} {m.n_heads:>5} {m.n_kv_heads:>8} {m.hidden_dim:>6} "
                        f"{m.max_seq_len:>7} {count:>12,}")
        print("\n".join(rows))
        parser.exit(0)


def _version() -> str:
    try:
        return importlib.metadata.version("hyper_parallel")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyper-parallel", description="hyper_parallel command line: "
                                     "train a model across ranks, export a checkpoint, generate text "
                                     "from it or evaluate it")
    parser.add_argument("--version", action="version", version=f"hyper-parallel {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="{train,export,generate,eval}")
    t = commands.add_parser("train", help="train a Llama-style byte-level language model across N ranks",
                            description=TRAIN_DESCRIPTION, formatter_class=_HelpFormatter)
    t.add_argument("--list-presets", action=_ListPresets)
    t.add_argument("--platform", default=None,
                   help="torch or mindspore, or a backend name (torch-cuda, mindspore-ascend); default: "
                        "$HYPER_PARALLEL_PLATFORM, else the only framework installed, else mindspore")
    t.add_argument("--nproc", type=int, default=None,
                   help="ranks to start on this machine (default: the product of the layout degrees, or 4); inside "
                        "torchrun/msrun the launcher's world size, leave it out there")
    lay = t.add_argument_group("layout (the product of the degrees is --nproc)")
    lay.add_argument("--dp-replicate", type=int, default=None, help="replicated data-parallel degree (HSDP)")
    lay.add_argument("--dp-shard", type=int, default=None, help="sharded data-parallel degree (fully_shard)")
    lay.add_argument("--tp", type=int, default=None, help="tensor-parallel degree")
    lay.add_argument("--cp", type=int, default=None, help="context-parallel degree")
    lay.add_argument("--cp-mode", default="ulysses", help=f"context-parallel mode: {', '.join(CP_MODES)}")
    lay.add_argument("--ulysses-degree", type=int, default=None,
                     help="--cp-mode hybrid: ranks of the Ulysses all-to-all axis, 1 < u < cp dividing cp and the "
                          "heads per tensor-parallel rank (default: the largest such u)")
    lay.add_argument("--cp-kv-exchange", default="ring",
                     help=f"--cp-mode hybrid: key/value exchange over the other cp / u ranks: "
                          f"{', '.join(CP_KV_EXCHANGES)}")
    lay.add_argument("--ep", type=int, default=1,
                     help="expert-parallel degree of an MoE model: its routed experts sharded over N of the "
                          "--dp-shard ranks (N divides --dp-shard; fully_shard shards them over the rest), tokens sent "
                          "to their experts by all-to-all")
    lay.add_argument("--ep-overlap", action="store_true",
                     help="with --ep and --pp (--pp-schedule 1f1b or interleaved-1f1b): run each pair of one "
                          "microbatch's backward and the next one's forward on two threads, the MoE dispatch/combine "
                          "all-to-alls of each beside the other's compute")
    lay.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree")
    lay.add_argument("--pp-schedule", default="1f1b",
                     help="pipeline schedule (the core's schedule table): " + "; ".join(
                         f"{name}: {entry.description}" for name, entry in SCHEDULES.items())
                     + " (the split-backward ones with --tp but not with --dp-shard/--dp-replicate/--cp)")
    lay.add_argument("--microbatches", type=int, default=None,
                     help="microbatches per step (pipeline; default: --pp, the fewest that keep every stage busy)")
    mod = t.add_argument_group("model")
    mod.add_argument("--model", default="small", help=f"preset: {', '.join(PRESETS)} (sizes: --list-presets; the sizes below override it)")
    for flag, what in (("dim", "model width"), ("n-layers", "decoder blocks"), ("n-heads", "query heads"),
                       ("n-kv-heads", "key/value heads (grouped-query attention)"),
                       ("hidden-dim", "feed-forward (SwiGLU) width")):
        mod.add_argument(f"--{flag}", type=int, default=None, help=f"{what} (default: the preset's)")
    mod.add_argument("--tie-embeddings", action="store_true", help="the output head reuses the embedding")
    moe = t.add_argument_group("mixture of experts (the moe-* presets set them; sizes override a preset)")
    moe.add_argument("--moe-experts", type=int, default=None, metavar="N",
                     help="routed experts per MoE block (0: a dense decoder)")
    moe.add_argument("--moe-top-k", type=int, default=None, metavar="K", help="routed experts per token")
    moe.add_argument("--moe-shared-experts", type=int, default=None, metavar="S",
                     help="experts every token passes through besides the routed ones (DeepSeek-V3)")
    moe.add_argument("--moe-every", type=int, default=None, metavar="L",
                     help="every L-th block is MoE, the others dense (1: all)")
    moe.add_argument("--moe-hidden-dim", type=int, default=None, help="each expert's SwiGLU width (0: --hidden-dim)")
    moe.add_argument("--moe-balance", default=None, choices=MOE_BALANCES,
                     help="aux-free: a per-expert routing bias moved towards the mean load after each step "
                          "(DeepSeek-V3); aux-loss: Switch's load-balancing loss, per sequence; none: "
                          "neither")
    moe.add_argument("--moe-aux-loss-coef", type=float, default=None, help="the balance loss's weight (aux-loss)")
    moe.add_argument("--moe-bias-rate", type=float, default=None, help="the bias update speed (aux-free)")
    moe.add_argument("--moe-norm-topk", action=argparse.BooleanOptionalAction, default=None,
                     help="renormalise the top-k gates to sum to 1 (the default; --no-moe-norm-topk: the chosen "
                          "probabilities as they are, Qwen3-MoE's norm_topk_prob false)")
    mod.add_argument("--hf-config", default=None, metavar="PATH",
                     help="train a Hugging Face causal LM instead (torch): its config.json, or a model folder "
                          "(its weights are loaded when the folder has them); vocab_size >= 256 (byte tokens, "
                          "docs/train.md); replaces --model and the sizes. A Mixtral or Qwen3-MoE config trains as "
                          "the job's own MoE decoder (both frameworks, --ep); other MoE configs are refused")
    tr = t.add_argument_group("training")
    tr.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    tr.add_argument("--batch-size", type=int, default=8, help="sequences per step over all data-parallel ranks")
    tr.add_argument("--steps", type=int, default=150, help="optimizer steps")
    tr.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then --lr-schedule)")
    tr.add_argument("--warmup-steps", type=int, default=10, help="steps of linear learning-rate warmup")
    tr.add_argument("--lr-schedule", default="cosine",
                    help=f"learning rate after warmup: {', '.join(LR_SCHEDULES)} (wsd: warmup-stable-decay, the peak "
                         f"until the last {round(WSD_DECAY_FRACTION * 100)}%% of the steps, then linear), down to "
                         "--min-lr")
    tr.add_argument("--min-lr", type=float, default=None,
                    help="the learning rate the schedule ends at (default: --lr / 10)")
    tr.add_argument("--weight-decay", type=float, default=0.1,
                    help="AdamW's decoupled weight decay, on every parameter (0: none)")
    tr.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                    help="compute dtype (float32 parameters and AdamW state, gradients reduced in float32; fp16 "
                         "with dynamic loss scaling); default: fp32 on CPU, and with --hf-config; bf16 on "
                         "CUDA/NPU otherwise. A dtype the framework's CPU kernels do not take is refused")
    tr.add_argument("--grad-accum", type=int, default=1, metavar="N",
                    help="microbatches per optimizer step (each --batch-size / N sequences), their gradients summed; "
                         "fully_shard reduces only the last one's")
    tr.add_argument("--init-device", default=None, choices=INIT_DEVICES,
                    help="build the model on the meta device, then each rank computes only its pieces of the "
                         "initial weights (no rank ever holds a whole sharded parameter), or whole on the host and "
                         "cut; default: meta, host with a dense --hf-config. Both give the same weights, bit for bit")
    tr.add_argument("--max-norm", type=float, default=1.0,
                    help="clip the gradients to this global L2 norm, over every rank's piece (0: no clipping)")
    tr.add_argument("--seed", type=int, default=0, help="the initial weights' and the batches' seed")
    tr.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each decoder block's activations in the backward instead of keeping them "
                         "(less activation memory, one more block forward per step; with --pp in every stage, "
                         "recomputed in each microbatch's backward)")
    tr.add_argument("--compile", action="store_true",
                    help="run each decoder block's local compute compiled: torch.compile of each block on torch "
                         "(one rank, --tp, --dp-shard, --dp-replicate), mindspore.jit of each block's MLP "
                         "on MindSpore (one rank, --dp-shard, --dp-replicate); other layouts are refused "
                         "(docs/train_compile.md)")
    tr.add_argument("--eval-every", type=int, default=25, help="validation loss every K steps")
    tr.add_argument("--data", nargs="+", default=[], metavar="PATH",
                    help="text files or folders (default: the standard library's .py files)")
    out = t.add_argument_group("output")
    out.add_argument("--out", default=None,
                     help="run folder: config.json, metrics.jsonl, loss.png, checkpoints/ (default: a new folder "
                          "runs/<date>-<time>, with runs/latest linked to it; with --resume: the run runs/latest "
                          "links to). A folder holding another run is refused without --resume or --overwrite")
    out.add_argument("--run-name", default=None, metavar="NAME",
                     help="the run folder runs/NAME instead of the date and time (runs/latest links to it)")
    out.add_argument("--overwrite", action="store_true",
                     help="delete the run that --out (or --checkpoint-dir) holds (its metrics, plot, config and "
                          "checkpoints) and start over there")
    out.add_argument("--checkpoint-dir", default=None, help="default: <out>/checkpoints")
    out.add_argument("--checkpoint-every", type=int, default=50,
                     help="a checkpoint every K steps and at the last step (0: at the last step only)")
    out.add_argument("--keep-checkpoints", type=int, default=KEEP, metavar="N",
                     help=f"keep this run's N newest checkpoints, deleting its older ones after each save; another "
                          f"run's are never deleted (default {KEEP}; 0: keep all)")
    out.add_argument("--resume", action="store_true",
                     help="continue from the newest complete checkpoint (written by any layout of the same "
                          "model: resharded); an error if there is none (without --resume a run starts at step 0); "
                          "without --out: the run runs/latest links to")
    out.add_argument("--async-checkpoint", action="store_true",
                     help="write checkpoints in the background while training continues (the state is copied to "
                          "host memory at the step; the next checkpoint, and the end of the run, wait for it)")
    out.add_argument("--log", nargs="+", default=[], choices=tuple(LOGGERS), metavar="LOGGER",
                     help="also log the metrics to: tensorboard (<out>/tensorboard, the tensorboard package) and/or "
                          "wandb (offline, <out>/wandb; `wandb sync` uploads it); metrics.jsonl is always written")
    out.add_argument("--check-parity", action="store_true",
                     help="also run a single-process reference and report the largest relative loss difference")
    out.add_argument("--timeout", type=float, default=1800.0, help="seconds before the whole run is killed")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = commands.add_parser("export", help="write a checkpoint as a Hugging Face model folder (one process)",
                            description=EXPORT_DESCRIPTION, formatter_class=_HelpFormatter)
    e.add_argument("checkpoint", help="a checkpoint folder (step_XXXXXXXX) or the folder holding them "
                                      "(<out>/checkpoints: the newest complete one is exported)")
    e.add_argument("--format", default="hf", help="hf: config.json, model.safetensors and a byte-level tokenizer, "
                                                  "for transformers' from_pretrained (the job's decoder as "
                                                  "LlamaForCausalLM, an --hf-config run as its own model)")
    e.add_argument("--out", required=True, help="the folder to write (created; must be new or empty)")
    e.add_argument("--force", action="store_true",
                   help="write into a folder that is not empty, replacing the exported files there")
    _add_generate_and_eval(commands)
    return parser


def _add_generate_and_eval(commands: Any) -> None:
    """The parsers of ``generate`` (``train/generate.py``) and ``eval`` (``train/evaluate.py``)."""
    from hyper_parallel.train.evaluate import BATCHES, SPLITS
    from hyper_parallel.train.generate import MAX_NEW_TOKENS

    where = ("a checkpoint folder (step_XXXXXXXX) or the folder holding them (<out>/checkpoints: the newest "
             "complete one), written by any layout on either framework")
    platform = "torch or mindspore, or a backend name (default: as train's --platform)"
    g = commands.add_parser("generate", help="continue a prompt with a checkpoint's model (one process)",
                            description=GENERATE_DESCRIPTION, formatter_class=_HelpFormatter)
    g.add_argument("checkpoint", help=where)
    g.add_argument("--prompt", required=True, help="the text to continue (its UTF-8 bytes are the tokens)")
    g.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help="bytes to generate (fewer where the model's max_seq_len ends)")
    g.add_argument("--sample", action="store_true",
                   help="draw each byte from the model's distribution instead of taking the most likely (greedy, "
                        "the default); implied by --temperature, --top-k and --top-p")
    g.add_argument("--temperature", type=float, default=None, help="divide the logits by T > 0 (default 1)")
    g.add_argument("--top-k", type=int, default=None, help="draw from the K >= 1 most likely bytes (default: all)")
    g.add_argument("--top-p", type=float, default=None,
                   help="draw from the fewest most likely bytes whose probability sums to P, 0 < P <= 1 (default 1)")
    g.add_argument("--seed", type=int, default=0, help="seed of the draws (numpy; the same bytes on both frameworks)")
    g.add_argument("--no-cache", dest="cache", action="store_false",
                   help="recompute the whole sequence for each byte instead of caching keys and values (the "
                        "default)")
    g.add_argument("--platform", default=None, help=platform)
    v = commands.add_parser("eval", help="a checkpoint's loss and bits per byte on held-out text (one process)",
                            description=EVAL_DESCRIPTION, formatter_class=_HelpFormatter)
    v.add_argument("checkpoint", help=where)
    v.add_argument("--data", nargs="+", default=[], metavar="PATH",
                   help="text files or folders, as train's --data (default: the standard library's .py files)")
    v.add_argument("--split", default="validation",
                   help=f"{' or '.join(SPLITS)}: the held-out split the job validates on, or all of the text")
    v.add_argument("--seq-len", type=int, default=None, help="bytes per sequence (default: the checkpoint's run's)")
    v.add_argument("--batch-size", type=int, default=None,
                   help="sequences per batch (default: the checkpoint's run's)")
    v.add_argument("--batches", type=int, default=BATCHES, help="batches averaged (the job validates on 2)")
    v.add_argument("--seed", type=int, default=None, help="seed of the batches (default: the checkpoint's run's)")
    v.add_argument("--platform", default=None, help=platform)


GENERATE_DESCRIPTION = """\
Continue a prompt with the model of a checkpoint of `hyper-parallel train`, in one process (no
ranks), on either framework, whatever layout wrote it; greedy unless sampling is asked for:

    hyper-parallel generate runs/latest/checkpoints --prompt "def main():"
    hyper-parallel generate runs/latest/checkpoints --prompt "import " --top-k 20 --top-p 0.9 --seed 1

The checkpoint used goes to stderr, the prompt and its continuation to stdout.
"""

EVAL_DESCRIPTION = """\
A checkpoint's mean next-byte loss (nats) and bits per byte, in one process, on the validation
batches the job draws (with the checkpoint's run's seed, batch size and sequence length unless
given): with the run's --data, the run's own validation loss.

    hyper-parallel eval runs/latest/checkpoints
    hyper-parallel eval runs/latest/checkpoints --data notes.txt --split all
"""


EXPORT_DESCRIPTION = """\
Write a checkpoint of `hyper-parallel train` as a consolidated Hugging Face model folder, in one
process (no ranks, no torch: a MindSpore run exports too), whatever layout wrote it:

    hyper-parallel export runs/latest/checkpoints --format hf --out exported/

Then `transformers.AutoModelForCausalLM.from_pretrained("exported/")` and
`AutoTokenizer.from_pretrained("exported/")` (token ids are the text's UTF-8 bytes).
"""


def _world_size(nproc: int | None) -> int | None:
    """The run's number of ranks as far as it is given: inside torchrun/msrun the launcher's
    world size (``rank.launcher_world_size``), which ``--nproc`` may repeat but not contradict;
    outside, ``--nproc`` (``None``: derived from the layout)."""
    from hyper_parallel.train.rank import launcher_world_size

    world = launcher_world_size()
    if world is None:
        return nproc
    if nproc is not None and nproc != world:
        raise ValueError(f"--nproc={nproc} but the launcher runs {world} ranks (WORLD_SIZE / MS_WORKER_NUM); inside "
                         "torchrun or msrun the world size is the launcher's: leave --nproc out")
    return world


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's configuration (``ValueError`` for any invalid value or combination)."""
    if args.model not in PRESETS:
        raise ValueError(f"--model={args.model!r} is not a preset; use one of {', '.join(PRESETS)} "
                         "(and --dim/--n-layers/... to change sizes)")
    sizes = {name: getattr(args, name) for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim",
                                                    *MOE_DEFAULTS) if getattr(args, name) is not None}
    # an MoE --hf-config's balance (TrainConfig.hf_balance); its sizes are the configuration's
    hf_balance = {name: sizes.pop(name) for name in HF_BALANCE_FIELDS if name in sizes} \
        if args.hf_config is not None else {}
    preset = PRESETS[args.model]
    model = ModelConfig(**{**preset.__dict__, **sizes, "tie_embeddings": args.tie_embeddings,
                           "max_seq_len": max(preset.max_seq_len, args.seq_len)})
    degrees = {name: getattr(args, name) for name in LAYOUT_FLAGS if getattr(args, name) is not None}
    nproc = _world_size(args.nproc)
    if degrees:
        needed = Layout(**degrees).world_size
        if nproc is not None and args.nproc is None and needed != nproc:  # the launcher's world
            flags = ", ".join(f"--{name.replace('_', '-')} {degree}" for name, degree in degrees.items())
            raise ValueError(f"the layout flags ({flags}) "
                             f"need {needed} ranks but the launcher runs {nproc} (WORLD_SIZE / MS_WORKER_NUM); make "
                             "the product of the degrees equal the launcher's world size")
        nproc = nproc if nproc is not None else needed
    else:
        nproc = nproc if nproc is not None else 4
        degrees = {DEFAULT_LAYOUT_AXIS: nproc}
    microbatches = args.microbatches if args.microbatches is not None else degrees.get("pp", 1)
    layout = Layout(**degrees, cp_mode=args.cp_mode, pp_schedule=args.pp_schedule, microbatches=microbatches,
                    ulysses_degree=args.ulysses_degree, cp_kv_exchange=args.cp_kv_exchange, ep=args.ep,
                    ep_overlap=args.ep_overlap)
    name = args.model if not sizes else f"{args.model}+custom"
    if args.hf_config is not None and (sizes or args.tie_embeddings or args.model != "small"):
        raise ValueError("--hf-config takes the model from the Hugging Face configuration (TrainConfig derives its "
                         "sizes): drop --model, --dim/--n-layers/--n-heads/--n-kv-heads/--hidden-dim, the --moe-* "
                         "sizes and --tie-embeddings (--moe-balance, --moe-aux-loss-coef and --moe-bias-rate may stay: "
                         "an MoE model's balance)")
    out, _ = run_folder.choose(args.out, args.run_name, args.resume)
    return TrainConfig(platform=args.platform or requested_platform(), nproc=nproc, model=model, model_name=name,
                       layout=layout, seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                       warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule, min_lr=args.min_lr,
                       weight_decay=args.weight_decay, max_norm=args.max_norm, seed=args.seed, eval_every=args.eval_every,
                       checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                       keep_checkpoints=args.keep_checkpoints, async_checkpoint=args.async_checkpoint,
                       out=out, data=tuple(args.data), check_parity=args.check_parity, timeout_s=args.timeout,
                       progress=not args.no_progress, activation_checkpointing=args.activation_checkpointing,
                       hf_config=args.hf_config, dtype=args.dtype, grad_accum=args.grad_accum, log=tuple(args.log),
                       init_device=args.init_device, compile=args.compile, hf_balance=tuple(hf_balance.items()))


def parity_report(run: list[dict], reference: list[dict]) -> dict:
    """The largest relative difference ``|loss - ref| / |ref|`` over the steps both ran."""
    ref_by_step = {row["step"]: row for row in reference}
    worst = {"max_rel_diff": 0.0, "step": None, "steps_compared": 0}
    for row in run:
        ref = ref_by_step.get(row["step"])
        if ref is None:
            continue
        worst["steps_compared"] += 1
        diff = abs(row["loss"] - ref["loss"]) / abs(ref["loss"])
        if diff >= worst["max_rel_diff"]:
            worst.update(max_rel_diff=diff, step=row["step"], loss=row["loss"], reference_loss=ref["loss"])
    return worst


def run_train(cfg: TrainConfig) -> int:
    from hyper_parallel.train.launch import launch
    from hyper_parallel.train.rank import in_launcher, run_rank

    if in_launcher():
        run_rank(cfg)
        return 0
    launch(cfg)
    rows = read_metrics(cfg.run_dir / METRICS_FILE)
    if rows:
        last = rows[-1]
        first = rows[0]
        steps = complete_steps(cfg.checkpoint_path)
        newest = f" (newest: step_{steps[-1]:08d})" if steps else ""
        print(f"done: step {last['step']} ({last.get('dtype', 'fp32')}), loss {first['loss']:.3f} -> {last['loss']:.3f}"
              + (f", validation {last['val_loss']:.3f}" if "val_loss" in last else "")
              + f"; metrics {cfg.run_dir / METRICS_FILE}, plot {cfg.run_dir / 'loss.png'}, "
              f"checkpoints {cfg.checkpoint_path}{newest}")
    if cfg.check_parity:
        ref_dir = cfg.run_dir / "reference"
        reference = cfg.replace(nproc=1, layout=Layout(), out=str(ref_dir), checkpoint_dir=str(ref_dir / "checkpoints"),
                                resume=False, check_parity=False, checkpoint_every=0, log=())
        print("--check-parity: running the single-process reference")
        launch(reference)
        report = parity_report(rows, read_metrics(ref_dir / METRICS_FILE))
        (cfg.run_dir / "parity.json").write_text(json.dumps(report, indent=1))
        print(f"parity: largest relative loss difference {report['max_rel_diff']:.3e} at step {report['step']} "
              f"over {report['steps_compared']} steps (reference in {ref_dir})")
    return 0


def run_export(args: argparse.Namespace) -> None:
    """``hyper-parallel export`` (``ValueError`` for a bad checkpoint, format or ``--out``)."""
    from hyper_parallel.train.export import FORMATS, export_hf

    if args.format not in FORMATS:
        raise ValueError(f"--format={args.format!r} is not an export format; use one of {', '.join(FORMATS)}")
    path = export_hf(args.checkpoint, args.out, force=args.force)
    real = os.path.realpath(path)
    through_link = f" (that is {real})" if real != os.path.abspath(path) else ""  # runs/latest names the newest run
    print(f"exported {path}{through_link} as a Hugging Face model to {args.out} (config.json, model.safetensors, "
          "byte-level tokenizer)")


def _run_one_process_command(args: argparse.Namespace) -> None:
    """``export``, ``generate`` or ``eval`` (``ValueError`` for anything the user gave wrong)."""
    if args.command == "export":
        run_export(args)
    elif args.command == "generate":
        from hyper_parallel.train.generate import run_generate

        run_generate(args)
    else:
        from hyper_parallel.train.evaluate import run_eval

        run_eval(args)


def _default_folder(args: argparse.Namespace) -> bool:
    """Whether the run folder is a new one under ``runs/`` chosen here (no --out, no --run-name)."""
    return args.out is None and args.run_name is None and not args.resume


def prepare_run_folder(cfg: TrainConfig, args: argparse.Namespace, launched: bool) -> TrainConfig:
    """[Note: run folders] in ``run_folder``, before any rank starts: refuse a folder holding
    another run, claim a new default folder, give the run its id (outside a launcher).
    ``launched``: inside torchrun/msrun (every rank runs this)."""
    if launched and _default_folder(args):
        raise ValueError("inside torchrun/msrun every rank runs the command line, and the ranks cannot agree on a "
                         f"new dated folder under {run_folder.RUNS}/: give --out or --run-name (the same on every "
                         "rank), or --resume to continue the run runs/latest links to")
    if _default_folder(args):  # a new folder: the dated name may be taken within the same second
        cfg = cfg.replace(out=str(run_folder.claim(cfg.run_dir)))
    run_folder.check_not_another_run(cfg, args.overwrite)
    # a resumed run continues its checkpoint's id (loop.train); inside a launcher the ranks agree on one
    return cfg if launched or cfg.resume else cfg.replace(run_id=run_folder.new_run_id())


def start_run_folder(cfg: TrainConfig, args: argparse.Namespace, launched: bool) -> None:
    """Once every check passed: ``--overwrite`` deletes the previous run, ``runs/latest``
    links to a run under ``runs/`` (inside a launcher: rank 0 only), and the run folder is
    named."""
    from hyper_parallel.train.rank import launcher_rank

    if args.overwrite:
        deleted = run_folder.clear_previous_run(cfg)
        if deleted and not launched:
            print(f"--overwrite: deleted the previous run in {cfg.run_dir}: {', '.join(deleted)}")
    linked = args.out is None and (args.run_name is not None or not args.resume)  # as run_folder.choose
    note = None
    if linked and (not launched or launcher_rank() == 0):
        note = run_folder.link_latest(cfg.run_dir)
    if not launched:
        where = f" ({run_folder.RUNS / run_folder.LATEST} links to it)" if linked and note is None else ""
        print(f"run folder {cfg.run_dir}{where}" + (f"; {note}" if note else ""))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `hyper-parallel`: what it can do
        parser.print_help()
        return 0
    if args.command in ("export", "generate", "eval"):
        try:
            _run_one_process_command(args)
        except ValueError as err:
            parser.exit(2, f"hyper-parallel {args.command}: error: {err}\n")
        return 0
    try:
        cfg = config_from_args(args)
        cfg.refuse_unlanded()
        from hyper_parallel.train.data import check_split_sizes, split_sizes
        from hyper_parallel.train.rank import in_launcher

        # a missing --data path or too little text fails here, not on every rank
        check_split_sizes(*split_sizes(cfg.data), cfg.seq_len + 1)
        if cfg.check_parity and in_launcher():
            raise ValueError("--check-parity starts its own single-process reference and is not available inside "
                             "torchrun/msrun; run `hyper-parallel train --check-parity ...` from a shell")
        preflight.check_platform(cfg)
        preflight.check_dtype(cfg)
        cfg = prepare_run_folder(cfg, args, in_launcher())
        preflight.check_output_folders(cfg)
        # inside a launcher each rank verifies the checkpoint as it loads it (loop.train);
        # verifying here too would read every shard twice on every rank
        preflight.check_resume(cfg, verify=not in_launcher())
        start_run_folder(cfg, args, in_launcher())
    except ValueError as err:
        parser.exit(2, f"hyper-parallel train: error: {err}\n")
    from hyper_parallel.train.launch import LaunchError

    try:
        return run_train(cfg)
    except LaunchError as err:
        print(f"hyper-parallel train: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
