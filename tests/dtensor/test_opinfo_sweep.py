"""torch's operator database on this package's DTensor (see ``_opinfo_sweep.py``): every
float32 op of ``op_db``, its first sample, forward and gradients, each tensor input
Replicate, Shard(0), Shard(-1) and mixed on a 1-D mesh of 2 ranks, and one of
(Shard(0), Shard(-1)), (Shard(-1), Shard(0)), (Shard(0), Shard(0)) per op (in turn) on a
2x2 mesh. On MindSpore the same samples go through the ``mindspore.mint`` function of
the same name. No case may be silently wrong; an exception must name the op, except in
the ops listed in ``KNOWN_ERRORS`` (each with its reason), which must still raise.

One pooled job per mesh runs every case (a few thousand on torch) and returns the
verdicts; the counts are printed (``-s``) and recorded in docs/dtensor.md beside torch's
own DTensor on the same cases (``benchmarks/dtensor_opinfo.py``).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("expecttest", reason="torch's op_db imports expecttest (the test extra)")
pytest.importorskip("torch", reason="the samples come from torch's op_db")

from tests.dtensor._opinfo_sweep import Verdict, merge, portable_cases, summarize, sweep_mindspore, sweep_torch  # noqa: E402

ON_MINDSPORE = os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore")

#: ops whose cases may raise an error that does not name them, and why; each must still
#: raise in some case (an entry that stops raising is reported, so the list only shrinks)
KNOWN_ERRORS = {
    "torch": {
        # a C++ composite reads its index tensor's values directly (no aten op to intercept)
        "tensor_split": "the C++ op reads the indices tensor's data, which a DTensor wrapper has none of",
    },
    "mindspore": {},
}


def _check(verdicts: list[Verdict], known: dict[str, str], what: str) -> None:
    counts = summarize(verdicts)
    print(f"\n{what}: {len({v.op for v in verdicts})} ops, {len(verdicts)} cases: {counts}")
    wrong = [v for v in verdicts if v.verdict == "wrong"]
    unnamed = [v for v in verdicts if v.verdict == "error" and v.op not in known]
    report = "\n".join(f"  {v.verdict} {v.op} [{v.mode}]: {v.detail}" for v in wrong + unnamed)
    assert not wrong and not unnamed, f"{what}: {len(wrong)} silently wrong cases, {len(unnamed)} errors that " \
                                      f"do not name their op:\n{report}"
    assert counts["ok"] > len(verdicts) // 2, f"{what}: only {counts['ok']} of {len(verdicts)} cases ok"


@pytest.mark.skipif(ON_MINDSPORE, reason="torch's DTensor ops (MindSpore: test_opinfo_sweep_mindspore)")
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["mesh2", "mesh2x2"])
def test_opinfo_sweep_torch(run_on_ranks, mesh_shape: tuple[int, ...]) -> None:
    world = 2 if len(mesh_shape) == 1 else 4
    verdicts = merge(run_on_ranks(sweep_torch, "ours", mesh_shape, None, 1, len(mesh_shape) > 1,
                                  world_size=world, timeout_s=900))
    _check(verdicts, KNOWN_ERRORS["torch"], f"op_db on mesh {mesh_shape}")
    if len(mesh_shape) == 1:
        stale = sorted(set(KNOWN_ERRORS["torch"]) - {v.op for v in verdicts if v.verdict == "error"})
        assert not stale, f"KNOWN_ERRORS lists ops that no longer raise an unnamed error: {stale}"


def _mint_names() -> list[str]:
    """The op_db names with a ``mindspore.mint`` function of that name."""
    from tests.dtensor._opinfo_sweep import float32_ops, mint_function

    return sorted({op.name for op in float32_ops() if mint_function(op.name) is not None})


@pytest.mark.skipif(not ON_MINDSPORE, reason="mindspore.mint ops (torch: test_opinfo_sweep_torch)")
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["mesh2", "mesh2x2"])
def test_opinfo_sweep_mindspore(run_on_ranks, mesh_shape: tuple[int, ...]) -> None:
    world = 2 if len(mesh_shape) == 1 else 4
    cases = portable_cases(_mint_names())
    # MindSpore's PyNative ops and emulated CPU collectives cost ~10x torch's per case:
    # one mode per op (in turn) on both meshes, so each op runs sharded once per mesh
    verdicts = merge(run_on_ranks(sweep_mindspore, mesh_shape, cases, True, world_size=world, timeout_s=900))
    _check(verdicts, KNOWN_ERRORS["mindspore"], f"op_db through mindspore.mint on mesh {mesh_shape}")
