"""``hyper-parallel train --hf-config PATH``: a Hugging Face causal LM as the main job's model
(torch backend; ``transformers`` is imported only here and only on that path).

The configuration is read as plain JSON before any rank starts (``hf_config``); each rank then
builds the model (``build_hf_model``: ``from_config`` on the run's seed, or
``from_pretrained`` when the folder holds weights), parallelizes it with
``hyper_parallel.integrations.transformers.parallelize`` in the job's layout and meshes,
and wraps it in ``HFLossModel``, which has the job's model interface
``(tokens, positions, targets) -> mean cross-entropy``.

The vocabulary: see ``hf_config``.
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.core.dtensor import DeviceMesh
from hyper_parallel.platform import Platform
from hyper_parallel.train.config import Layout
from hyper_parallel.train.hf_config import HFSource, read_hf_config

def _load(source: HFSource, seed: int) -> Any:
    import transformers

    from hyper_parallel.integrations.transformers import ATTN_IMPLEMENTATION, register_attention

    register_attention()
    # the same initial weights on every rank and in the reference: one seed before the init
    torch.manual_seed(seed)
    if source.weights_dir is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=torch.float32,
                                                                 attn_implementation=ATTN_IMPLEMENTATION)
    config = transformers.AutoConfig.from_pretrained(source.config_file)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         attn_implementation=ATTN_IMPLEMENTATION)


def build_hf_model(p: Platform, hf_config: str, seed: int, mesh: DeviceMesh | None, layout: Layout,
                   cp_mesh: DeviceMesh | None, activation_checkpointing: bool) -> HFLossModel:
    """This rank's HF model in ``layout`` (``mesh`` ``None``: one rank, unparallelized),
    wrapped as the job's model. Collective when ``mesh`` is given (``parallelize``)."""
    from hyper_parallel.integrations.transformers import parallelize
    from hyper_parallel.train.parallelize import context_parallel_style

    hf = _load(read_hf_config(hf_config), seed)
    hf.train()
    if mesh is not None:
        style = context_parallel_style(layout)
        cp_mode = "ulysses" if layout.cp_mode == "ulysses" else (
            layout.cp_kv_exchange if layout.cp_mode == "hybrid" else layout.cp_mode)
        parallelize(hf, mesh, cp_mode=cp_mode, load_balance=style.load_balance,
                    ulysses_degree=layout.ulysses_degree if layout.cp_mode == "hybrid" else None,
                    activation_checkpointing=activation_checkpointing, cp_mesh=cp_mesh)
    elif activation_checkpointing:
        from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper
        from hyper_parallel.integrations.transformers import decoder_layers

        for layer in decoder_layers(hf):
            checkpoint_wrapper(layer)
    return HFLossModel(hf)


class HFLossModel(torch.nn.Module):
    """The job's model interface around an HF causal LM: ``forward(tokens, positions,
    targets)`` -> the mean cross-entropy over this rank's tokens (float32 scalar), as the
    job's own decoder returns.

    Args (of ``forward``):
        tokens: ``[batch, seq]`` int64 byte ids (this rank's sequence shard under CP).
        positions: ``[batch, seq]`` their global positions (RoPE, masks).
        targets: ``[batch, seq]`` the next byte of each position (shifted by the loader
            over the whole sequence, so no target is lost at a shard edge).
    """

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.hf(input_ids=tokens, position_ids=positions, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
