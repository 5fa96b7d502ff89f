"""The mixture-of-experts block of the job's decoder (``--moe-experts N``), defined once over
the platform's module classes like ``model.py``, and the per-step balancing of its routers.

A block ``i`` with ``ModelConfig.is_moe_block(i)`` replaces the dense SwiGLU MLP by
``layers.{i}.moe``::

    layers.{i}.moe.router.weight                [experts, dim]
    layers.{i}.moe.experts.w{1,3}               [experts, expert_hidden, dim]
    layers.{i}.moe.experts.w2                   [experts, dim, expert_hidden]
    layers.{i}.moe.shared_expert.w{1,3}.weight  [shared * expert_hidden, dim]   (with --moe-shared-experts)
    layers.{i}.moe.shared_expert.w2.weight      [dim, shared * expert_hidden]

[Note: the job's MoE routing]
Each token ``x`` ``[tokens, dim]`` gets router probabilities ``softmax(x W_r^T)`` in float32
``[tokens, experts]``; its ``top_k`` experts are the largest ``probs + bias`` (``bias``
float32 ``[experts]``: zero with ``aux-loss`` and ``none``, DeepSeek-V3's balance bias with
``aux-free``; it steers the choice only, never the gates), chosen on the host by numpy's
stable argsort (ties go to the lower expert index, on both frameworks alike). The gates are
the chosen probabilities, renormalized to sum to 1 when ``top_k > 1`` (Mixtral, DeepSeek-V3,
Qwen3-MoE's ``norm_topk_prob: true``; with ``top_k = 1`` Switch's unnormalized probability,
so the router keeps a gradient), or left as they are with ``moe_norm_topk`` false
(Qwen3-MoE's default ``norm_topk_prob: false``: the gradient reaches the router through
the chosen probabilities alone). The token's output is ``sum_j gate_j * expert_j(x) + shared(x)``, each expert a
SwiGLU. Routing is dropless: every (token, slot) row reaches its expert, whatever the
load (no capacity factor); the step's metrics count the rows routed against the rows
expected, so a dropped row would show. The routing decisions are integers on the host
(as in every MoE implementation that sizes its expert batches); the gates stay
differentiable, and the rows are reordered by expert with core's ``RoutingPlan`` (the
permutation ``expert_parallel.MoE`` dispatches over an expert-parallel group).

[Note: balance across layouts]
Both balancing methods are written so that every data-parallel layout computes the
single process's values: ``aux-free`` moves the bias by ``rate * sign(mean load - load)``
(DeepSeek-V3, arXiv 2412.19437, section 2.1.2) from the step's loads summed over the
data- and context-parallel ranks (``balance_step``: one all-reduce), the same integers
the single process counts; ``aux-loss`` is Switch's ``E * sum_e f_e P_e`` (arXiv
2101.03961, eq. 4), taken per sequence and averaged over the sequences (DeepSeek-V3's
sequence-wise form, eq. 17-20), so each data-parallel rank's mean over its own whole
sequences averages to the global one (a batch-wise ``f_e`` would need its counts
all-reduced inside the forward). A context-parallel rank holds part of each sequence,
so ``aux-loss`` is refused with ``--cp``.

[Note: expert-parallel gradients]
With ``--ep N`` the routed experts are DTensor parameters sharded on dim 0 over an
expert-parallel group of ``N`` ranks of the ``dp_shard`` axis
(``parallelize.expert_parallel_meshes``), ``experts / N`` whole experts per rank. Each
rank's loss is the mean over its own tokens, and the step's loss the mean of those over
all ``D`` data-parallel ranks. The combine's backward brings back to each rank the
cotangents of the rows its experts computed for the ``N`` ranks of its group, so the
backward leaves there the sum of those ``N`` ranks' gradients. fully_shard then averages
over the ``D / N`` ranks that hold the same experts (HSDP with ``--dp-replicate``), giving
``N / D`` times the sum over all ``D`` ranks: ``N`` times the step's gradient.
``ScaleGradient`` multiplies the local weights' gradient by ``1 / N`` before that reduction,
so the optimizer, the global gradient norm and clipping see the single process's gradient.
Where no other rank holds the same experts (``N = D``, no replicas) the experts stay out of
fully_shard and the scaled sum is already the average.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyper_parallel.core.activation_checkpoint import CheckpointPhase, checkpoint_phase
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.expert_parallel import MoE as ExpertParallelMoE
from hyper_parallel.core.expert_parallel import RoutingPlan
from hyper_parallel.core.pipeline_parallel import in_stage_backward
from hyper_parallel.core.tensor_ops import stack
from hyper_parallel.platform import Activation, Platform
from hyper_parallel.platform.contract.common import CustomFunction
from hyper_parallel.train.model_config import ModelConfig


def moe_parameter_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The MoE sublayer's parameters of the block whose names start with ``prefix``
    (``"layers.{i}."``), in the order the module registers them (initialisation draws)."""
    e, h, d = cfg.moe_experts, cfg.expert_hidden_dim, cfg.dim
    shapes = {prefix + "moe.router.weight": (e, d), prefix + "moe.experts.w1": (e, h, d),
              prefix + "moe.experts.w2": (e, d, h), prefix + "moe.experts.w3": (e, h, d)}
    if cfg.moe_shared_experts:
        shared = cfg.moe_shared_experts * h
        shapes[prefix + "moe.shared_expert.w1.weight"] = (shared, d)
        shapes[prefix + "moe.shared_expert.w2.weight"] = (d, shared)
        shapes[prefix + "moe.shared_expert.w3.weight"] = (shared, d)
    return shapes


