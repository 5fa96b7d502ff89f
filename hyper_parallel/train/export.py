"""``hyper-parallel export``: a checkpoint of the main job as a consolidated Hugging Face model
folder, for evaluation and serving (``transformers``, vLLM, lm-eval, ...)::

    hyper-parallel export runs/latest/checkpoints --format hf --out exported/
    # exported/config.json, model.safetensors, tokenizer.json, tokenizer_config.json

One process, no process group, no torch or MindSpore: the checkpoint is read through
``checkpoint.read_pieces`` with whole-tensor boxes (the pieces of any layout that wrote it,
tp, fully_shard, pp, ..., assembled into whole tensors), and written with
``safetensors.numpy``. So a MindSpore run exports as a torch run does.

[Note: the job's decoder as Hugging Face's Llama]
The job's decoder (``train/model.py``) computes what ``transformers.LlamaForCausalLM``
computes, parameter for parameter (``hf_names.HF_NAMES``), with no reordering of any weight:

- RMSNorm: ``x * rsqrt(mean(x^2, -1) + eps) * weight``, eps inside the square root, the
  weight applied after the normalisation: ``LlamaRMSNorm`` (which computes in float32; the
  job and the export are float32). ``norm_eps`` -> ``rms_norm_eps``.
- RoPE: the job rotates feature pairs ``(i, i + head_dim / 2)`` (``x1 cos - x2 sin``,
  ``x2 cos + x1 sin``) by ``pos * theta^(-2i / head_dim)``: HF's ``rotate_half`` with
  ``cos = cat(freqs, freqs)``, default rope type, attention scaling 1. So ``wq``/``wk`` rows
  need no permutation (Meta's original Llama rotates adjacent pairs ``(2i, 2i + 1)``, which
  is why HF's conversion script permutes them; the job never did). The job's tables are
  computed in float64 and rounded, HF's in float32: angles differ by a few float32 ulps.
- Attention: ``wq``'s rows are head-major (``[n_heads, head_dim]`` flattened: the job
  reshapes by ``(-1, head_dim)``, as HF's ``view(..., -1, head_dim)``), likewise ``wk``/``wv``
  with ``n_kv_heads``; query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``
  (the fused kernels' grouped-query convention, HF's ``repeat_kv``); causal, scale
  ``head_dim ** -0.5``, no biases, no dropout; ``wo`` -> ``o_proj``.
- SwiGLU: ``w2(silu(w1 x) * w3 x)``: ``w1`` is the gate (``gate_proj``), ``w3`` the up
  projection (``up_proj``), ``w2`` the down projection; ``hidden_act = "silu"``.
- Pre-norm blocks ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``, a final norm, the
  head ``h @ output^T`` (or the embedding's, ``tie_word_embeddings``).

``tests/train/test_export.py`` checks it: ``LlamaForCausalLM.from_pretrained`` of an export
gives the job's logits within 1e-5.

A checkpoint of an ``--hf-config`` run holds the HF model's own parameter names; its
manifest's model record holds the HF configuration it was trained from (``hf_config``,
``hf_config.recorded_config``), which is written back as ``config.json``.

Tokens are bytes (ids 0-255, one per UTF-8 byte; ``train/data.py``). The export writes a
byte-level ``tokenizer.json`` (``tokenizers``' byte-level pre-tokenizer and a BPE model with
the 256 byte symbols as its vocabulary, in byte order, and no merges), so
``AutoTokenizer.from_pretrained(out)`` maps text to its UTF-8 bytes and back, with no
special tokens (no BOS, EOS or padding: the job trains on raw bytes).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.core.fully_shard import Box
from hyper_parallel.train import checkpoint
from hyper_parallel.train.hf_names import MOE_TITLES, hf_name, moe_name
from hyper_parallel.train.model_config import VOCAB_SIZE, ModelConfig

#: ``--format`` values.
FORMATS = ("hf",)

#: The files an export writes (``--force`` replaces these and leaves any other file).
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
EXPORTED_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)

def llama_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` for the job's decoder ``cfg`` (plain JSON: no
    ``transformers`` import). ``rope_theta`` is given both as ``transformers`` 5 reads it
    (``rope_parameters``) and as earlier readers do; no BOS/EOS/padding ids (byte tokens)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
        "use_cache": True,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in of each byte, which ``tokenizers``' ``ByteLevel``
    pre-tokenizer maps bytes to (printable ASCII and Latin-1 as themselves, the others to
    ``chr(256 + n)``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer(model_max_length: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tokenizer.json, tokenizer_config.json)`` of the job's byte vocabulary: token id =
    byte value, text <-> its UTF-8 bytes (see the module docstring)."""
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    symbols = _bytes_to_unicode()
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": level, "post_processor": None, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {symbols[b]: b for b in range(VOCAB_SIZE)}, "merges": []},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    return tokenizer, config


