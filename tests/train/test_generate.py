"""``hyper-parallel generate`` and ``hyper-parallel eval`` on the selected backend (the file
runs in each backend's session): a ``tiny`` model trained for 4 steps on one rank in this
process, and one trained by tp 2 on 2 ranks; generation through the KV cache against the full
recompute, token for token; sampling; eval against the job's own validation loss; the
refusals, before any model is built.

Tolerances. Cached against uncached logits: 1e-5 absolute (float32; the cached path attends
the same keys and values, rotated by the same tables, in another kernel call shape: measured
9e-8 on torch, 0 on MindSpore, on logits up to 0.5). Eval against the job's validation loss
on one rank: 1e-6 relative (the same batches through the same forward on the same weights:
measured equal). Against the tp 2 run's: 2e-5 relative, the tensor-parallel run's partial
sums against one GEMM (``_ranks.check_layout_parity``'s reasoning).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.train.cli import main
from hyper_parallel.train.config import Layout
from hyper_parallel.train.evaluate import EvalConfig, bits_per_byte, eval_stream, evaluate
from hyper_parallel.train.export import find_checkpoint
from hyper_parallel.train.generate import Sampling, generate, load_decoder, next_token
from hyper_parallel.train.model import KVCache
from tests.train._ranks import TEST_DATA, tiny_config

# float32 logits of one token against the same position of a full-sequence forward: the
# cached and the whole attention sum their keys in other orders (measured 9e-8 on torch,
# 0 on MindSpore); 1e-5 is far below what a wrong position or a stale cache gives (O(1))
CACHE_ATOL = 1e-5
# eval against the job's own validation loss, same weights and batches, one rank: only
# the reduction order of the mean differs
SAME_RUN_RTOL = 1e-6
# a checkpoint written by tp 2 evaluated on one rank: the job's loss came from sharded
# GEMMs whose partial sums add in another order (measured ~1e-5 relative)
TP_RTOL = 2e-5
PROMPT = "import json\ndef "


def train_tiny(out: str, tp: int = 1) -> list[dict]:
    """4 steps of the ``tiny`` model (validation at steps 2 and 4, one batch each), one
    checkpoint at the last step in ``<out>/checkpoints``; a rank function for tp > 1."""
    from hyper_parallel.train.loop import train

    return train(tiny_config(out, tp=tp, nproc=tp, layout=Layout(tp=tp), checkpoint_every=0))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("generate") / "run"
    return out / "checkpoints", train_tiny(str(out))


@pytest.fixture(scope="module")
def loaded(trained: tuple[Path, list[dict]]):
    return load_decoder(get_platform(), *find_checkpoint(trained[0]))


def test_cached_generation_equals_the_full_recompute(loaded) -> None:
    """Greedy bytes through the KV cache are the full forward's, token for token; the cached
    logits of every position equal the full forward's."""
    p, cfg = get_platform(), loaded.cfg
    prompt = PROMPT.encode()
    cached = list(generate(p, loaded.model, cfg, prompt, 48, Sampling()))
    full = list(generate(p, loaded.model, cfg, prompt, 48, Sampling(), use_cache=False))
    assert cached == full and len(cached) == 48
    tokens = np.asarray([list(prompt) + cached], np.int64)
    positions = np.arange(tokens.shape[1], dtype=np.int64)[None]
    cache = KVCache(cfg.n_layers)
    n = len(prompt)
    with p.no_grad():
        whole = p.to_numpy(loaded.model.logits(p.from_numpy(tokens), p.from_numpy(positions)))
        steps = [p.to_numpy(loaded.model.logits(p.from_numpy(tokens[:, :n]), p.from_numpy(positions[:, :n]), cache))]
        for i in range(n, tokens.shape[1]):
            steps.append(p.to_numpy(loaded.model.logits(p.from_numpy(tokens[:, i:i + 1]),
                                                        p.from_numpy(positions[:, i:i + 1]), cache)))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=0, atol=CACHE_ATOL)
    assert cache.length == tokens.shape[1]
    with pytest.raises(ValueError, match="new tokens after"):
        loaded.model.logits(p.from_numpy(tokens[:, :2]), p.from_numpy(positions[:, :2]), cache)