@dataclass
class RoutingCounts:
    """What one MoE layer's training forwards routed since the last ``balance_step``.

    Attributes:
        tokens: int64 ``[experts]`` (token, slot) rows sent to each expert.
        rows: rows the forwards had to route (tokens x top_k): ``rows - tokens.sum()`` is
            the dropped rows (0: dropless).
        aux_loss: the sum of the forwards' auxiliary losses (``aux-loss``; 0 otherwise).
        forwards: training forwards counted.
    """

    tokens: np.ndarray
    rows: int = 0
    aux_loss: float = 0.0
    forwards: int = 0

    def reset(self) -> None:
        self.tokens[:] = 0
        self.rows, self.aux_loss, self.forwards = 0, 0.0, 0


def route(p: Platform, logits: Any, top_k: int, bias: np.ndarray,
          renormalize: bool = True) -> tuple[Any, np.ndarray, Any]:
    """``(probs, chosen, gates)`` of router ``logits`` ``[tokens, experts]``: float32 softmax
    probabilities ``[tokens, experts]`` (differentiable), the chosen experts int64 ``[tokens,
    top_k]`` (host) and their gates ``[tokens, top_k]`` float32 (differentiable), by
    [Note: the job's MoE routing]; ``renormalize`` (``ModelConfig.moe_norm_topk``): the
    gates of ``top_k > 1`` sum to 1."""
    probs = p.softmax(logits.float(), -1)  # the framework's fused softmax
    scores = p.to_numpy(p.detach(probs)) + bias[None, :]
    chosen = np.argsort(-scores, axis=1, kind="stable")[:, :top_k].astype(np.int64)
    eye = np.eye(scores.shape[1], dtype=np.float32)
    # one-hot products pick each slot's probability with a gradient on both frameworks
    gates = stack([(probs * p.from_numpy(eye[chosen[:, j]])).sum(-1) for j in range(top_k)], 1)
    if top_k > 1 and renormalize:
        gates = gates / gates.sum(-1).unsqueeze(-1)
    return probs, chosen, gates


def routing_plan(p: Platform, chosen: np.ndarray, gates: Any, num_experts: int) -> RoutingPlan:
    """Core's ``RoutingPlan`` of host decisions ``chosen`` ``[tokens, top_k]``: the (token,
    slot) rows in stable expert order, their inverse, the rows per expert."""
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int64)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size, dtype=np.int64)
    return RoutingPlan(gates, chosen.shape[1], order, inverse, np.bincount(flat, minlength=num_experts))


def sequence_aux_loss(p: Platform, probs: Any, chosen: np.ndarray, batch: int) -> Any:
    """Switch's balance loss per sequence, averaged over the ``batch`` sequences: a float32
    scalar ``mean_b E * sum_e f_{b,e} P_{b,e}`` with ``f_{b,e}`` the fraction of sequence
    ``b``'s (token, slot) rows routed to ``e`` (host counts, no gradient) and ``P_{b,e}`` its
    tokens' mean probability of ``e`` (differentiable). 1 at perfect balance ([Note:
    balance across layouts]). ``probs`` ``[batch * seq, experts]``, ``chosen`` ``[batch *
    seq, top_k]``."""
    experts = probs.shape[-1]
    per_seq = chosen.reshape(batch, -1)
    counts = np.stack([np.bincount(row, minlength=experts) for row in per_seq]).astype(np.float32)
    fraction = counts * (experts / per_seq.shape[1])
    mean_probs = probs.reshape(batch, -1, experts).mean(1)
    return (mean_probs * p.from_numpy(fraction)).sum(-1).mean()


