"""Contract section: fused local attention, forward and backward.

[Note: attention kernels]
``attention`` and ``attention_backward`` are *kernels*: the forward returns the output
and the log-sum-exp of the scores (the softmax statistics a FlashAttention backward
needs, and what context parallelism merges partial results by), the backward takes them
back and returns ``(dq, dk, dv)``. Neither is recorded by autograd; core differentiates
attention once, in a custom function whose backward calls ``attention_backward``
(``hyper_parallel.core.context_parallel.blocks``). The backward is always given the
*output and log-sum-exp over every key the queries see*, which may be more keys than
the call's ``k``/``v``: then ``P = exp(q k^T * scale - lse)`` is the global softmax
restricted to these keys and the returned ``dk``/``dv`` are these keys' share of the
gradient, ``dq`` this call's share (FlashAttention-2's backward; torch's
``_templated_ring_attention_backward`` and MindSpeed's ring rely on the same identity).

Masks are structural, never a dense ``[q_seq, kv_seq]`` tensor (``AttentionMask``): no
mask, causal aligned top-left or bottom-right, and packed documents given by cumulative
lengths. A backend whose kernel takes a form natively passes it on; otherwise it runs
the kernel on the pieces of ``hyper_parallel.platform.attention_pieces`` (full blocks
and top-left causal blocks), merging by log-sum-exp: never a score matrix.

Each backend's kernels (see ``docs/platform.md``):

- torch-cpu: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``;
- torch-cuda: the kernel torch's SDPA picks: ``aten._flash_attention_forward`` (float16 /
  bfloat16, packed documents as one varlen call), ``aten._scaled_dot_product_efficient_attention``
  or ``aten._scaled_dot_product_cudnn_attention``, with their backwards;
- torch-npu: ``torch_npu.npu_fusion_attention`` and ``npu_fusion_attention_grad`` (packed
  documents as one TND call, ``hyper_parallel.platform.packed_documents``);
- mindspore-ascend: the ``FlashAttentionScore`` primitive and its grad (causal packed
  documents as one TND call);
- mindspore-cpu: a tiled online-softmax forward and a recomputing backward (MindSpore
  2.10 registers no FlashAttentionScore on CPU), memory ``O(seq x tile)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The causal alignments ``AttentionMask.causal`` accepts. For ``q_seq`` queries and
#: ``kv_seq`` keys, query ``i`` may see key ``j`` when ``j <= i`` (``"top_left"``, torch's
#: ``is_causal``) or when ``j <= i + kv_seq - q_seq`` (``"bottom_right"``, FlashAttention's
#: ``causal``: the last query sees every key). The two agree when ``q_seq == kv_seq``.
CAUSAL_FORMS: tuple[str, ...] = ("none", "top_left", "bottom_right")


def _cumulative(name: str, value: Sequence[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        cu = tuple(int(x) for x in value)
    except (TypeError, ValueError):
        raise TypeError(f"AttentionMask.{name}={value!r} must be a sequence of ints (cumulative document "
                        "lengths)") from None
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"AttentionMask.{name}={list(cu)} must start at 0, never decrease and have at least two "
                         "entries ([0, l0, l0 + l1, ...]; a document may be empty on one side)")
    return cu


@dataclass(frozen=True)
class AttentionMask:
    """Which (query, key) pairs a local attention call may attend to.

    Attributes:
        causal: one of ``CAUSAL_FORMS``. With documents it applies within each document
            (query and key pieces of document ``d`` aligned as they would be alone).
        cu_seqlens_q: cumulative lengths of the packed documents along the queries,
            ``(0, l0, l0 + l1, ..., q_seq)``; ``None`` for one sequence.
        cu_seqlens_kv: the same along the keys, with as many entries: query document
            ``d`` sees only key document ``d``. Either side's piece of a document may be
            empty (its queries see no key: output 0, log-sum-exp ``-inf``).

    Raises:
        ValueError: an unknown ``causal``, one of ``cu_seqlens_q``/``cu_seqlens_kv``
            without the other, lists of different lengths, or a list that does not start
            at 0 or decreases.
        TypeError: a list entry that is not an int.
    """

    causal: str = "none"
    cu_seqlens_q: tuple[int, ...] | None = None
    cu_seqlens_kv: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.causal not in CAUSAL_FORMS:
            raise ValueError(f"AttentionMask.causal={self.causal!r} is not a causal form; use one of "
                             f"{', '.join(repr(c) for c in CAUSAL_FORMS)}")
        cu_q = _cumulative("cu_seqlens_q", self.cu_seqlens_q)
        cu_kv = _cumulative("cu_seqlens_kv", self.cu_seqlens_kv)
        if (cu_q is None) != (cu_kv is None):
            raise ValueError("AttentionMask: give both cu_seqlens_q and cu_seqlens_kv (packed documents) or neither")
        if cu_q is not None and cu_kv is not None and len(cu_q) != len(cu_kv):
            raise ValueError(f"AttentionMask: cu_seqlens_q has {len(cu_q) - 1} documents and cu_seqlens_kv "
                             f"{len(cu_kv) - 1}; query document d sees key document d, so give as many of each "
                             "(an empty document is a repeated entry)")
        object.__setattr__(self, "cu_seqlens_q", cu_q)
        object.__setattr__(self, "cu_seqlens_kv", cu_kv)

    @property
    def documents(self) -> bool:
        """True when the call holds packed documents."""
        return self.cu_seqlens_q is not None

    def check(self, q_seq: int, kv_seq: int) -> None:
        """Raise ValueError unless the document lists end at ``q_seq`` / ``kv_seq``."""
        if self.cu_seqlens_q is None or self.cu_seqlens_kv is None:
            return
        if self.cu_seqlens_q[-1] != q_seq or self.cu_seqlens_kv[-1] != kv_seq:
            raise ValueError(f"attention: cu_seqlens_q ends at {self.cu_seqlens_q[-1]} and cu_seqlens_kv at "
                             f"{self.cu_seqlens_kv[-1]}, but q has {q_seq} and k {kv_seq} positions; the lists are "
                             "cumulative lengths of this call's q and k")


#: No mask: every query sees every key.
FULL = AttentionMask()


class AttentionSection(ABC):
    """Fused local attention kernels; see [Note: attention kernels]."""

    @abstractmethod
    def attention(self, q: Any, k: Any, v: Any, *, scale: float | None = None,
                  mask: AttentionMask = FULL) -> tuple[Any, Any]:
        """Scaled-dot-product attention ``softmax(q k^T * scale + mask) v`` with its
        log-sum-exp, from the backend's fused kernel. Not recorded by autograd.

        Args:
            q: ``[batch, q_seq, heads, head_dim]`` (BSHD), float64, float32, bfloat16 or
                float16 (what the backend's kernel takes; see ``docs/platform.md``).
            k, v: ``[batch, kv_seq, kv_heads, head_dim]``, ``q``'s dtype; ``heads``
                divisible by ``kv_heads`` (grouped-query attention: query head ``h``
                uses key/value head ``h // (heads // kv_heads)``), without repeating
                ``k``/``v`` in memory where the kernel allows.
            scale: multiplies ``q k^T``; default ``head_dim ** -0.5``.
            mask: see ``AttentionMask``.

        Returns:
            ``(out, lse)``: ``out`` ``[batch, q_seq, heads, head_dim]`` in ``q``'s dtype;
            ``lse`` ``[batch, heads, q_seq]`` in ``max(float32, q.dtype)`` (float64 for
            float64 inputs, whose math is float64 end to end), the natural log of the sum
            of ``exp(scores)`` over the keys a query sees; a query that sees no key has
            ``out`` 0 and ``lse`` ``-inf``.

        Raises:
            ValueError: shapes that are not BSHD or do not fit, a dtype, head_dim or mask
                the backend's kernel does not take (naming the backend, the kernel and
                what it supports), or document lists that do not end at the lengths.
        """

    @abstractmethod
    def attention_backward(self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *,
                           scale: float | None = None, mask: AttentionMask = FULL) -> tuple[Any, Any, Any]:
        """The gradients of ``attention`` from its output gradient, by the backend's fused
        backward kernel (recomputing the probabilities from ``lse``; no saved scores).
        Not recorded by autograd.

        Args:
            dout: ``[batch, q_seq, heads, head_dim]``, the gradient of ``out``.
            q, k, v, scale, mask: as given to ``attention``.
            out: ``[batch, q_seq, heads, head_dim]``, the attention output of these
                queries over *every* key they see (``attention``'s, or the merge of
                several calls': see [Note: attention kernels]).
            lse: ``[batch, heads, q_seq]``, the log-sum-exp over the same keys as
                ``out``; ``-inf`` (or any value at or below ``-1e30``) for a query that
                sees no key, whose gradients are then 0.

        Returns:
            ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v`` (``dk``/``dv``
            summed over the query heads sharing a key/value head).

        Raises:
            ValueError: as ``attention``, and ``dout``/``out``/``lse`` shapes that do not
                fit ``q``.
        """
