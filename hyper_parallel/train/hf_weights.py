"""The weights of an MoE ``--hf-config`` folder (a Mixtral or a Qwen3-MoE, ``hf_moe``) as the
initial values of the job's decoder: the inverse of ``export.moe_state``, under its one name
mapping (``hf_names.moe_name``), read piece by piece from ``safetensors`` files with numpy, so on
both frameworks and with no torch.

Each rank reads only its pieces: ``PretrainedWeights.piece`` is the job's source of initial
values (``model.PieceSource``) in place of the seed's draw ([Note: the job's initial
weights]), given each parameter's box (``local_boxes``: a fully_shard chunk inside a
tensor-parallel chunk, or ``experts / ep`` whole experts), through the same paths as the
draw (``materialize_model`` on the meta device, ``initial_pieces`` on the host). The job
stacks the experts on dim 0; Mixtral and Qwen3-MoE store one tensor per expert, so a box of
the stacked tensor reads the experts of its dim-0 range, each at the box's other dims.

Files: ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``). Values float32, float16 or bfloat16, widened to float32 exactly (the job
trains float32 parameters); bfloat16, which numpy has no type for, is read as its 16 bits
(the file's layout: an 8-byte little-endian header length, the JSON header, the data) and
shifted into float32's upper half.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyper_parallel.train.hf_names import MOE_TITLES, moe_name
from hyper_parallel.train.hf_config import read_hf_config
from hyper_parallel.train.model import PieceSource, parameter_shapes
from hyper_parallel.train.model_config import ModelConfig

#: safetensors dtypes read (each widens to float32 exactly).
READ_DTYPES = ("F32", "F16", "BF16")

#: Tensors a checkpoint may hold that are no parameter of the model: rotary tables older
#: ``transformers`` saved (the job computes its own).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its file, dtype name (``READ_DTYPES``), shape and
    byte offset of its data from the start of the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int


def _header(file: Path) -> dict[str, TensorEntry]:
    """``{name: entry}`` of a safetensors file, from its header alone."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return {name: TensorEntry(file, entry["dtype"], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0])
            for name, entry in header.items()}


def _read(entry: TensorEntry, name: str, starts: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
    """The box ``starts .. starts + lengths`` of a tensor, float32."""
    box = tuple(slice(s, s + n) for s, n in zip(starts, lengths))
    if entry.dtype == "BF16":
        bits = np.memmap(entry.file, np.dtype("<u2"), "r", entry.offset, entry.shape)[box]
        return (np.asarray(bits, np.uint32) << 16).view(np.float32)
    from safetensors import safe_open

    with safe_open(str(entry.file), "np") as handle:
        return np.asarray(handle.get_slice(name)[box], np.float32)


class PretrainedWeights:
    """The safetensors weights of an ``--hf-config`` folder, checked against the job's
    decoder ``cfg``: every parameter present under its name in ``model_type``'s files
    (``hf_names.moe_name``) with its shape, nothing else (a tensor without a place would be
    a model other than the config says).

    Raises (``open``):
        ValueError: no safetensors weights (``pytorch_model.bin`` only), a tensor missing,
            of another shape or dtype, or one the decoder has no place for.
    """

    def __init__(self, folder: Path, cfg: ModelConfig, model_type: str, entries: dict[str, TensorEntry]) -> None:
        self.folder, self.cfg, self.model_type, self.entries = folder, cfg, model_type, entries

    @classmethod
    def open(cls, folder: Path, cfg: ModelConfig, model_type: str) -> PretrainedWeights:
        where = f"--hf-config={str(folder)!r}"
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        elif (folder / "model.safetensors").is_file():
            files = [folder / "model.safetensors"]
        else:
            raise ValueError(f"{where}: the folder's weights are pytorch_model.bin, which the job's MoE decoder does "
                             "not read (a torch pickle; the job reads safetensors on both frameworks); save them as "
                             "safetensors (save_pretrained(folder, safe_serialization=True)) or give config.json alone")
        entries: dict[str, TensorEntry] = {}
        for file in files:
            entries.update(_header(file))
        problems, wanted = [], set()
        for name, shape in parameter_shapes(cfg).items():
            target = moe_name(name, model_type)
            per_expert = "{e}" in target
            for hf in ([target.replace("{e}", str(e)) for e in range(shape[0])] if per_expert else [target]):
                wanted.add(hf)
                want = shape[1:] if per_expert else shape
                entry = entries.get(hf)
                if entry is None:
                    problems.append(f"{hf} {want} is missing")
                elif entry.shape != want:
                    problems.append(f"{hf} has shape {entry.shape}, the config gives {want}")
                elif entry.dtype not in READ_DTYPES:
                    problems.append(f"{hf} is {entry.dtype}, not one of {', '.join(READ_DTYPES)}")
        extra = [name for name in entries if name not in wanted and not name.endswith(IGNORED_SUFFIXES)
                 and not (cfg.tie_embeddings and name == "lm_head.weight")]
        problems += [f"{name} has no place in the decoder the config describes" for name in extra]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ValueError(f"{where}: the weights are not the {MOE_TITLES[model_type]} its config.json describes: "
                             f"{'; '.join(problems[:3])}{more}; give the config that was saved with them")
        return cls(folder, cfg, model_type, entries)

    def piece(self, name: str, starts: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
        """The box ``starts .. starts + lengths`` of the job's parameter ``name``: float32
        ``[*lengths]``, read from the files (only that box, and for the stacked experts
        only the experts of its dim-0 range)."""
        target = moe_name(name, self.model_type)
        if "{e}" not in target:
            return _read(self.entries[target], target, starts, lengths)
        experts = range(starts[0], starts[0] + lengths[0])
        pieces = [_read(self.entries[target.replace("{e}", str(e))], target.replace("{e}", str(e)), starts[1:],
                        lengths[1:]) for e in experts]
        return np.stack(pieces) if pieces else np.zeros(tuple(lengths), np.float32)


def pretrained_source(hf_config: str | None, model: ModelConfig) -> PieceSource | None:
    """The initial values of the job's decoder ``model`` from the ``--hf-config`` folder's
    weights (``PretrainedWeights.piece``), or ``None`` (the seed's draw): no ``--hf-config``
    or a ``config.json`` alone. Not for ``transformers``' own model (``TrainConfig.hf_module``:
    ``from_pretrained`` loads it). Reads the files' headers (``TrainConfig`` checked them)."""
    if hf_config is None:
        return None
    source = read_hf_config(hf_config)
    if source.weights_dir is None:
        return None
    return PretrainedWeights.open(source.weights_dir, model, source.model_type).piece