class ScaleGradient(CustomFunction):
    """``ScaleGradient(x, factor)``: ``x`` unchanged forward; the backward multiplies the
    gradient by ``factor`` (a float). [Note: expert-parallel gradients]"""

    @staticmethod
    def forward(ctx: Any, x: Any, factor: float) -> Any:
        ctx.factor = factor
        return x  # torch hands out an input returned as is as a view of it; MindSpore copies it

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        return (grad if ctx.factor == 1.0 else grad * ctx.factor), None


@functools.cache
def define_moe(p: Platform) -> type:
    """The MoE sublayer class on ``p`` (a subclass of ``p.module_types().Module``), defined
    on first use (one class identity per platform, which ``moe_layers`` looks for)."""
    types = p.module_types()
    Module, Linear = types.Module, types.Linear
    float32 = p.dtype("float32")

    def grouped_swiglu(x: Any, sizes: list[int], w1: Any, w2: Any, w3: Any) -> Any:
        """``w2[e] (silu(w1[e] x) * w3[e] x)`` of rows ``x`` ``[n, dim]`` grouped by expert
        (``sizes[e]`` consecutive rows for expert ``e``), weights ``[experts, out, in]``
        (Linear's form per expert): three ``Platform.grouped_matmul`` calls, the grouped
        GEMM kernel where the framework has one."""
        gmm = p.grouped_matmul
        return gmm(p.activation(gmm(x, w1, sizes), Activation.SILU) * gmm(x, w3, sizes), w2, sizes)

    class SharedExpert(Module):
        def __init__(self, dim: int, hidden: int) -> None:
            super().__init__()
            # in parameter order: w1, w2, w3 (bias-free); the names of the dense MLP, so TP_PLAN's
            # colwise/rowwise split applies to them alike
            self.w1 = Linear(dim, hidden, bias=False)
            self.w2 = Linear(hidden, dim, bias=False)
            self.w3 = Linear(dim, hidden, bias=False)

        def forward(self, x: Any) -> Any:
            return self.w2(p.activation(self.w1(x), Activation.SILU) * self.w3(x))

    class Experts(Module):
        """The routed experts' weights stacked along dim 0 (expert-major: a fully_shard or
        expert-parallel shard of dim 0 holds whole experts)."""

        def __init__(self, cfg: ModelConfig) -> None:
            super().__init__()
            e, h, d = cfg.moe_experts, cfg.expert_hidden_dim, cfg.dim
            self.w1 = p.make_parameter(p.zeros((e, h, d), float32))
            self.w2 = p.make_parameter(p.zeros((e, d, h), float32))
            self.w3 = p.make_parameter(p.zeros((e, h, d), float32))

        def forward(self, rows: Any, plan: RoutingPlan, ep: ExpertParallelMoE | None, grad_scale: float) -> Any:
            """The experts' SwiGLU outputs ``[n, dim]`` of ``rows`` ``[n, dim]``: with every
            expert here (``ep`` ``None``), ``plan.permute``'s rows in expert order; under
            ``--ep``, the rows ``ep.dispatch`` received, run by ``ep.run_grouped`` on this
            rank's experts, whose gradients are multiplied by ``grad_scale`` ([Note:
            expert-parallel gradients]). A module call, so that fully_shard (``--ep`` below
            ``--dp-shard``) gathers this rank's experts around it."""
            if ep is None:
                return grouped_swiglu(rows, [int(n) for n in plan.send_counts], self.w1, self.w2, self.w3)
            # experts left out of fully_shard (ep == dp_shard) keep float32 under --dtype bf16/fp16: cast
            # to the rows' dtype as the policy would (a no-op in float32)
            w1, w2, w3 = (p.to_dtype(p.apply_function(ScaleGradient, w.to_local() if isinstance(w, DTensor) else w,
                                                      grad_scale), rows.dtype)
                          for w in (self.w1, self.w2, self.w3))
            return ep.run_grouped(rows, plan, lambda grouped, sizes: grouped_swiglu(grouped, sizes, w1, w2, w3))

    class MoE(Module):
        """``[batch, seq, dim]`` -> ``[batch, seq, dim]``: [Note: the job's MoE routing].
        After a forward, ``aux_loss`` holds its auxiliary loss (``aux-loss``: the float32
        scalar times ``moe_aux_loss_coef``, which ``Decoder.forward`` adds to the loss; else
        ``None``); training forwards (gradients enabled) add their decisions to ``counts``.
        Collectives: none with every expert on the rank; under ``--ep`` (``expert_parallel``
        set) core's dispatch (an all-gather of the counts, an uneven all-to-all) and combine
        (the reverse all-to-all) over the expert-parallel group, forward and backward."""

        def __init__(self, cfg: ModelConfig) -> None:
            super().__init__()
            self.num_experts, self.top_k, self.balance = cfg.moe_experts, cfg.moe_top_k, cfg.moe_balance
            self.aux_coef, self.renormalize = cfg.moe_aux_loss_coef, cfg.moe_norm_topk
            # in parameter order: router, experts, shared expert
            self.router = Linear(cfg.dim, cfg.moe_experts, bias=False)
            self.experts = Experts(cfg)
            if cfg.moe_shared_experts:
                self.shared_expert = SharedExpert(cfg.dim, cfg.moe_shared_experts * cfg.expert_hidden_dim)
            self.has_shared = bool(cfg.moe_shared_experts)
            # host state, not parameters: the aux-free bias (checkpointed by the loop) and the counts
            self.expert_bias = np.zeros(cfg.moe_experts, np.float32)
            self.counts = RoutingCounts(np.zeros(cfg.moe_experts, np.int64))
            self.aux_loss: Any = None
            # set by parallelize.apply_expert_parallel: core's dispatch/combine over the ep group
            self.expert_parallel: ExpertParallelMoE | None = None
            self.ep_grad_scale = 1.0
            # set by the pipeline with --ep-overlap: expert_parallel's dispatch and combine wrapped
            # by CommComputeOverlap ([Note: the overlap in the job] in train/pipeline.py)
            self.dispatch: Callable[[Any, RoutingPlan], Any] | None = None
            self.combine: Callable[[Any, RoutingPlan], Any] | None = None

        def forward(self, x: Any) -> Any:
            b, s, d = x.shape[0], x.shape[1], x.shape[2]
            flat = x.reshape(-1, d)
            probs, chosen, gates = route(p, self.router(flat), self.top_k, self.expert_bias, self.renormalize)
            plan = routing_plan(p, chosen, p.to_dtype(gates, x.dtype), self.num_experts)
            self.aux_loss = None
            if self.balance == "aux-loss":
                self.aux_loss = sequence_aux_loss(p, probs, chosen, b) * self.aux_coef
            # training forwards only (validation leaves the step's counts alone), and not a
            # rerun of one (the same decisions a second time): the recomputation of
            # --activation-checkpointing, or a pipeline stage's forward run again inside its
            # backward (MindSpore's out-of-order backwards: [Note: forwards inside a stage's
            # backward] in core/pipeline_parallel/runtime.py); counted here, before the
            # experts: a recomputation runs at least this far
            if (p.grad_enabled() and checkpoint_phase() is not CheckpointPhase.RECOMPUTE
                    and not in_stage_backward()):
                self.counts.tokens += plan.send_counts
                self.counts.rows += chosen.size
                self.counts.forwards += 1
                if self.aux_loss is not None:
                    self.counts.aux_loss += float(p.to_numpy(p.detach(self.aux_loss)))
            ep, rows = self.expert_parallel, plan.permute(flat)
            if ep is not None:  # all-to-all to the experts' ranks (core's MoE) and back below
                rows = (self.dispatch or ep.dispatch)(rows, plan)
            done = self.experts(rows, plan, ep, self.ep_grad_scale)
            out = plan.unpermute(done if ep is None else (self.combine or ep.combine)(done, plan))
            if self.has_shared:
                out = out + self.shared_expert(flat)
            return out.reshape(b, s, d)

    return MoE


