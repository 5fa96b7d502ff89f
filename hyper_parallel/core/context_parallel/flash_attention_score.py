"""MindSpore's ``FlashAttentionScore`` primitive called on DTensors, planned here in core
(the MindSpore backend's DTensor class hands the call over through ``core/op_entry``;
nothing here imports MindSpore): the sequence-sharded
q/k/v of a ``ContextParallel`` module (core's ``attention_on_dtensors``), or q/k/v sharded
by batch and heads only (``attention_on_local_shards``).

MindFormers' ``FlashAttention`` cell (its default core attention) calls the primitive
directly; under context parallelism in the exchange modes its q/k/v are the DTensors
the hooks hand in ([Note: q/k/v as DTensors] in ``core/context_parallel/sharded_qkv``),
so the call reaches the DTensor class's ``__fallback__`` with the primitive's flat
arguments (MindSpore 2.10's pyboost order, ``_ARGUMENTS``). The module's algorithm then
computes it (all-gather or ring K/V, each block one call of the platform's fused kernel:
``FlashAttentionScore`` itself on Ascend) and the primitive's gradient is that of the
algorithm. The primitive's semantics kept are the ones the exchange can express exactly;
the rest is refused by name rather than approximated. Under tensor parallelism (heads
sharded, MindFormers' ``PrepareModuleInput``) each rank computes its own heads with the
same kernels and no communication, where the generic sharding rules would all-gather
q/k/v and compute every head on every rank.

Outputs: ``(softmax_max, softmax_sum, softmax_out, attention_out)`` with the first three
``None``: the kernels return the log-sum-exp of each row, not its maximum, and
``softmax_max`` is read as the row maximum (MindFormers' ``track_max_attention_logit``),
which a log-sum-exp would overstate by up to ``log(seq)``; a module under context
parallelism that sets ``track_max_attention_logit`` is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.context_parallel.context import current_frame
from hyper_parallel.core.context_parallel.fused_attention import (ATTENTION_RULE, attention_on_dtensors,
                                                                  attention_on_local_shards,
                                                                  independent_shards_problem,
                                                                  routes_to_context_parallel)

#: the primitive's arguments in the order its ``__fallback__`` receives them
_ARGUMENTS = ("query", "key", "value", "real_shift", "drop_mask", "padding_mask", "attn_mask", "prefix",
              "actual_seq_qlen", "actual_seq_kvlen", "head_num", "keep_prob", "scale_value", "pre_tokens",
              "next_tokens", "inner_precise", "input_layout", "sparse_mode")
#: ``input_layout`` as the primitive passes it on (an enum value)
_LAYOUTS = {0: "BSH", 1: "BNSD", 2: "SBH", 3: "BSND", 4: "TND"}
_OP = "FlashAttentionScore under ContextParallel"


def _ends(value: Any) -> list[int]:
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    if hasattr(value, "reshape"):
        value = value.reshape(-1).tolist()
    return [int(v) for v in value]


def _arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(_ARGUMENTS, args))
    bound.update(kwargs)
    return bound


def _mask(a: dict[str, Any]) -> tuple[bool, str | None]:
    """The mask as a causal flag, or what the kernels' structural masks cannot express."""
    extra = [n for n in ("real_shift", "drop_mask", "padding_mask", "prefix") if a.get(n) is not None]
    if extra:
        return False, (f"{', '.join(extra)} given; the attention here takes causal or no masks and packed documents "
                       "only. Leave them None")
    if float(a.get("keep_prob", 1.0)) != 1.0:
        return False, f"keep_prob={a['keep_prob']} (attention dropout): set the attention dropout to 0"
    sparse = int(a.get("sparse_mode", 0))
    if sparse == 0:
        if a.get("attn_mask") is not None:
            return False, ("sparse_mode=0 with an explicit attn_mask (a dense [seq, seq] mask); use the compressed "
                           "causal mask, sparse_mode=2 or 3 (MindFormers: use_attn_mask_compression=True or "
                           "use_eod_attn_mask_compression=True)")
        return False, None  # no mask: pre_tokens / next_tokens are ignored in this mode
    if sparse in (2, 3):
        # left-up and right-down causal coincide for self-attention (equal q/k lengths, and
        # equal per-document lengths under TND, checked below); attn_mask is the compressed
        # 2048 x 2048 mask, which only selects the mode
        return True, None
    return False, f"sparse_mode={sparse}; supported: 0 (no mask), 2 and 3 (causal)"


