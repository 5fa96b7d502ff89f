"""Rank functions of tests/train/test_checkpoint_reshard.py (importable by module path, as
the harness requires)."""

from __future__ import annotations

import shutil
import time
from unittest import mock
from pathlib import Path

import numpy as np

from hyper_parallel.core.fully_shard import Box
from hyper_parallel.platform import get_platform
from hyper_parallel.train import checkpoint
from hyper_parallel.train.checkpoint_format import digest
from hyper_parallel.train.config import PRESETS, Layout, ModelConfig
from hyper_parallel.train.loop import layout_record, load_checkpoint, restore, save_checkpoint, setup, train
from tests.train._ranks import PIPELINE_MODEL, losses, tiny_config
from hyper_parallel.core.process_groups import barrier

#: ``tiny`` with uneven shards: the SwiGLU input projections (66 rows) are 17, 17, 17, 15 rows
#: over dp-shard 4 and 17, 16 of each tensor-parallel half over dp-shard 2, so pieces of
#: different layouts overlap partially and fully_shard pads; 6 query and 2 key/value heads
#: divide over tp 2.
UNEVEN_MODEL = ModelConfig(dim=36, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=66, max_seq_len=256)

MODELS = {"tiny": PRESETS["tiny"], "tiny+uneven": UNEVEN_MODEL, "tiny-4-layers": PIPELINE_MODEL}

#: steps between checkpoints; hop ``i`` of a chain resumes at step ``EVERY * i``
EVERY = 1


