"""The files of a ``hyper-parallel train`` checkpoint in one process (no ranks): the
safetensors shards and ``model.safetensors.index.json`` ([Note: the checkpoint index] in
``train/checkpoint_format.py``), and the reading contract other tools build on
(``latest_manifest``, ``read_pieces``: ``hyper-parallel export``) for both formats.

Two ranks are played in turn by this process: the save's steps 2-4 coordinate through the
folder, and step 1's collective is replaced by a no-op (``begin_save``'s ``agree``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from hyper_parallel.core.fully_shard import Box
from hyper_parallel.train import checkpoint
from hyper_parallel.train.checkpoint_format import INDEX
from tests.train import _legacy_checkpoint

SHAPE = (6, 4)
WEIGHT = np.arange(24, dtype=np.float32).reshape(SHAPE)
NORM = np.linspace(0.5, 1.0, 4, dtype=np.float32)
META = {"layout": {"degrees": {"dp_shard": 2}}, "model": {"dim": 4}, "data": {"seed": 0}, "optimizer_step": 7}


def _rank_pieces(rank: int) -> dict[str, checkpoint.Piece]:
    """Rank ``rank`` of dp-shard 2: rows ``3 r .. 3 r + 3`` of the weight; the norm whole (a replica)."""
    rows = slice(3 * rank, 3 * rank + 3)
    return {"param/w.weight": checkpoint.Piece(Box(SHAPE, (3 * rank, 0), (3, 4)), WEIGHT[rows].copy()),
            "param/norm.weight": checkpoint.Piece(Box((4,), (0,), (4,)), NORM.copy())}


def _save_two_ranks(root: Path, step: int) -> Path:
    pending = [checkpoint.begin_save(None, root, step, _rank_pieces(r), META, 2, r, agree=lambda: None)
               for r in range(2)]
    # step 2: rank 1 needs rank 0's index file; without it, it gives up after its timeout (marking it failed)
    with pytest.raises(RuntimeError, match="ranks \\[0\\] did not write their index files within 0 s"):
        checkpoint.write_pending(pending[1], timeout_s=0.0)
    (pending[1].tmp / "rank_00001.failed").unlink()  # this test's own retry, after rank 0
    checkpoint.write_pending(pending[0])
    checkpoint.write_pending(pending[1])
    return checkpoint.commit(pending[0])


def test_index_and_shards(tmp_path: Path) -> None:
    path = _save_two_ranks(tmp_path, 7)
    assert sorted(p.name for p in path.iterdir()) == [INDEX, "rank_00000.safetensors", "rank_00001.safetensors"]
    index = json.loads((path / INDEX).read_text())
    assert index["metadata"] == {"format": 3, "step": 7, "world_size": 2, **META,
                                 "total_size": WEIGHT.nbytes + NORM.nbytes}
    assert index["weight_map"] == {"param/norm.weight": "rank_00000.safetensors",
                                   "param/w.weight": "rank_00000.safetensors"}
    assert index["tensors"]["param/w.weight"] == {"shape": [6, 4], "dtype": "float32"}
    assert index["pieces"]["param/w.weight"] == [
        {"file": "rank_00000.safetensors", "box": {"starts": [0, 0], "lengths": [3, 4]}},
        {"file": "rank_00001.safetensors", "box": {"starts": [3, 0], "lengths": [3, 4]}}]
    # the replicated norm is written once, by the lowest rank holding it
    assert index["pieces"]["param/norm.weight"] == [
        {"file": "rank_00000.safetensors", "box": {"starts": [0], "lengths": [4]}}]
    assert sorted(index["files"]) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    with safe_open(str(path / "rank_00001.safetensors"), framework="np") as f:
        assert sorted(f.keys()) == ["param/w.weight"] and f.metadata() == {"step": "7", "rank": "1"}
        np.testing.assert_array_equal(f.get_tensor("param/w.weight"), WEIGHT[3:])


@pytest.mark.parametrize("fmt", [2, 3])
def test_latest_manifest_and_read_pieces(tmp_path: Path, fmt: int) -> None:
    """The contract of ``hyper-parallel export``: ``latest_manifest(root)`` gives the
    newest complete checkpoint and its manifest (``model``, ``layout``, ``tensors``), and
    ``read_pieces`` with full boxes gives whole tensors, with partial boxes their parts."""
    if fmt == 3:
        _save_two_ranks(tmp_path, 7)
    else:  # format 2: one rank holding the whole tensors (the writer of before the safetensors format)
        pieces = {"param/w.weight": checkpoint.Piece(Box(SHAPE, (0, 0), SHAPE), WEIGHT),
                  "param/norm.weight": checkpoint.Piece(Box((4,), (0,), (4,)), NORM)}
        _legacy_checkpoint.save(None, tmp_path, 7, pieces, META, world=1, rank=0)
    found = checkpoint.latest_manifest(tmp_path)
    assert found is not None
    path, manifest = found
    assert path.name == "step_00000007" and manifest["format"] == fmt and manifest["step"] == 7
    assert manifest["model"] == META["model"] and manifest["layout"] == META["layout"]
    whole = {key: Box(tuple(entry["shape"]), (0,) * len(entry["shape"]), tuple(entry["shape"]))
             for key, entry in manifest["tensors"].items()}
    values = checkpoint.read_pieces(path, manifest, whole)
    np.testing.assert_array_equal(values["param/w.weight"], WEIGHT)
    np.testing.assert_array_equal(values["param/norm.weight"], NORM)
    middle = checkpoint.read_pieces(path, manifest, {"param/w.weight": Box(SHAPE, (2, 1), (2, 2))})
    np.testing.assert_array_equal(middle["param/w.weight"], WEIGHT[2:4, 1:3])


def test_corrupted_newest_falls_back(tmp_path: Path) -> None:
    """A shard whose bytes changed (same size) fails its digest: the previous checkpoint loads."""
    _save_two_ranks(tmp_path, 6)
    newest = _save_two_ranks(tmp_path, 7)
    shard = newest / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=r"step_00000007 is unusable: shard rank_00001.safetensors does not "
                                            r"match its SHA-256 digest \(corrupted\)"):
        found = checkpoint.latest_manifest(tmp_path)
    assert found is not None and found[1]["step"] == 6