def test_sampling(loaded) -> None:
    """The same seed draws the same bytes; top-k 1 is greedy; the draws stay in the top-k /
    top-p support (numpy alone: the same on both frameworks from the same logits)."""
    p, cfg, prompt = get_platform(), loaded.cfg, PROMPT.encode()
    greedy = list(generate(p, loaded.model, cfg, prompt, 16, Sampling()))
    drawn = Sampling(sample=True, temperature=0.8, top_p=0.9, seed=3)
    once = list(generate(p, loaded.model, cfg, prompt, 16, drawn))
    assert once == list(generate(p, loaded.model, cfg, prompt, 16, drawn))
    assert once == list(generate(p, loaded.model, cfg, prompt, 16, drawn, use_cache=False))
    assert list(generate(p, loaded.model, cfg, prompt, 16, Sampling(sample=True, top_k=1, seed=5))) == greedy
    logits = np.log(np.asarray([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    assert {next_token(logits, Sampling(sample=True, top_k=2), rng) for _ in range(200)} == {0, 1}
    assert {next_token(logits, Sampling(sample=True, top_p=0.8), rng) for _ in range(200)} == {0, 1}
    assert {next_token(logits, Sampling(sample=True, top_p=0.81), rng) for _ in range(300)} == {0, 1, 2}
    assert {next_token(logits, Sampling(sample=True), rng) for _ in range(500)} == {0, 1, 2, 3}
    assert next_token(logits, Sampling(), rng) == 0


def test_generate_command_line(trained: tuple[Path, list[dict]], loaded, capsys: pytest.CaptureFixture) -> None:
    """``hyper-parallel generate ROOT``: the newest checkpoint named on stderr, the prompt and
    the greedy continuation on stdout; ``--no-cache`` prints the same."""
    root, _ = trained
    assert main(["generate", str(root), "--prompt", PROMPT, "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert f"checkpoint {root / 'step_00000004'} (step 4" in err and "greedy" in err
    expected = bytes(list(PROMPT.encode()) + list(generate(get_platform(), loaded.model, loaded.cfg, PROMPT.encode(),
                                                           24, Sampling()))).decode("utf-8", errors="replace")
    assert out == expected + "\n"
    assert main(["generate", str(root / "step_00000004"), "--prompt", PROMPT, "--max-new-tokens", "24",
                 "--no-cache"]) == 0
    assert capsys.readouterr().out == out
    assert main(["generate", str(root), "--prompt", PROMPT, "--max-new-tokens", "8", "--top-k", "5", "--seed",
                 "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPT) and "sampling (temperature 1.0, top-k 5, top-p 1.0, seed 1)" in err


def test_eval_equals_the_jobs_validation_loss(trained: tuple[Path, list[dict]], loaded,
                                              capsys: pytest.CaptureFixture) -> None:
    """With the run's data and its checkpoint's data record (seed, batch size, sequence
    length), eval's loss is the run's validation loss at that step; bits per byte is loss /
    ln 2; ``--split all`` reads every byte of the data."""
    root, rows = trained
    job = rows[-1]["val_loss"]
    cfg = EvalConfig(data=TEST_DATA, seq_len=32, batch_size=4, batches=1)
    loss = evaluate(get_platform(), loaded.model, eval_stream(cfg), cfg)
    np.testing.assert_allclose(loss, job, rtol=SAME_RUN_RTOL)
    assert main(["eval", str(root), "--data", *TEST_DATA, "--batches", "1"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"loss (\S+) nats/byte, (\S+) bits/byte: 1 batches of 4 x 32 bytes \(seed 0\) from the "
                      r"validation split", out)
    assert found is not None, out
    np.testing.assert_allclose(float(found.group(1)), job, atol=5e-5)  # printed to 4 decimals
    np.testing.assert_allclose(float(found.group(2)), bits_per_byte(job), atol=5e-5)
    whole = EvalConfig(data=TEST_DATA, split="all", seq_len=32, batch_size=4)
    assert len(eval_stream(whole)) > len(eval_stream(cfg))
    assert np.isfinite(evaluate(get_platform(), loaded.model, eval_stream(whole), whole))


def test_a_tensor_parallel_checkpoint(run_on_ranks, tmp_path: Path) -> None:
    """A checkpoint written by tp 2 on 2 ranks, read whole here: eval gives the run's own
    validation loss, and cached greedy generation equals the full recompute."""
    rows = run_on_ranks(train_tiny, str(tmp_path / "tp2"), 2, world_size=2, timeout_s=300)[0]
    loaded = load_decoder(get_platform(), *find_checkpoint(tmp_path / "tp2" / "checkpoints"))
    cfg = EvalConfig(data=TEST_DATA, seq_len=32, batch_size=4, batches=1)
    np.testing.assert_allclose(evaluate(get_platform(), loaded.model, eval_stream(cfg), cfg), rows[-1]["val_loss"],
                               rtol=TP_RTOL)
    p, prompt = get_platform(), PROMPT.encode()
    assert list(generate(p, loaded.model, loaded.cfg, prompt, 24, Sampling())) == \
        list(generate(p, loaded.model, loaded.cfg, prompt, 24, Sampling(), use_cache=False))


#: (id, arguments with {root} (the trained run's checkpoints) and {tmp}, what the error says)
REFUSALS = [
    ("missing", ["generate", "{tmp}/nothing", "--prompt", "x"], "checkpoint '{tmp}/nothing' does not exist"),
    ("no-checkpoint", ["generate", "{tmp}", "--prompt", "x"], "'{tmp}' holds no step_* checkpoint"),
    ("empty-prompt", ["generate", "{root}", "--prompt", ""], "--prompt is empty"),
    ("long-prompt", ["generate", "{root}", "--prompt", "é" * 129],
     "--prompt is 258 bytes (UTF-8) but the model's max_seq_len is 256"),
    ("top-p-0", ["generate", "{root}", "--prompt", "x", "--top-p", "0"], "--top-p=0.0 must be in (0, 1]"),
    ("top-p-big", ["generate", "{root}", "--prompt", "x", "--top-p", "1.5"], "--top-p=1.5 must be in (0, 1]"),
    ("top-k-0", ["generate", "{root}", "--prompt", "x", "--top-k", "0"], "--top-k=0 must be an integer >= 1"),
    ("temperature-0", ["generate", "{root}", "--prompt", "x", "--temperature", "0"],
     "--temperature=0.0 must be a number > 0"),
    ("temperature-negative", ["generate", "{root}", "--prompt", "x", "--temperature", "-1"],
     "--temperature=-1.0 must be a number > 0"),
    ("max-new-tokens", ["generate", "{root}", "--prompt", "x", "--max-new-tokens", "-1"],
     "--max-new-tokens=-1 must be >= 0"),
    ("eval-missing", ["eval", "{tmp}/nothing"], "checkpoint '{tmp}/nothing' does not exist"),
    ("eval-split", ["eval", "{root}", "--data", *TEST_DATA, "--split", "train"], "--split='train' is not a split"),
    ("eval-seq-len", ["eval", "{root}", "--data", *TEST_DATA, "--seq-len", "300"],
     "--seq-len=300 is longer than the model's max_seq_len 256"),
    ("eval-batches", ["eval", "{root}", "--data", *TEST_DATA, "--batches", "0"], "--batches=0 must be an integer >= 1"),
    ("eval-data", ["eval", "{root}", "--data", "{tmp}/no-text"], "--data '{tmp}/no-text': no such file or folder"),
]


@pytest.mark.parametrize("args, needle", [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS])
def test_refusals(trained: tuple[Path, list[dict]], tmp_path: Path, capsys: pytest.CaptureFixture,
                  args: list[str], needle: str) -> None:
    """Exit status 2 and one line ``hyper-parallel <command>: error: ...`` naming the value,
    before any model is built (nothing on stdout)."""
    values = {"root": str(trained[0]), "tmp": str(tmp_path)}
    with pytest.raises(SystemExit) as exited:
        main([arg.format(**values) for arg in args])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"hyper-parallel {args[0]}: error: ") and err.count("\n") == 1, err
    assert needle.format(**values) in err, err