def full_tensors(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The manifest of the checkpoint at ``path`` and every tensor it holds, whole (each
    assembled from its pieces by ``read_pieces`` with the global box)."""
    manifest = checkpoint.read_manifest(path)
    boxes = {key: Box(tuple(entry["shape"]), (0,) * len(entry["shape"]), tuple(entry["shape"]))
             for key, entry in manifest["tensors"].items()}
    return manifest, checkpoint.read_pieces(path, manifest, boxes)


def _copy_step(src: Path, dst: Path, step: int, timeout_s: float = 300.0) -> None:
    """Rank 0 copies checkpoint ``step`` from ``src`` to ``dst`` (a fresh folder) and marks
    it done; the other ranks wait for the mark on the filesystem, not in a collective:
    rank 0 arrives here after plotting the previous hop's curve alone, which on a loaded
    host outlasts MindSpore's CPU collective timeout in the harness pools (5 s)."""
    p = get_platform()
    done = dst / ".copied"
    if p.rank() == 0:
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        shutil.copytree(src / f"step_{step:08d}", dst / f"step_{step:08d}")
        done.touch()
        return
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {p.rank()}: rank 0 did not copy {src}/step_{step:08d} to {dst} in {timeout_s} s")
        time.sleep(0.05)


def _chain(out: str, model_name: str, chain: list[dict]) -> tuple[list[np.ndarray], list[tuple[Path, Path]], object]:
    """Run ``chain``: hop 0 trains steps 1..N in its layout with a checkpoint every
    ``EVERY`` steps; hop ``i`` resumes from hop ``i - 1``'s checkpoint of step
    ``EVERY * i`` in its own layout and trains to N. Before training, each resharded hop
    writes what it loaded back to disk (its round trip). Returns the curves, the (source,
    round trip) checkpoint folders and hop 0's config."""
    p = get_platform()
    n = p.world_size()
    steps = EVERY * len(chain)
    base = tiny_config(f"{out}/hop0", nproc=n, layout=Layout(**chain[0]), steps=steps, checkpoint_every=EVERY,
                       eval_every=steps, model=MODELS[model_name], model_name=model_name)
    curves, round_trips = [], []
    for i, degrees in enumerate(chain):
        cfg = base.replace(out=f"{out}/hop{i}", layout=Layout(**degrees), resume=i > 0)
        start = EVERY * i
        if i:
            _copy_step(Path(f"{out}/hop{i - 1}/checkpoints"), cfg.checkpoint_path, start)
        run = setup(cfg)
        if i:
            loaded = load_checkpoint(run, cfg.checkpoint_path)
            assert loaded is not None and loaded.step == start and loaded.resharded, loaded
            message = checkpoint.reshard_message(loaded.path, loaded.manifest, layout_record(cfg, cfg.layout), n)
            assert message is not None and "resharding it into layout" in message, message
            assert checkpoint.describe_layout(loaded.manifest["layout"], n) in message, message
            restore(run, loaded)
            round_trips.append((loaded.path, save_checkpoint(run, Path(f"{out}/hop{i}/round-trip"), start)))
        rows = train(cfg, run=run)
        curves.append(losses(rows))
        assert len(rows) == steps - start, rows
    return curves, round_trips, base


def check_reshard_chains(out: str, chains: list[tuple[str, list[dict]]]) -> list[list[float]]:
    """For each ``(model name, chain of layouts)``: every hop resumes the previous hop's
    checkpoint in another layout (``_chain``); checked on rank 0 after every collective:

    - resharding is exact: the round trip (the values a hop loaded, written back by its
      own layout) holds every parameter and AdamW moment bit-identical to the source
      checkpoint, whole tensor by whole tensor, and the same optimizer step;
    - each hop's losses after the resume match hop 0's uninterrupted curve, and hop 0's
      the single-process reference's; the reference resumed from the last hop's
      distributed checkpoint continues its own curve.

    Tolerance (losses): float32, 2e-5 relative, as the layouts' parity tests in
    tests/train/_ranks.py: the layouts compute the same sums in other orders (tensor-
    parallel partial sums, gradient reduce-scatters, ring attention's split softmax), a few
    ulps per step that AdamW's sign-like first steps amplify a little; a hop starts from
    the exact state of the previous layout at its step (the round trip), so it adds no
    error of its own. Measured on torch: at most 6.7e-8 over three steps (1.1e-7 over six)."""
    p = get_platform()
    results: list[list[float]] = []
    runs = []
    for index, (model_name, chain) in enumerate(chains):
        curves, round_trips, base = _chain(f"{out}/chain{index}", model_name, chain)
        runs.append((chain, curves, round_trips, base))
        results.extend(curve.tolist() for curve in curves)
    if p.rank() != 0:
        return results
    # the reference uses no collectives: rank 0 runs it after every chain's collectives
    for chain, curves, round_trips, base in runs:
        for source, round_trip in round_trips:
            saved, saved_values = full_tensors(source)
            again, again_values = full_tensors(round_trip)
            assert sorted(saved_values) == sorted(again_values), (sorted(saved_values), sorted(again_values))
            assert saved["optimizer_step"] == again["optimizer_step"] == saved["step"], (saved, again)
            for key, value in saved_values.items():
                np.testing.assert_array_equal(again_values[key], value, err_msg=f"{key}: {source} -> {round_trip}")
        full = curves[0]
        for i in range(1, len(chain)):
            np.testing.assert_allclose(curves[i], full[EVERY * i:], rtol=2e-5, atol=0,
                                       err_msg=f"{chain[i]} resumed at step {EVERY * i} from {chain[i - 1]}")
        ref = losses(train(base, reference=True, write_outputs=False))
        np.testing.assert_allclose(full, ref, rtol=2e-5, atol=0, err_msg=f"{chain[0]} vs single process")
        last = len(chain) - 1
        resume_dir = Path(base.out).parent / "reference-resume"
        source = round_trips[-1][0]  # chain[last - 1]'s checkpoint the last hop resumed from
        shutil.copytree(source, resume_dir / "checkpoints" / source.name)
        resumed = losses(train(base.replace(resume=True, checkpoint_dir=str(resume_dir / "checkpoints")),
                               reference=True, write_outputs=False))
        np.testing.assert_allclose(resumed, ref[EVERY * last:], rtol=2e-5, atol=0,
                                   err_msg=f"single process resumed at step {EVERY * last} from {chain[last - 1]}")
    return results


def check_format_2_resume(out: str) -> list[float]:
    """A checkpoint of format 2 (``manifest.json`` and ``.npz`` shards, written by the
    writer of before the safetensors format: ``_legacy_checkpoint``) resumes: in the same
    layout (dp-shard over the world) bit-identically to the uninterrupted run, and resharded
    into tp over the world within the layouts' parity (2e-5 relative, as
    ``check_reshard_chains``); its tensors read back equal to the format-3 checkpoint of the
    same state, and the resumed run's new checkpoints (format 3) are preferred over it."""
    from tests.train import _legacy_checkpoint
    from hyper_parallel.train.loop import checkpoint_pieces, data_record, model_record

    p = get_platform()
    n, r = p.world_size(), p.rank()
    cfg = tiny_config(f"{out}/full", nproc=n, layout=Layout(dp_shard=n), steps=4, checkpoint_every=2, eval_every=4)
    full = losses(train(cfg))
    # the state of step 2, loaded from the new checkpoint and written in the old format
    legacy = Path(f"{out}/legacy")
    (cfg.checkpoint_path / "step_00000004").rename(cfg.checkpoint_path / "moved") if r == 0 else None
    barrier()
    run = setup(cfg)
    hashed: list[str] = []

    def counted(path: Path) -> str:
        hashed.append(path.name)
        return digest(path)

    with mock.patch.object(checkpoint, "digest", counted):
        loaded = load_checkpoint(run, cfg.checkpoint_path)
    assert loaded is not None and loaded.step == 2 and loaded.manifest["format"] == 3, loaded
    # [Note: shared verification]: each rank hashed its share of the files, no other
    assert hashed == [f"rank_{i:05d}.safetensors" for i in range(r, n, n)], hashed
    restore(run, loaded)
    state = run.optimizer.state_arrays()
    meta = {"layout": layout_record(cfg, cfg.layout), "model": model_record(cfg), "data": data_record(cfg),
            "optimizer_step": int(state["step"])}
    _legacy_checkpoint.save(p, legacy, 2, checkpoint_pieces(run, state), meta, n, r)
    assert sorted(x.name for x in (legacy / "step_00000002").iterdir()) == sorted(
        ["manifest.json", *(f"rank_{i:05d}.npz" for i in range(n)), *(f"rank_{i:05d}.npz.sha256" for i in range(n))])
    curves = []
    for i, layout in enumerate([Layout(dp_shard=n), Layout(tp=n)]):
        folder = Path(f"{out}/resume{i}/checkpoints")
        if r == 0:
            shutil.copytree(legacy, folder)
        barrier()
        rows = train(cfg.replace(out=f"{out}/resume{i}", layout=layout, resume=True, checkpoint_dir=str(folder)))
        curves.append(losses(rows))
        newest = checkpoint.latest_manifest(folder)
        assert newest is not None and newest[1]["format"] == 3 and newest[1]["step"] == 4, newest
    np.testing.assert_array_equal(curves[0], full[2:], err_msg="format 2, same layout")
    np.testing.assert_allclose(curves[1], full[2:], rtol=2e-5, atol=0, err_msg="format 2 resharded into tp")
    if r == 0:
        old, old_values = full_tensors(legacy / "step_00000002")
        new, new_values = full_tensors(cfg.checkpoint_path / "step_00000002")
        assert old["format"] == 2 and new["format"] == 3 and sorted(old_values) == sorted(new_values)
        for key, value in new_values.items():
            np.testing.assert_array_equal(old_values[key], value, err_msg=key)
    return [*curves[0].tolist(), *curves[1].tolist()]


def framework_leg(out: str, degrees: dict, resume: bool) -> dict:
    """One leg of a cross-framework resume: ``tiny`` for 4 steps in layout ``degrees``
    (a checkpoint every 2 steps) on this rank's framework. ``resume``: continue from the
    checkpoint that the test copied into ``<out>/checkpoints`` (written by the other
    framework), after writing what was loaded back to ``<out>/round-trip`` (the state this
    framework holds, to compare with the other framework's checkpoint). Returns the
    losses, the step resumed from and the reshard message."""
    p = get_platform()
    n = p.world_size()
    cfg = tiny_config(out, nproc=n, layout=Layout(**degrees), steps=4, checkpoint_every=2, eval_every=4,
                      resume=resume)
    run = setup(cfg)
    start, message = 0, None
    if resume:
        loaded = load_checkpoint(run, cfg.checkpoint_path)
        assert loaded is not None and loaded.resharded, loaded
        start = loaded.step
        message = checkpoint.reshard_message(loaded.path, loaded.manifest, layout_record(cfg, cfg.layout), n)
        restore(run, loaded)
        save_checkpoint(run, Path(out) / "round-trip", start)
    rows = train(cfg, run=run)
    return {"losses": losses(rows).tolist(), "start": start, "message": message, "framework": p.framework}