def moe_layers(p: Platform, model: Any) -> list[tuple[str, Any]]:
    """``[(name, module)]`` of ``model``'s MoE sublayers (``layers.{i}.moe``), in order."""
    moe = define_moe(p)
    return [(name, module) for name, module in p.named_modules(model) if isinstance(module, moe)]


@dataclass
class BalanceStats:
    """One step's routing over every data-parallel rank (``balance_step``), the metrics row's
    ``moe_*`` fields."""

    tokens_per_expert_max: int
    tokens_per_expert_mean: float
    dropped_tokens: int
    bias_norm: float | None = None
    aux_loss: float | None = None
    per_layer_max: list[int] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"moe_tokens_per_expert_max": self.tokens_per_expert_max,
                               "moe_tokens_per_expert_mean": self.tokens_per_expert_mean,
                               "moe_dropped_tokens": self.dropped_tokens,
                               "moe_tokens_per_expert_max_by_layer": self.per_layer_max}
        if self.bias_norm is not None:
            out["moe_bias_norm"] = self.bias_norm
        if self.aux_loss is not None:
            out["moe_aux_loss"] = self.aux_loss
        return out


def moe_layer_names(cfg: ModelConfig) -> list[str]:
    """The names of every MoE sublayer of ``cfg``'s decoder (``layers.{i}.moe``), in order:
    a pipeline stage holds some of them, under the same names."""
    return [f"layers.{i}.moe" for i in range(cfg.n_layers) if cfg.is_moe_block(i)]


