"""MindSpore's ``FlashAttentionScore`` primitive called on the sequence-sharded DTensors of a
``ContextParallel`` module: translated into core's ``attention_on_dtensors``.

MindFormers' ``FlashAttention`` cell (its default core attention) calls the primitive
directly; under context parallelism in the exchange modes its q/k/v are the DTensors
the hooks hand in ([Note: q/k/v as DTensors] in ``core/context_parallel/sharded_qkv``),
so the call reaches the DTensor class's ``__fallback__`` with the primitive's flat
arguments (MindSpore 2.10's pyboost order, ``_ARGUMENTS``). The module's algorithm then
computes it (all-gather or ring K/V, each block one call of the platform's fused kernel:
``FlashAttentionScore`` itself on Ascend) and the primitive's gradient is that of the
algorithm. The primitive's semantics kept are the ones the exchange can express exactly;
the rest is refused by name rather than approximated.

Outputs: ``(softmax_max, softmax_sum, softmax_out, attention_out)`` with the first three
``None``: the kernels return the log-sum-exp of each row, not its maximum, and
``softmax_max`` is read as the row maximum (MindFormers' ``track_max_attention_logit``),
which a log-sum-exp would overstate by up to ``log(seq)``; a consumer of them fails on
the ``None`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def _causal(a: dict[str, Any]) -> bool:
    """The mask as a causal flag; refuses what the exchange cannot express."""
    extra = [n for n in ("real_shift", "drop_mask", "padding_mask", "prefix") if a.get(n) is not None]
    if extra:
        raise NotImplementedError(f"{_OP}: {', '.join(extra)} given; the context-parallel attention takes causal or "
                                  "no masks and packed documents only. Leave them None")
    if float(a.get("keep_prob", 1.0)) != 1.0:
        raise NotImplementedError(f"{_OP}: keep_prob={a['keep_prob']} (attention dropout); the context-parallel "
                                  "attention has none: set the attention dropout to 0")
    sparse = int(a.get("sparse_mode", 0))
    if sparse == 0:
        if a.get("attn_mask") is not None:
            raise NotImplementedError(f"{_OP}: sparse_mode=0 with an explicit attn_mask (a dense [seq, seq] mask); "
                                      "use the compressed causal mask, sparse_mode=2 or 3 (MindFormers: "
                                      "use_attn_mask_compression=True or use_eod_attn_mask_compression=True)")
        return False  # no mask: pre_tokens / next_tokens are ignored in this mode
    if sparse in (2, 3):
        # left-up and right-down causal coincide for self-attention (equal q/k lengths, and
        # equal per-document lengths under TND, checked below); attn_mask is the compressed
        # 2048 x 2048 mask, which only selects the mode
        return True
    raise NotImplementedError(f"{_OP}: sparse_mode={sparse}; supported: 0 (no mask), 2 and 3 (causal)")


def flash_attention_score(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The primitive's result computed by the running ``ContextParallel`` module, or
    ``None`` when the call is not one (q/k/v not its DTensors: the caller takes its
    generic path).

    Raises:
        NotImplementedError: a mask, dropout or bias the exchange does not express.
        ValueError: ``actual_seq_qlen`` / ``actual_seq_kvlen`` with a layout other than
            ``TND`` (the primitive's own rule), missing under ``TND``, or unequal.
    """
    from hyper_parallel.core.context_parallel.sharded_qkv import attention_on_dtensors, routes_to_context_parallel

    a = _arguments(args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    if not routes_to_context_parallel((q, k, v)):
        return None
    layout = a.get("input_layout", "BSH")
    layout = _LAYOUTS.get(layout, str(layout)) if isinstance(layout, int) else str(layout).upper()
    causal = _causal(a)
    q_ends, kv_ends = a.get("actual_seq_qlen"), a.get("actual_seq_kvlen")
    cu_seqlens = None
    if layout == "TND":
        if q_ends is None or kv_ends is None:
            raise ValueError(f"{_OP}: input_layout 'TND' needs actual_seq_qlen and actual_seq_kvlen (cumulative "
                             "document ends), as FlashAttentionScore does")
        q_ends, kv_ends = _ends(q_ends), _ends(kv_ends)
        if q_ends != kv_ends:
            raise NotImplementedError(f"{_OP}: actual_seq_qlen {q_ends} != actual_seq_kvlen {kv_ends}; context "
                                      "parallelism shards self-attention")
        cu_seqlens = [0, *q_ends]
    elif q_ends is not None or kv_ends is not None:
        raise ValueError(f"{_OP}: actual_seq_qlen / actual_seq_kvlen given with input_layout {layout!r}; "
                         "FlashAttentionScore takes them with 'TND' only (packed documents: use the TND layout)")
    out = attention_on_dtensors(q, k, v, layout=layout, head_num=int(a.get("head_num", 1)), is_causal=causal,
                                scale=float(a.get("scale_value", 1.0)), cu_seqlens=cu_seqlens, op=_OP)
    return None, None, None, out
