"""The layout of packed documents in one variable-length call (``platform.packed_documents``):
document offsets over batch rows, when one call takes a mask, and the TND statistics
permutation, checked against the layout written out per sequence as the Ascend kernel
and MindSpeed's ``flatten_softmax`` define it ([Note: TND softmax statistics]). Pure
numpy: the same on every backend; the kernels themselves run in the conformance tests on
the devices that have them."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.platform.contract.attention import AttentionMask
from hyper_parallel.platform.packed_documents import (TND_MAX_SEQUENCES, one_call_takes, row_offsets, tnd_call,
                                                      tnd_statistics_order)


def kernel_layout(token_major: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``[T, heads]`` statistics as the kernel stores them: sequence by sequence, each one
    ``[heads, s_i]`` (the transpose of its token rows), flattened."""
    return np.concatenate([token_major[a:b].T.reshape(-1) for a, b in zip(offsets, offsets[1:])])


@pytest.mark.parametrize("lengths,heads", [([5], 3), ([2, 4, 1], 2), ([3, 3, 3, 3], 1), ([1, 7, 2, 5, 1], 4)])
def test_statistics_order_matches_the_kernel_layout(lengths: list[int], heads: int) -> None:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    token_major = np.random.default_rng(len(lengths)).standard_normal((int(offsets[-1]), heads))
    stored = kernel_layout(token_major, offsets)
    to_tokens = tnd_statistics_order(offsets, heads)
    np.testing.assert_array_equal(stored[to_tokens], token_major.reshape(-1))
    assert sorted(to_tokens.tolist()) == list(range(len(stored)))  # a permutation


def test_tnd_call_packs_batch_rows() -> None:
    mask = AttentionMask("bottom_right", (0, 2, 5), (0, 3, 7))
    call = tnd_call(mask, batch=2, q_seq=5, kv_seq=7, heads=3)
    assert call is not None
    assert call.actual_seq_qlen == (2, 5, 7, 10)  # cumulative ends, no leading 0
    assert call.actual_seq_kvlen == (3, 7, 10, 14)
    offsets = np.array([0, 2, 5, 7, 10])
    token_major = np.arange(10 * 3, dtype=np.float64).reshape(10, 3)
    stored = kernel_layout(token_major, offsets)
    np.testing.assert_array_equal(stored[call.to_tokens], token_major.reshape(-1))
    np.testing.assert_array_equal(token_major.reshape(-1)[call.to_kernel], stored)


def test_row_offsets() -> None:
    np.testing.assert_array_equal(row_offsets((0, 1, 4), batch=3, seq=4), [0, 1, 4, 5, 8, 9, 12])


@pytest.mark.parametrize("mask,taken", [
    (AttentionMask("none", (0, 3, 5), (0, 1, 9)), True),
    (AttentionMask("bottom_right", (0, 3, 5), (0, 4, 6)), True),
    (AttentionMask("bottom_right", (0, 3, 5), (0, 2, 6)), False),  # a document with more queries than keys
    (AttentionMask("top_left", (0, 3, 5), (0, 3, 5)), True),
    (AttentionMask("top_left", (0, 3, 5), (0, 4, 6)), False),  # top-left is not bottom-right when unequal
    (AttentionMask("none", (0, 0, 5), (0, 2, 5)), False),  # a document without queries
    (AttentionMask("none", (0, 3, 5), (0, 5, 5)), False),  # a document without keys
    (AttentionMask("top_left"), False),  # no documents
])
def test_one_call_takes(mask: AttentionMask, taken: bool) -> None:
    assert one_call_takes(mask) is taken
    assert (tnd_call(mask, 1, mask.cu_seqlens_q[-1] if mask.documents else 4,
                     mask.cu_seqlens_kv[-1] if mask.documents else 4, 2) is not None) is taken


def test_too_many_sequences_run_as_pieces() -> None:
    cu = tuple(range(0, 2 * (TND_MAX_SEQUENCES // 2 + 1) + 1, 2))
    mask = AttentionMask("none", cu, cu)
    assert tnd_call(mask, batch=1, q_seq=cu[-1], kv_seq=cu[-1], heads=1) is not None
    assert tnd_call(mask, batch=2, q_seq=cu[-1], kv_seq=cu[-1], heads=1) is None
