"""``hyper-parallel export``: checkpoints of the main job, written by several layouts on torch
and on MindSpore, exported as Hugging Face folders (in a process that imports neither
framework) and loaded with ``transformers``; their logits against the job's own forward of the
checkpoint's values; an ``--hf-config`` run's checkpoint under its own names and
configuration; the byte-level tokenizer; what the command refuses.

Tolerance of the logits (float32, the job's dtype): 1e-5 absolute. The two models compute the
same function with the same weights (see [Note: the job's decoder as Hugging Face's Llama] in
``train/export.py``); the one difference is the rotary tables: the job's are computed in
float64 and rounded, HF's in float32, a few ulps apart in angle (more at later positions).
Measured here (2 training steps, logits up to 0.8, 64 positions): 9e-8. Larger weights move it
with them: 7e-6 over 32 positions and 1.1e-5 over 200 on logits up to 10 (the tiny model with
noise of std 0.3 added to every weight). With HF's own tables swapped into the job's model
the logits are equal (measured 0.0 in all of these; checked within 1e-6, which any convention
mismatch, a swapped gate/up or a permuted head, exceeds by orders of magnitude).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.testing.rendezvous import framework_of, selected_platform
from tests.train._ranks import TEST_DATA, tiny_config

REPO = Path(__file__).resolve().parents[2]
#: logits of the exported model against the job's forward (see the module docstring)
LOGITS_ATOL = 1e-5
#: the same with HF's rotary tables in the job's model (measured 0.0)
SAME_TABLES_ATOL = 1e-6

#: Runs of the torch test, all on 4 ranks: (name, TrainConfig changes).
TORCH_RUNS = [
    ("tp2_dp2", dict(layout_degrees=dict(tp=2, dp_shard=2))),
    ("tp2_dp2_tied", dict(layout_degrees=dict(tp=2, dp_shard=2), tie=True)),
    ("pp2_dp2", dict(layout_degrees=dict(pp=2, dp_shard=2, microbatches=2))),
]

on_torch = pytest.mark.skipif(framework_of(selected_platform()) != "torch", reason="the torch session's test")
on_mindspore = pytest.mark.skipif(framework_of(selected_platform()) != "mindspore",
                                  reason="the mindspore session's test")


def train_runs(out: str, runs: list[tuple[str, dict]], hf_config: str | None = None) -> None:
    """Each run of ``runs`` for 2 steps of the ``tiny`` model on this world, its checkpoint
    in ``<out>/<name>/checkpoints`` (the last step's)."""
    from hyper_parallel.platform import get_platform
    from hyper_parallel.train.config import PRESETS, Layout
    from hyper_parallel.train.loop import train

    n = get_platform().world_size()
    for name, changes in runs:
        model = dataclasses.replace(PRESETS["tiny"], tie_embeddings=bool(changes.get("tie")))
        extra = dict(hf_config=hf_config) if hf_config is not None else dict(model=model)
        cfg = tiny_config(f"{out}/{name}", nproc=n, layout=Layout(**changes["layout_degrees"]), steps=2,
                          eval_every=2, **extra)
        train(cfg)


def sample_tokens() -> np.ndarray:
    """Two sequences of 64 real bytes (``[2, 64]`` int64): the start of two test files."""
    files = sorted(Path(TEST_DATA[0]).glob("*.py"))[:2]
    return np.stack([np.frombuffer(f.read_bytes()[:64], np.uint8) for f in files]).astype(np.int64)


def job_logits(root: str, tokens: np.ndarray, hf_tables: bool = False) -> np.ndarray:
    """The job's own decoder (``build_model`` on this process's platform, one rank) holding
    the values of the newest checkpoint under ``root``, read through the checkpoint's API
    with the job's names (not through the export): its logits of ``tokens`` at positions
    ``0 .. seq - 1``. ``hf_tables``: with HF's float32 rotary tables (torch only)."""
    from hyper_parallel.core.fully_shard import Box
    from hyper_parallel.platform import get_platform
    from hyper_parallel.train import checkpoint
    from hyper_parallel.train.config import ModelConfig
    from hyper_parallel.train.model import build_model, parameter_shapes

    path, manifest = checkpoint.latest_manifest(Path(root))
    cfg = ModelConfig(**manifest["model"])
    shapes = parameter_shapes(cfg)
    arrays = checkpoint.read_pieces(path, manifest, {f"param/{name}": Box(shape, (0,) * len(shape), shape)
                                                     for name, shape in shapes.items()})
    p = get_platform()
    model = build_model(p, cfg, seed=1)  # other initial values: all are replaced
    for name in shapes:
        p.set_parameter(model, name, p.make_parameter(p.from_numpy(arrays[f"param/{name}"])))
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).copy()
    if hf_tables:
        import torch
        import transformers

        from hyper_parallel.train.export import llama_config

        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
            transformers.LlamaConfig(**llama_config(cfg)))
        cos, sin = rotary(torch.zeros(1), torch.arange(cfg.max_seq_len)[None])
        model.rope_cos.copy_(cos[0, :, :cfg.head_dim // 2])
        model.rope_sin.copy_(sin[0, :, :cfg.head_dim // 2])
    return p.to_numpy(model.logits(p.from_numpy(tokens), p.from_numpy(positions)))


def hf_logits(folder: str, tokens: np.ndarray) -> np.ndarray:
    """``transformers.AutoModelForCausalLM.from_pretrained(folder)`` in float32: its logits of
    ``tokens`` (HF's default positions ``0 .. seq - 1``). A rank function too (the
    mindspore-cpu session runs it in a torch process)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens)).logits.numpy()


#: ``python -c``: ``hyper-parallel export ARGS`` in a process that must not import torch or
#: MindSpore (the export reads numpy pieces and writes safetensors.numpy).
EXPORT_SCRIPT = ("import sys\n"
                 "from hyper_parallel.train.cli import main\n"
                 "code = main(['export', *sys.argv[1:]])\n"
                 "loaded = [name for name in ('torch', 'mindspore', 'transformers') if name in sys.modules]\n"
                 "assert not loaded, f'export imported {loaded}'\n"
                 "sys.exit(code)\n")


def export(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=120)


def export_ok(checkpoint: Path, out: Path) -> None:
    done = export(str(checkpoint), "--format", "hf", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@on_torch
def test_export_matches_the_job_on_torch(run_on_ranks, tmp_path: Path) -> None:
    """tp 2 x dp-shard 2 (untied and tied head) and pp 2 x dp-shard 2 checkpoints, exported
    from the checkpoint root and from the step folder: HF Llama's logits are the job's."""
    pytest.importorskip("transformers")
    run_on_ranks(train_runs, str(tmp_path), TORCH_RUNS, world_size=4, timeout_s=600)
    tokens = sample_tokens()
    for name, changes in TORCH_RUNS:
        root = tmp_path / name / "checkpoints"
        out = tmp_path / name / "export"
        export_ok(root, out)
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["tie_word_embeddings"] is bool(changes.get("tie")), config
        got = hf_logits(str(out), tokens)
        mine = job_logits(str(root), tokens)
        np.testing.assert_allclose(got, mine, rtol=0, atol=LOGITS_ATOL, err_msg=name)
        np.testing.assert_allclose(got, job_logits(str(root), tokens, hf_tables=True), rtol=0,
                                   atol=SAME_TABLES_ATOL, err_msg=f"{name}, HF's rotary tables")
        # the step folder names the same checkpoint
        (step,) = [entry for entry in root.iterdir() if entry.name.startswith("step_")]
        export_ok(step, tmp_path / name / "export_step")
        np.testing.assert_array_equal(hf_logits(str(tmp_path / name / "export_step"), tokens), got)


@on_torch
def test_export_of_an_hf_config_run(run_on_ranks, tmp_path: Path) -> None:
    """An ``--hf-config`` run (a tiny random-init Llama, tp 2 x dp-shard 2): the export holds
    the model's own names and the configuration it was trained from (recorded in the
    manifest's model record), and gives the trained model's logits."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    from hyper_parallel.core.fully_shard import Box
    from hyper_parallel.train import checkpoint
    from tests.train.test_hf_config import _write_config

    hf_config = _write_config(tmp_path / "llama", "llama", weights=False)
    run_on_ranks(train_runs, str(tmp_path), [("hf", dict(layout_degrees=dict(tp=2, dp_shard=2)))], hf_config,
                 world_size=4, timeout_s=600)
    root, out = tmp_path / "hf" / "checkpoints", tmp_path / "hf" / "export"
    export_ok(root, out)
    written = json.loads(Path(hf_config).read_text())
    exported = json.loads((out / "config.json").read_text())
    assert exported == {key: value for key, value in written.items()
                        if key not in ("transformers_version", "_name_or_path")}
    # the trained model: a fresh one of the config holding the checkpoint's values
    path, manifest = checkpoint.latest_manifest(root)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(hf_config),
                                                          dtype=torch.float32).eval()
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    values = checkpoint.read_pieces(path, manifest, {f"param/{name}": Box(shape, (0,) * len(shape), shape)
                                                     for name, shape in shapes.items()})
    assert len(values) == len(shapes)
    model.load_state_dict({name: torch.from_numpy(values[f"param/{name}"]) for name in shapes}, strict=False)
    tokens = sample_tokens()
    with torch.no_grad():
        trained = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    # the same class, weights and kernels: equal
    np.testing.assert_array_equal(hf_logits(str(out), tokens), trained)


@on_mindspore
def test_export_of_a_mindspore_checkpoint(run_on_ranks, tmp_path: Path) -> None:
    """A tp 2 x dp-shard 2 checkpoint written by MindSpore, exported, and loaded by
    transformers in a torch process: its logits against the job's MindSpore forward of the
    checkpoint's values.

    Tolerance: ``LOGITS_ATOL`` as on torch (the rotary tables), plus MindSpore's CPU ``exp``
    (~2.7e-6 relative, ``CROSS_FRAMEWORK_RTOL``'s derivation) in the attention softmax, whose
    weights sum to 1, so the attention outputs move by ~1e-6 relative: within 1e-5."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers on torch loads the export")
    from hyper_parallel.testing import run_on_ranks as run_on_fresh_ranks

    run_on_ranks(train_runs, str(tmp_path), TORCH_RUNS[:1], world_size=4, timeout_s=600)
    root, out = tmp_path / "tp2_dp2" / "checkpoints", tmp_path / "tp2_dp2" / "export"
    export_ok(root, out)
    tokens = sample_tokens()
    (got,) = run_on_fresh_ranks(hf_logits, 1, str(out), tokens, platform="torch-cpu", timeout_s=300)
    np.testing.assert_allclose(got, job_logits(str(root), tokens), rtol=0, atol=LOGITS_ATOL)


def test_names_and_config() -> None:
    """Every parameter of the job's decoder has its Llama name, one to one; the config
    carries the model's constants."""
    from hyper_parallel.train.config import PRESETS
    from hyper_parallel.train.export import hf_name, llama_config
    from hyper_parallel.train.model import parameter_shapes

    cfg = dataclasses.replace(PRESETS["tiny"], rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=True)
    names = [hf_name(name) for name in parameter_shapes(cfg)]
    assert len(set(names)) == len(names)
    assert hf_name("layers.1.feed_forward.w1.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert hf_name("layers.1.feed_forward.w3.weight") == "model.layers.1.mlp.up_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert "lm_head.weight" not in names  # tied: the head is the embedding
    with pytest.raises(ValueError, match="'layers.0.attention.wz.weight' is not a parameter"):
        hf_name("layers.0.attention.wz.weight")
    config = llama_config(cfg)
    assert (config["rope_parameters"]["rope_theta"], config["rms_norm_eps"], config["tie_word_embeddings"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"],
            config["max_position_embeddings"]) == (500000.0, 1e-6, True, 4, 4, 256, 256)
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        loaded = transformers.LlamaConfig(**config)
        assert loaded.rope_parameters["rope_theta"] == 500000.0 and loaded.rms_norm_eps == 1e-6


def _save_tiny_checkpoint(root: Path, step: int = 2, names: dict[str, str] | None = None) -> Path:
    """A one-rank checkpoint of the ``tiny`` decoder (zeros) through the checkpoint's API;
    ``names``: stored under these names instead (an HF model's, without its config)."""
    from hyper_parallel.core.fully_shard import Box
    from hyper_parallel.train import checkpoint
    from hyper_parallel.train.config import PRESETS
    from hyper_parallel.train.model import parameter_shapes

    cfg = PRESETS["tiny"]
    rename = names or {}
    pieces = {f"param/{rename.get(name, name)}": checkpoint.Piece(Box(shape, (0,) * len(shape), shape),
                                                                  np.zeros(shape, np.float32))
              for name, shape in parameter_shapes(cfg).items()}
    meta = {"layout": {"degrees": {"tp": 1}}, "model": dataclasses.asdict(cfg)}
    return checkpoint.save(None, root, step, pieces, meta, world=1, rank=0)


def test_byte_tokenizer(tmp_path: Path) -> None:
    """The exported tokenizer maps text to its UTF-8 bytes and back, with no special tokens."""
    transformers = pytest.importorskip("transformers")
    _save_tiny_checkpoint(tmp_path / "ckpt")
    export_ok(tmp_path / "ckpt", tmp_path / "out")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "def f(x):\n\treturn 'héllo wörld ✓'  \x00\x7f"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 256


def _corrupt_a_shard(step: Path) -> None:
    """Append a byte to one file of the checkpoint other than its manifest (whatever the
    shard format): verification must fail."""
    shard = sorted(entry for entry in step.iterdir() if entry.is_file() and entry.name.startswith("rank_"))[0]
    with shard.open("ab") as f:
        f.write(b"\0")


#: (id, arguments with {tmp}, what the one line must say)
REFUSALS = [
    ("missing", ["{tmp}/nothing", "--out", "{tmp}/out"], ["checkpoint '{tmp}/nothing' does not exist"]),
    ("a-file", ["{tmp}/file", "--out", "{tmp}/out"], ["is a file, not a folder"]),
    ("empty-root", ["{tmp}/empty", "--out", "{tmp}/out"], ["'{tmp}/empty' holds no step_* checkpoint"]),
    ("cut-off-step", ["{tmp}/cut/step_00000003", "--out", "{tmp}/out"],
     ["checkpoint '{tmp}/cut/step_00000003' is unusable: it has no model.safetensors.index.json"]),
    ("only-cut-off", ["{tmp}/cut", "--out", "{tmp}/out"],
     ["none of the 1 checkpoints under '{tmp}/cut' is complete", "step_00000003: it has no model.safetensors.index.json"]),
    ("corrupted", ["{tmp}/bad/step_00000002", "--out", "{tmp}/out"],
     ["checkpoint '{tmp}/bad/step_00000002' is unusable"]),
    ("hf-without-config", ["{tmp}/old_hf", "--out", "{tmp}/out"],
     ["holds a Hugging Face model's parameters", "does not record the HF configuration"]),
    ("format", ["{tmp}/good", "--format", "gguf", "--out", "{tmp}/out"],
     ["--format='gguf' is not an export format; use one of hf"]),
    ("out-not-empty", ["{tmp}/good", "--out", "{tmp}/full"], ["--out '{tmp}/full' exists and is not empty", "--force"]),
    ("out-a-file", ["{tmp}/good", "--out", "{tmp}/file"], ["--out '{tmp}/file' is a file"]),
]


@pytest.fixture
def bad_inputs(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("not a checkpoint")
    (tmp_path / "empty").mkdir()
    (tmp_path / "cut" / "step_00000003").mkdir(parents=True)
    _save_tiny_checkpoint(tmp_path / "good")
    _corrupt_a_shard(_save_tiny_checkpoint(tmp_path / "bad"))
    # an --hf-config run's checkpoint from before the manifest recorded the HF configuration
    _save_tiny_checkpoint(tmp_path / "old_hf", names={"tok_embeddings.weight": "model.embed_tokens.weight"})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    return tmp_path


@pytest.mark.parametrize("args, needles", [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS])
def test_refusals(bad_inputs: Path, args: list[str], needles: list[str]) -> None:
    """Each refusal: exit status 2, one line naming the value and the fix, nothing written."""
    done = export(*(arg.format(tmp=bad_inputs) for arg in args))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyper-parallel export: error: "), done.stderr
    for needle in needles:
        assert needle.format(tmp=bad_inputs) in lines[0], lines[0]
    assert not (bad_inputs / "out").exists()


def test_force_and_newest(bad_inputs: Path) -> None:
    """``--force`` writes into a folder that is not empty (other files stay); a root whose
    newest checkpoint is cut off exports the previous one, with a warning."""
    done = export(str(bad_inputs / "good"), "--out", str(bad_inputs / "full"), "--force")
    assert done.returncode == 0, done.stderr
    assert (bad_inputs / "full" / "notes.txt").read_text() == "keep me"
    assert (bad_inputs / "full" / "model.safetensors").is_file()
    (bad_inputs / "good" / "step_00000009").mkdir()
    done = export(str(bad_inputs / "good"), "--out", str(bad_inputs / "newest"))
    assert done.returncode == 0, done.stderr
    assert "step_00000002" in done.stdout and "step_00000009 is unusable" in done.stderr, done.stdout + done.stderr


def test_hf_config_is_recorded_for_resume(tmp_path: Path) -> None:
    """The manifest's model record of an ``--hf-config`` run holds its configuration: a
    resume with another configuration is refused (another model, even where the sizes
    agree), one saved again by another ``transformers`` (``transformers_version``,
    ``_name_or_path``) resumes."""
    pytest.importorskip("transformers")
    from hyper_parallel.core.fully_shard import Box
    from hyper_parallel.train import checkpoint, preflight
    from hyper_parallel.train.config import Layout, TrainConfig
    from hyper_parallel.train.loop import layout_record, model_record
    from tests.train.test_hf_config import _write_config

    written = json.loads(Path(_write_config(tmp_path / "a", "llama", weights=False)).read_text())

    def run(name: str, **changes: object) -> TrainConfig:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**written, **changes}))
        return TrainConfig(platform="torch", nproc=1, layout=Layout(), hf_config=str(tmp_path / name / "config.json"),
                           checkpoint_dir=str(tmp_path / "ckpt"), resume=True, out=str(tmp_path / "run"))

    first = run("first")
    assert model_record(first)["hf_config"]["rope_parameters"] == written["rope_parameters"]
    piece = checkpoint.Piece(Box((32,), (0,), (32,)), np.ones(32, np.float32))
    meta = {"layout": layout_record(first, first.layout), "model": model_record(first)}
    checkpoint.save(None, tmp_path / "ckpt", 2, {"param/model.norm.weight": piece}, meta, world=1, rank=0)
    preflight.check_resume(run("again", transformers_version="9.9.9", _name_or_path="elsewhere"))
    # the sizes (ModelConfig's fields) agree: only the recorded configuration tells them apart
    with pytest.raises(ValueError, match="holds another model; it was written with hf_config=.*'silu'.*"
                                         "this run has hf_config=.*'gelu'"):
        preflight.check_resume(run("other", hidden_act="gelu"))