def find_checkpoint(given: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``given`` names and its manifest: a ``step_XXXXXXXX`` folder (which must
    verify), or a checkpoint root (its newest complete checkpoint, skipping, with a warning,
    newer ones that were cut off).

    Raises:
        ValueError: no such folder; a step folder that does not verify (why); a root with
            no ``step_*`` folder, or none that verifies (each one's reason); a checkpoint of
            another format than this version reads.
    """
    path = Path(given)
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist; give a checkpoint folder (step_XXXXXXXX) "
                         "or the folder holding them (<out>/checkpoints, or the run's --checkpoint-dir)")
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is a file, not a folder; give a checkpoint folder "
                         "(step_XXXXXXXX) or the folder holding them")
    if path.name.startswith("step_") or checkpoint.manifest_file(path) is not None:
        problem = checkpoint.verify(path)
        if problem is not None:
            raise ValueError(f"checkpoint {str(path)!r} is unusable: {problem}; export another step_* folder "
                             "or give the checkpoint root (the newest complete one is taken)")
        manifest = checkpoint.read_manifest(path)
    else:
        steps = checkpoint.complete_steps(path)
        if not steps:
            raise ValueError(f"{str(path)!r} holds no step_* checkpoint; give a checkpoint folder "
                             "(step_XXXXXXXX) or the folder holding them (<out>/checkpoints)")
        with warnings.catch_warnings(record=True) as skipped:
            warnings.simplefilter("always")
            found = checkpoint.latest_manifest(path)
        if found is None:
            reasons = "; ".join(f"step_{s:08d}: {checkpoint.verify(path / f'step_{s:08d}')}" for s in steps[-3:])
            raise ValueError(f"none of the {len(steps)} checkpoints under {str(path)!r} is complete "
                             f"({reasons})")
        for warning in skipped:
            warnings.warn(str(warning.message), RuntimeWarning, stacklevel=2)
        path, manifest = found
    if manifest.get("format") not in checkpoint.READABLE_FORMATS:
        raise ValueError(f"checkpoint {str(path)!r} has format {manifest.get('format', 1)}, this version "
                         f"reads formats {checkpoint.READABLE_FORMATS}; export it with the version that wrote it")
    return path, manifest


def whole_parameters(path: Path, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    """``{fqn: whole tensor}`` of every parameter of the checkpoint, assembled from the
    pieces of the layout that wrote it (``checkpoint.read_pieces`` with whole-tensor boxes;
    no optimizer state is read)."""
    boxes = {}
    for key, entry in manifest["tensors"].items():
        if key.startswith("param/"):
            shape = tuple(entry["shape"])
            boxes[key] = Box(shape, (0,) * len(shape), shape)
    arrays = checkpoint.read_pieces(path, manifest, boxes)
    return {key.split("/", 1)[1]: value for key, value in arrays.items()}


def decoder_sizes(path: Path, manifest: dict[str, Any]) -> ModelConfig:
    """The sizes of the job's decoder a checkpoint's manifest records (no tensor read).

    Raises:
        ValueError: the checkpoint holds an ``--hf-config`` run's model, or its model record
            is not one this version builds.
    """
    record = dict(manifest.get("model") or {})
    if "hf_config" in record:
        raise ValueError(f"checkpoint {str(path)!r} holds a Hugging Face model (an --hf-config run), not the job's "
                         "decoder; export it (hyper-parallel export --format hf) and load it with transformers")
    try:
        return ModelConfig(**record)
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {str(path)!r} records a model this version cannot build ({err}); "
                         "use the version that wrote it") from err


def decoder_state(path: Path, manifest: dict[str, Any]) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``(sizes, {name: whole tensor})`` of the job's decoder a checkpoint holds, under the
    job's names (``model.parameter_shapes``), whatever layout wrote it (``whole_parameters``).
    What ``hf_state``, ``hyper-parallel generate`` and ``hyper-parallel eval`` read.

    Raises:
        ValueError: see ``decoder_sizes``; or the checkpoint's parameters are not the
            model's (a missing or extra name, another shape).
    """
    cfg = decoder_sizes(path, manifest)
    params = whole_parameters(path, manifest)
    if any(name.startswith(("model.", "lm_head.")) for name in params):
        raise ValueError(f"checkpoint {str(path)!r} holds a Hugging Face model's parameters (an --hf-config run) but "
                         "its manifest does not record the HF configuration it was trained from (written before "
                         "checkpoints recorded it, which they do since hyper-parallel export); export a checkpoint "
                         "of a run of this version")
    from hyper_parallel.train.model import parameter_shapes

    expected = parameter_shapes(cfg)
    problems = [f"{name} {shape} is missing" for name, shape in expected.items() if name not in params]
    problems += [f"{name} has shape {params[name].shape}, the model record gives {shape}"
                 for name, shape in expected.items() if name in params and params[name].shape != shape]
    problems += [f"{name} is not a parameter of the recorded model" for name in params if name not in expected]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"checkpoint {str(path)!r} does not hold the decoder its manifest records: "
                         f"{'; '.join(problems[:3])}{more}")
    return cfg, {name: params[name] for name in expected}


def moe_biases(path: Path, manifest: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """``{"layers.{i}.moe": bias [experts]}``: the aux-free balance bias of each MoE block of
    the checkpoint's decoder ``cfg`` (float32; zeros under ``--moe-balance aux-loss``, which
    never moves them). They choose the experts ([Note: the job's MoE routing]), so a model
    without them routes otherwise than the one trained.

    Raises:
        ValueError: an MoE block's bias is not in the checkpoint.
    """
    from hyper_parallel.train.moe_model import moe_layer_names

    keys = {name: f"moe_bias/{name}.expert_bias" for name in moe_layer_names(cfg)}
    missing = [key for key in keys.values() if key not in manifest["tensors"]]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} holds a mixture-of-experts decoder without its balance biases "
                         f"({', '.join(missing[:3])}); it was written by another version: resume and save it with "
                         "this one")
    shape = (cfg.moe_experts,)
    arrays = checkpoint.read_pieces(path, manifest, {key: Box(shape, (0,), shape) for key in keys.values()})
    return {name: np.asarray(arrays[key], np.float32) for name, key in keys.items()}


