"""``hyper-parallel train --hf-config PATH``: a Hugging Face causal LM as the main job's model
(torch backend; ``transformers`` is imported only here and only on that path).

The configuration is read as plain JSON before any rank starts (``hf_config``); each rank then
builds the model (``build_hf_model``: ``from_config`` on the run's seed, or
``from_pretrained`` when the folder holds weights), parallelizes it with
``hyper_parallel.integrations.transformers.parallelize`` in the job's layout and meshes,
and wraps it in ``HFLossModel``, which has the job's model interface
``(tokens, positions, targets) -> mean cross-entropy``.

The vocabulary: see ``hf_config``.

torch by nature: Hugging Face's models are torch modules, so this module (alone in
``train/``, see ``tests/train/test_one_definition.py``) imports torch.
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


def load_hf_model(hf_config: str, seed: int) -> Any:
    """The HF model of ``--hf-config`` in training mode, float32, on ``seed`` (or its
    folder's weights), with ``attn_implementation="hyper_parallel"``."""
    hf = _load(read_hf_config(hf_config), seed)
    hf.train()
    return hf


def _cp_arguments(layout: Layout) -> dict[str, Any]:
    """``parallelize``'s context-parallel arguments for the job's ``--cp-mode`` (the job's
    load balance: ``train.parallelize.context_parallel_style``)."""
    from hyper_parallel.train.parallelize import context_parallel_style

    if layout.cp_mode == "hybrid":
        return dict(cp_mode=layout.cp_kv_exchange, ulysses_degree=layout.ulysses_degree,
                    load_balance=context_parallel_style(layout).load_balance)
    return dict(cp_mode=layout.cp_mode, ulysses_degree=None, load_balance=context_parallel_style(layout).load_balance)


def build_hf_model(p: Platform, hf_config: str, seed: int, mesh: DeviceMesh | None, layout: Layout,
                   cp_mesh: DeviceMesh | None, activation_checkpointing: bool) -> HFLossModel:
    """This rank's HF model in ``layout`` (``mesh`` ``None``: one rank, unparallelized),
    wrapped as the job's model. Collective when ``mesh`` is given (``parallelize``)."""
    from hyper_parallel.integrations.transformers import parallelize

    hf = load_hf_model(hf_config, seed)
    if mesh is not None:
        parallelize(hf, mesh, **_cp_arguments(layout), activation_checkpointing=activation_checkpointing,
                    cp_mesh=cp_mesh)
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


class HFStage(torch.nn.Module):
    """One pipeline stage of an HF causal LM (``--pp``), with the interface of the job's
    own stages (``model.build_stage``): stage 0 takes ``(tokens, positions)`` and embeds;
    later stages take ``(h, positions_f)``, the residual stream float32 ``[batch, seq,
    hidden]`` and the positions as float32 (a stage boundary carries floating tensors);
    the last stage returns the logits ``[batch, seq, vocab]``, the others ``(h,
    positions_f)``. Every stage computes the rotary embeddings of its positions.

    It holds the model's own modules under the model's names (``model.embed_tokens``,
    ``model.layers.{i}`` by the layer's index, ``model.norm``, ``lm_head``), so its
    parameters keep the names of the unpipelined model: checkpoints move between
    layouts with and without ``--pp``.
    """

    def __init__(self, hf: Any, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        base = hf.get_decoder() if hasattr(hf, "get_decoder") else hf.model
        self.first, self.last = first, last
        self.model = torch.nn.Module()
        if first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = torch.nn.ModuleDict({str(i): base.layers[i] for i in layers})
        self.model.rotary_emb = base.rotary_emb  # buffers only: shared by the stages
        if last:
            self.model.norm = base.norm
            self.lm_head = hf.lm_head

    def forward(self, *inputs: torch.Tensor) -> Any:
        if self.first:
            tokens, positions = inputs
            h = self.model.embed_tokens(tokens)
            carried = positions.to(torch.float32)
        else:
            h, carried = inputs
            positions = carried.to(torch.int64)
        rotary = self.model.rotary_emb(h, position_ids=positions)
        for layer in self.model.layers.values():
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary, use_cache=False)
            h = out[0] if isinstance(out, tuple) else out
        if not self.last:
            return h, carried
        return self.lm_head(self.model.norm(h))


def build_hf_stages(hf: Any, ranges: list[range], indices: list[int], num_stages: int, mesh: DeviceMesh,
                    layout: Layout, cp_mesh: DeviceMesh | None, activation_checkpointing: bool) -> list[HFStage]:
    """This rank's stage modules (``indices`` of ``num_stages``, stage ``s`` running the
    layers ``ranges[s]``), each through the chain of ``parallelize`` over the submeshes of
    its pipeline coordinate (``integrations.transformers.apply_layout``; see the job's
    [Note: pipeline stages and the other axes]). The model's own plan names
    ``model.layers.*`` and ``lm_head``, as the stages do. Collective: the TP broadcasts and
    fully_shard's groups, the same number of calls on every rank (each holds as many stages)."""
    from hyper_parallel.integrations.transformers import make_context_parallel, apply_layout, tensor_parallel_plan

    stages = [HFStage(hf, ranges[s], s == 0, s == num_stages - 1) for s in indices]
    tp_plan = tensor_parallel_plan(hf) if layout.tp > 1 else {}
    cp = _cp_arguments(layout)
    cp_style = (make_context_parallel(cp["cp_mode"], cp["load_balance"], cp["ulysses_degree"])
                if layout.cp > 1 else None)
    for stage in stages:
        apply_layout(stage, hf, mesh, tp_plan=tp_plan, cp_style=cp_style, cp_mesh=cp_mesh,
                     activation_checkpointing=activation_checkpointing)
    return stages