def balance_step(p: Platform, layers: list[tuple[str, Any]], group: Any, cfg: ModelConfig) -> BalanceStats:
    """After a step's backward: sum every MoE layer's counts over ``group`` with one
    all-reduce (float64, exact for counts below 2^53), move each ``aux-free`` bias by
    ``moe_bias_rate * sign(mean load - load)`` ([Note: balance across layouts]), reset the
    counts and return the step's stats over all the model's MoE layers (``moe_layer_names``).

    ``layers``: this rank's MoE sublayers (all of them, or a pipeline rank's stages').
    ``group``: the data- and context-parallel ranks (``None``: this rank alone); with
    pipeline parallelism those of every pipeline coordinate together (no tensor-parallel
    axis, whose ranks route the same tokens), so that each layer's slots hold the sum
    over the ranks of its stage and zeros from the others. Each layer's current bias rides
    along, with the count of ranks holding it (the same bias on each: their sum divided by
    that count is exact), so every rank computes every layer's new bias and the stats of
    all layers, the layers of other stages included. Every rank of ``group`` must call it.

    Raises:
        RuntimeError: a layer of ``layers`` routed no training forward since the last call.
    """
    experts = cfg.moe_experts
    names = moe_layer_names(cfg)
    # per layer: tokens [experts], rows, aux-loss sum, forwards, holders, bias [experts]
    width = 2 * experts + 4
    local = np.zeros(len(names) * width, np.float64)
    for name, layer in layers:
        c = layer.counts
        if not c.forwards:
            raise RuntimeError(f"{name}: balance_step without a training forward since the last one; call it once "
                               "per optimizer step, after the backward")
        i = names.index(name)
        local[i * width:(i + 1) * width] = [*c.tokens, c.rows, c.aux_loss, c.forwards, 1.0, *layer.expert_bias]
        c.reset()
    total = local if group is None else p.to_numpy(p.all_reduce(p.from_numpy(local), "sum", group=group).wait())
    mine = dict(layers)
    per_layer_max, dropped, aux, biases = [], 0, 0.0, []
    for i, name in enumerate(names):
        block = total[i * width:(i + 1) * width]
        tokens, (rows, aux_sum, forwards, holders) = block[:experts], block[experts:experts + 4]
        bias = (block[experts + 4:] / holders).astype(np.float32)  # h equal float32 values: exact
        per_layer_max.append(int(tokens.max()))
        dropped += int(round(rows - tokens.sum()))
        aux += aux_sum / forwards
        if cfg.moe_balance == "aux-free":
            # float32 arithmetic on identical integers: every layout's bias is the single process's, bit for bit
            bias += np.float32(cfg.moe_bias_rate) * np.sign(tokens.mean() - tokens).astype(np.float32)
        if name in mine:
            mine[name].expert_bias[:] = bias
        biases.append(bias)
    # every layer routes the same rows: the mean is one layer's rows over the experts
    mean = float(total[:experts].sum() / experts)
    bias_norm = float(np.linalg.norm(np.concatenate(biases))) if cfg.moe_balance == "aux-free" else None
    return BalanceStats(max(per_layer_max), mean, dropped, bias_norm,
                        aux if cfg.moe_balance == "aux-loss" else None, per_layer_max)
