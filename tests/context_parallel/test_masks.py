"""Property tests of ``masks.plan_block``: the calls planned for a block of queries against a
block of keys, read back through the contract's mask semantics, cover exactly the allowed
(query, key) pairs of the global positions, and no pair twice (the calls of a run are
merged by log-sum-exp, so a pair counted twice would be weighted twice). Swept over the
layouts every mode produces: sequence length, cp, load balance, packed documents, the
block a ring step holds, all-gathered keys (Ulysses groups included). numpy only."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.context_parallel.load_balance import shard_positions
from hyper_parallel.core.context_parallel.masks import plan_block
from hyper_parallel.platform import AttentionMask
from tests.platform_contract._attention_reference import allowed_pairs


def _covered(q_len: int, k_len: int, q_pos: np.ndarray, k_pos: np.ndarray, causal: bool,
             docs: np.ndarray | None) -> np.ndarray:
    """How many calls cover each (query row, key index) pair."""
    count = np.zeros((q_len, k_len), np.int64)
    plans = plan_block(q_pos, k_pos, causal, docs)
    for run in plans:
        for call in run.calls:
            # A call starts in its run and may span the following runs ([Note: coalesced calls]).
            assert run.start <= call.q_start < run.start + run.length and call.q_start + call.q_len <= q_len
            keys = np.concatenate([np.arange(s, s + n) for s, n in call.k_runs])
            allowed = allowed_pairs(call.q_len, len(keys), call.mask)
            rows = np.arange(call.q_start, call.q_start + call.q_len)
            count[np.ix_(rows, keys)] += allowed
    return count


@settings(max_examples=200, deadline=None)
@given(cp=st.sampled_from([1, 2, 3, 4]), chunk=st.integers(1, 5), load_balance=st.booleans(),
       causal=st.booleans(), n_docs=st.integers(0, 4), seed=st.integers(0, 10_000), ulysses=st.sampled_from([1, 2]),
       gathered=st.booleans())
def test_calls_cover_the_allowed_pairs_once(cp: int, chunk: int, load_balance: bool, causal: bool, n_docs: int,
                                            seed: int, ulysses: int, gathered: bool) -> None:
    rng = np.random.default_rng(seed)
    total = cp * ulysses
    seq = 2 * total * chunk
    docs = None
    if n_docs:
        cuts = np.sort(rng.choice(np.arange(1, seq), size=min(n_docs, seq - 1), replace=False))
        docs = np.searchsorted(cuts, np.arange(seq), side="right").astype(np.int64)

    def block(kv_index: int) -> np.ndarray:  # what ``Plan.block_positions`` holds
        return np.concatenate([shard_positions(seq, total, kv_index * ulysses + u, load_balance)
                               for u in range(ulysses)])

    g = int(rng.integers(cp))
    q_pos = block(g)
    k_pos = np.concatenate([block(j) for j in range(cp)]) if gathered else block(int(rng.integers(cp)))
    want = np.ones((len(q_pos), len(k_pos)), bool)
    if causal:
        want &= k_pos[None, :] <= q_pos[:, None]
    if docs is not None:
        want &= docs[q_pos][:, None] == docs[k_pos][None, :]
    got = _covered(len(q_pos), len(k_pos), q_pos, k_pos, causal, docs)
    assert got.max(initial=0) <= 1, "a pair is covered by two calls"
    np.testing.assert_array_equal(got.astype(bool), want)


@pytest.mark.parametrize("cp", [2, 4])
def test_load_balanced_ring_makes_one_call_per_step(cp: int) -> None:
    """[Note: coalesced calls]: with load balancing, each step of the ring is one kernel call
    per rank (the head and tail chunks joined), as torch's ring attention makes: the own
    block one top-left causal call, an earlier rank's block one unmasked call over both
    chunks (or over the tail alone where the head sees nothing of it)."""
    seq = 2 * cp * 8
    for g in range(cp):
        q_pos = shard_positions(seq, cp, g, True)
        for step in range(cp):
            k_pos = shard_positions(seq, cp, (g - step) % cp, True)
            calls = [call for run in plan_block(q_pos, k_pos, True, None) for call in run.calls]
            assert len(calls) == 1, (g, step, calls)
            if step == 0:
                # square: top-left and bottom-right agree (a rank whose chunks are adjacent has one run)
                assert calls[0].mask.causal in ("top_left", "bottom_right") and calls[0].q_len == len(q_pos)
            else:
                assert calls[0].mask == AttentionMask()
            # A block's runs that follow each other in the key tensor are read as one slice:
            # the whole block (tail queries against both chunks) or its head chunk, never a
            # concatenation of the two (a copy of the block per step).
            assert len(calls[0].k_runs) == 1, (g, step, calls[0].k_runs)
            assert calls[0].k_runs[0] in ((0, len(k_pos)), (0, len(k_pos) // 2)), (g, step, calls[0].k_runs)