def _documents(a: dict[str, Any], layout: str, op: str) -> list[int] | None:
    """``cu_seqlens`` of the packed documents (``TND``), or ``None``.

    Raises:
        ValueError: the primitive's own rules: ``actual_seq_qlen`` / ``actual_seq_kvlen``
            with ``TND`` only, and required there.
        NotImplementedError: unequal query and key/value documents.
    """
    q_ends, kv_ends = a.get("actual_seq_qlen"), a.get("actual_seq_kvlen")
    if layout != "TND":
        if q_ends is not None or kv_ends is not None:
            raise ValueError(f"{op}: actual_seq_qlen / actual_seq_kvlen given with input_layout {layout!r}; "
                             "FlashAttentionScore takes them with 'TND' only (packed documents: use the TND layout)")
        return None
    if q_ends is None or kv_ends is None:
        raise ValueError(f"{op}: input_layout 'TND' needs actual_seq_qlen and actual_seq_kvlen (cumulative document "
                         "ends), as FlashAttentionScore does")
    q_ends, kv_ends = _ends(q_ends), _ends(kv_ends)
    if q_ends != kv_ends:
        raise NotImplementedError(f"{op}: actual_seq_qlen {q_ends} != actual_seq_kvlen {kv_ends}; only "
                                  "self-attention documents (equal lengths) are taken")
    return [0, *q_ends]


def _refuse_row_maximum(op: str) -> None:
    """Raise if the module under context parallelism reads ``softmax_max`` (MindFormers'
    ``FlashAttention`` with ``track_max_attention_logit``, for QK-clip), which is ``None``
    here (see the module docstring): a clear error instead of its ``amax`` failing on
    ``None``.

    Raises:
        NotImplementedError: naming the setting and the fixes.
    """
    frame = current_frame()
    if frame is not None and getattr(frame.module, "track_max_attention_logit", False):
        raise NotImplementedError(f"{op} in {frame.module_name}: track_max_attention_logit=True reads softmax_max, the "
                                  "row maximum of the attention logits, which this attention does not compute (its "
                                  "kernels keep each row's log-sum-exp); set track_max_attention_logit=False, or use "
                                  "pure Ulysses context parallelism (ulysses_degree == cp), where the primitive runs "
                                  "itself")


def flash_attention_score(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, tuple[Any, ...]] | None:
    """``(rule, result)``: the primitive's result on DTensors, computed by core, and the name
    of what planned it (``"context_parallel"``; ``ATTENTION_RULE`` for 4-D q/k/v sharded by
    batch and heads, the rule torch's SDPA takes; ``"FlashAttentionScore"`` for the 3-D
    layouts), or ``None`` for the caller's generic path (sharding rules, which replicate the
    inputs and run the primitive).

    Two cases are computed here:

    - q/k/v are the sequence-sharded DTensors of a running ``ContextParallel`` module: the
      module's algorithm (``attention_on_dtensors``). What it cannot express raises: the
      sequence is sharded, so no other path would be right.
    - q/k/v are sharded by batch and/or heads only (tensor parallelism): each rank attends on
      its pieces (``attention_on_local_shards``), no communication. What the structural
      masks cannot express (a dense mask, dropout, ALiBi, ...) takes the generic path, which
      runs the primitive itself (on Ascend).

    Raises:
        NotImplementedError: under context parallelism, a mask, dropout or bias the exchange
            does not express; unequal documents; a module that reads ``softmax_max``
            (``track_max_attention_logit``).
        ValueError: ``actual_seq_qlen`` / ``actual_seq_kvlen`` with a layout other than
            ``TND`` (the primitive's own rule), or missing under ``TND``; under context
            parallelism, q/k/v of another rank than the layout's (3-D ``BSH`` / ``SBH`` /
            ``TND``, 4-D ``BNSD`` / ``BSND``).
    """
    a = _arguments(args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    layout = a.get("input_layout", "BSH")
    layout = _LAYOUTS.get(layout, str(layout)) if isinstance(layout, int) else str(layout).upper()
    head_num = int(a.get("head_num", 1))
    context_parallel = routes_to_context_parallel((q, k, v))
    if not context_parallel and independent_shards_problem(q, k, v, layout, head_num) is not None:
        return None
    op = _OP if context_parallel else "FlashAttentionScore on DTensors"
    if context_parallel:
        _refuse_row_maximum(op)
        rank = 3 if layout in ("BSH", "SBH", "TND") else 4
        if any(t.ndim != rank for t in (q, k, v)):
            # the primitive's own rule (it refuses these on Ascend too)
            raise ValueError(f"{op}: input_layout={layout!r} takes {rank}-D query, key and value; got "
                             f"{[tuple(t.shape) for t in (q, k, v)]}")
    causal, problem = _mask(a)
    if problem is not None:
        if context_parallel:
            raise NotImplementedError(f"{op}: {problem}")
        return None
    cu_seqlens = _documents(a, layout, op)
    attend = attention_on_dtensors if context_parallel else attention_on_local_shards
    out = attend(q, k, v, layout=layout, head_num=head_num, is_causal=causal, scale=float(a.get("scale_value", 1.0)),
                 cu_seqlens=cu_seqlens, op=op)
    rule = "context_parallel" if context_parallel else ATTENTION_RULE if q.ndim == 4 else "FlashAttentionScore"
    return rule, (None, None, None, out)