def moe_state(path: Path, cfg: ModelConfig, params: dict[str, np.ndarray],
              biases: dict[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config.json, {HF name: tensor})`` of the job's MoE decoder as a Hugging Face MoE
    model: with per-head query/key norms (``qk_norm``) ``Qwen3MoeForCausalLM``, else
    ``MixtralForCausalLM``. Both: Llama's attention, norms and embeddings ([Note: the job's
    decoder as Hugging Face's Llama]) and a softmax router whose top-k probabilities weight
    SwiGLU experts ([Note: the job's MoE routing]); Mixtral renormalises them and has every
    block MoE, Qwen3-MoE renormalises with ``norm_topk_prob`` and has its MoE blocks every
    ``decoder_sparse_step``-th ([Note: Qwen3-MoE as the job's MoE decoder] in ``hf_moe``).

    Raises:
        ValueError: a decoder the format cannot hold: shared experts, non-zero aux-free
            balance biases (the HF routers route by the probabilities alone); for Mixtral
            also dense blocks between MoE blocks (``--moe-every`` > 1), top-1 routing
            (Mixtral's single gate is 1, the job's the probability) and gates that are not
            renormalised (``--no-moe-norm-topk``).
    """
    kind = "qwen3_moe" if cfg.qk_norm else "mixtral"
    problems = []
    if kind == "mixtral" and cfg.moe_every != 1:
        problems.append(f"--moe-every {cfg.moe_every} leaves dense blocks between the MoE ones (Mixtral's are all "
                        "MoE; train with --moe-every 1)")
    if cfg.moe_shared_experts:
        problems.append(f"--moe-shared-experts {cfg.moe_shared_experts} ({MOE_TITLES[kind]} has no shared expert; "
                        "train with --moe-shared-experts 0)")
    if kind == "mixtral" and cfg.moe_top_k == 1:
        problems.append("--moe-top-k 1 weights each token's expert by its probability, Mixtral by 1 (train "
                        "with --moe-top-k 2 or more)")
    if kind == "mixtral" and cfg.moe_top_k > 1 and not cfg.moe_norm_topk:
        problems.append("--no-moe-norm-topk leaves the top-k gates as they are, Mixtral renormalises them (train "
                        "with --moe-norm-topk)")
    moved = [name for name, bias in biases.items() if np.any(bias)]
    if moved:
        problems.append(f"the aux-free balance biases of {len(moved)} block(s) ({moved[0]}, ...) are not zero and "
                        f"choose the experts, which {MOE_TITLES[kind]}'s router cannot (train with --moe-balance "
                        "aux-loss)")
    if problems:
        raise ValueError(f"checkpoint {str(path)!r} holds a mixture-of-experts decoder that Hugging Face's "
                         f"{MOE_TITLES[kind]} format cannot hold: {'; '.join(problems)}. hyper-parallel generate and "
                         "eval read it as it is")
    config = llama_config(cfg)
    common = {"num_experts_per_tok": cfg.moe_top_k, "output_router_logits": False,
              "router_aux_loss_coef": cfg.moe_aux_loss_coef, "sliding_window": None}
    if kind == "mixtral":
        config.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                       "intermediate_size": cfg.expert_hidden_dim, "num_local_experts": cfg.moe_experts,
                       "router_jitter_noise": 0.0})
        config.pop("attention_bias")
    else:
        config.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                       "intermediate_size": cfg.hidden_dim, "moe_intermediate_size": cfg.expert_hidden_dim,
                       "num_experts": cfg.moe_experts, "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": [],
                       # the job's top-1 gate is the probability: not renormalised
                       "norm_topk_prob": cfg.moe_norm_topk and cfg.moe_top_k > 1, "use_sliding_window": False})
    config.pop("mlp_bias")
    tensors: dict[str, np.ndarray] = {}
    for name, value in params.items():
        target = moe_name(name, kind)
        if "{e}" in target:
            tensors.update({target.replace("{e}", str(e)): value[e] for e in range(value.shape[0])})
        else:
            tensors[target] = value
    return config, tensors


def hf_state(path: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config.json, {HF name: whole tensor})`` of the checkpoint: the job's decoder as
    ``LlamaForCausalLM`` (its MoE decoder as ``MixtralForCausalLM`` or ``Qwen3MoeForCausalLM``:
    ``moe_state``), or
    an ``--hf-config`` run's model under its own names and configuration.

    Raises:
        ValueError: see ``decoder_state``, ``moe_biases`` and ``moe_state``; a dense decoder with
            ``qk_norm``.
    """
    record = manifest.get("model") or {}
    if "hf_config" in record:
        return record["hf_config"], whole_parameters(path, manifest)
    cfg, params = decoder_state(path, manifest)
    if cfg.moe_experts:
        return moe_state(path, cfg, params, moe_biases(path, manifest, cfg))
    if cfg.qk_norm:
        raise ValueError(f"checkpoint {str(path)!r} holds a dense decoder with per-head query/key norms (qk_norm), "
                         "which Hugging Face's Llama does not compute and this version exports to no other format; "
                         "hyper-parallel generate and eval read it as it is")
    return llama_config(cfg), {hf_name(name): value for name, value in params.items()}


def check_out(out: Path, force: bool) -> None:
    """Raise ``ValueError`` unless ``out`` can take an export: absent, an empty folder, or
    (``force``) a folder whose exported files are replaced."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; give a folder (created if missing)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {str(out)!r} exists and is not empty; give a new or empty folder, or --force "
                         f"to replace the exported files there ({', '.join(EXPORTED_FILES)})")


def _write_atomic(target: Path, write: Any) -> None:
    """``write(tmp_path)``, then rename onto ``target`` (a reader never sees half a file),
    readable as any file this process creates (``safetensors`` writes mode 0600)."""
    tmp = target.with_name(f".{target.name}.tmp")
    write(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, target)


def export_hf(given: str | os.PathLike[str], out: str | os.PathLike[str], force: bool = False) -> Path:
    """Write the checkpoint ``given`` (``find_checkpoint``) as a Hugging Face model folder
    ``out``: ``config.json``, ``model.safetensors`` (whole float32 tensors, as trained) and
    the byte-level tokenizer (``byte_tokenizer``). Returns the checkpoint exported.

    Raises:
        ValueError: the checkpoint cannot be found, verified or read as a model
            (``find_checkpoint``, ``hf_state``), ``out`` cannot take it (``check_out``), or
            ``safetensors`` is not installed.
    """
    try:
        from safetensors.numpy import save_file
    except ImportError as err:
        raise ValueError(f"--format hf writes model.safetensors and needs the safetensors package ({err}); "
                         "pip install safetensors") from err
    out = Path(out)
    check_out(out, force)
    path, manifest = find_checkpoint(given)
    config, tensors = hf_state(path, manifest)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    # "format": "pt" is what transformers' safetensors loader expects of a torch checkpoint
    _write_atomic(out / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    tokenizer, tokenizer_config = byte_tokenizer(int(config.get("max_position_embeddings") or 0) or 2 ** 30)
    for name, document in ((CONFIG_FILE, config), (TOKENIZER_FILE, tokenizer),
                           (TOKENIZER_CONFIG_FILE, tokenizer_config)):
        _write_atomic(out / name, lambda tmp, document=document: tmp.write_text(
            json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"))
    return path
