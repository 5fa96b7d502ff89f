"""``hyper-parallel train --hf-config``: a Hugging Face causal LM (a tiny random-init Llama,
and a Qwen2 saved with its weights) trained by the main job in its layouts, against the job's
single-process reference on the same seed and data; what the flag refuses.

Tolerance: float32 (the job's dtype). The layouts add the same sums in other orders
(gradient averaging, split softmax merged by log-sum-exp, row-parallel partial sums): a few
ulps per step, and AdamW's first steps (close to ``lr * sign(grad)``) can carry a flipped
near-zero gradient sign into the next loss; 3 steps stay within 2e-5 relative, as the job's
own layout tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.train.config import Layout
from tests.train._ranks import losses, tiny_config

pytestmark = pytest.mark.skipif(os.environ.get("HYPER_PARALLEL_PLATFORM", "").startswith("mindspore"),
                                reason="--hf-config trains a transformers model, a torch module")
RTOL = 2e-5
LAYOUTS = [dict(dp_shard=4), dict(dp_shard=2, tp=2), dict(dp_shard=2, cp=2, cp_mode="ring"),
           dict(cp=2, tp=2, cp_mode="ulysses"), dict(cp=4, cp_mode="hybrid"),
           dict(pp=2, dp_shard=2, microbatches=2), dict(pp=2, tp=2, microbatches=2, pp_schedule="zbh1"),
           dict(pp=2, cp=2, cp_mode="ring", microbatches=2, pp_schedule="interleaved-1f1b")]


def _write_config(folder: Path, arch: str, weights: bool) -> str:
    import torch
    import transformers

    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch](
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=64)
    folder.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(123)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return str(folder if weights else folder / "config.json")


def check_hf_layouts(out: str, hf_config: str, layouts: list[dict]) -> list[list[float]]:
    """Each layout's losses, then the reference's (3 steps each); every rank returns them."""
    from hyper_parallel.train.loop import train

    n = get_platform().world_size()
    curves = []
    for degrees in layouts:
        layout = Layout(**degrees)
        cfg = tiny_config(f"{out}/{layout.describe()}", nproc=n, layout=layout, steps=3, eval_every=3,
                          hf_config=hf_config)
        curves.append(losses(train(cfg)).tolist())
    if get_platform().rank() == 0:
        ref = tiny_config(f"{out}/reference", hf_config=hf_config, steps=3, eval_every=3)
        curves.append(losses(train(ref, reference=True)).tolist())
    return curves


def test_hf_model_trains_in_every_layout(run_on_ranks, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf_config = _write_config(tmp_path / "llama", "llama", weights=False)
    results = run_on_ranks(check_hf_layouts, str(tmp_path), hf_config, LAYOUTS, world_size=4, timeout_s=600)
    *curves, reference = results[0]
    for degrees, curve in zip(LAYOUTS, curves):
        np.testing.assert_allclose(curve, reference, rtol=RTOL, err_msg=str(degrees))


def check_hf_resume(out: str, hf_config: str) -> tuple[list[float], list[float]]:
    """3 steps in dp_shard 4, against 2 steps in tp 2 x dp_shard 2 resumed for the third
    in pp 2 x dp_shard 2 (the checkpoint holds the HF names in both: resharded)."""
    from hyper_parallel.train.loop import train

    whole = tiny_config(f"{out}/whole", nproc=4, layout=Layout(dp_shard=4), steps=3, eval_every=3,
                        hf_config=hf_config)
    first = tiny_config(f"{out}/cut", nproc=4, layout=Layout(dp_shard=2, tp=2), steps=2, eval_every=2,
                        hf_config=hf_config)
    second = first.replace(layout=Layout(pp=2, dp_shard=2, microbatches=2), steps=3, eval_every=3, resume=True)
    return losses(train(whole)).tolist(), losses(train(first)).tolist() + losses(train(second)).tolist()


def test_hf_checkpoint_resumes_in_another_layout(run_on_ranks, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    hf_config = _write_config(tmp_path / "llama", "llama", weights=False)
    whole, resumed = run_on_ranks(check_hf_resume, str(tmp_path), hf_config, world_size=4, timeout_s=600)[0]
    np.testing.assert_allclose(resumed, whole, rtol=RTOL)


def test_hf_weights_are_loaded(run_on_ranks, tmp_path: Path) -> None:
    """A folder with weights: ``from_pretrained`` (the first loss is the saved model's on the
    first batch, whatever the seed), tp 2 x fsdp 2 against the reference."""
    pytest.importorskip("transformers")
    folder = _write_config(tmp_path / "qwen2", "qwen2", weights=True)
    results = run_on_ranks(check_hf_layouts, str(tmp_path), folder, [dict(dp_shard=2, tp=2)], world_size=4,
                           timeout_s=600)
    curve, reference = results[0]
    np.testing.assert_allclose(curve, reference, rtol=RTOL)
    seeded = tiny_config(str(tmp_path / "seed1"), hf_config=folder, steps=1, eval_every=1, seed=1)
    from hyper_parallel.train.loop import setup

    # the weights come from the folder, not from the seed
    run = setup(seeded, reference=True)
    assert float(run.model.hf.model.embed_tokens.weight[0, 0].detach()) == pytest.approx(
        float(setup(tiny_config(str(tmp_path / "seed2"), hf_config=folder, seed=2),
                    reference=True).model.hf.model.embed_tokens.weight[0, 0].detach()))


@pytest.mark.parametrize("flags, needle", [
    (["--platform", "mindspore"], "--hf-config trains a Hugging Face transformers model"),
    (["--model", "tiny"], "--hf-config takes the model from the Hugging Face configuration"),
    (["--tp", "3"], "--tp=3 must divide the query heads (8)"),
])
def test_bad_hf_flags(tmp_path: Path, flags: list[str], needle: str) -> None:
    pytest.importorskip("transformers")
    from hyper_parallel.train.cli import build_parser, config_from_args

    hf_config = _write_config(tmp_path / "llama", "llama", weights=False)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        config_from_args(build_parser().parse_args(["train", "--hf-config", hf_config, *flags]))


def test_bad_hf_config_files(tmp_path: Path) -> None:
    from hyper_parallel.train.hf_config import read_hf_config

    with pytest.raises(ValueError, match="no such file, or a folder without config.json"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match="lacks .*num_hidden_layers"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, '
                                          '"intermediate_size": 8, "vocab_size": 100}')
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the job's 256 byte tokens"):
        read_hf_config(str(tmp_path))
