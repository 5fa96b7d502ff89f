"""Checks of a ``hyper-parallel train`` run against this machine, made by the command line
before any rank starts (``config.py`` checks the values themselves; these need the
environment): the backend can run here, the run folders can be written, and ``--resume``
has a checkpoint of the same model to continue from.

Each failure raises ``ValueError`` naming the flag, the value, the rule and the fix; the
command line prints it as one line and exits with status 2. Without these checks the same
mistakes surfaced as a traceback from every rank (an unavailable backend, an unwritable
``--out``), or not at all (``--resume`` with no checkpoint trained from step 0).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

from hyper_parallel.platform import backend_problem
from hyper_parallel.train.config import TrainConfig
from hyper_parallel.train.records import model_record

def check_platform(cfg: TrainConfig) -> None:
    """``ValueError`` if ``--platform`` cannot run here (``platform.backend_problem``)."""
    problem = backend_problem(cfg.platform)
    if problem is not None:
        cpu = cfg.platform.split("-")[0] + "-cpu"  # the same framework on the CPU
        raise ValueError(f"--platform={cfg.platform!r} cannot run on this machine: {problem}; use --platform {cpu} "
                         "here, or run on a machine with that backend installed")


#: The probe of ``check_dtype``: one forward and backward of a two-layer decoder of width
#: 32 under ``--dtype``'s mixed precision, in a fresh process of the run's backend.
_DTYPE_PROBE = """
import sys
import numpy as np
import hyper_parallel as hp
from hyper_parallel.train.model import build_model
from hyper_parallel.train.model_config import ModelConfig
from hyper_parallel.train.precision import apply_mixed_precision, mixed_precision_policy
p = hp.init(sys.argv[1])
model = build_model(p, ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=64, max_seq_len=8), 0)
apply_mixed_precision(p, model, mixed_precision_policy(sys.argv[2]))
ids = p.from_numpy(np.arange(8, dtype=np.int64).reshape(1, 8))
loss, backward = p.vjp(model, [ids, ids, ids], [param for _, param in p.named_parameters(model)])
backward([p.full((), 1.0, p.dtype("float32"))])
"""


def check_dtype(cfg: TrainConfig) -> None:
    """``ValueError`` if the backend's kernels do not take ``--dtype`` (a float16 or
    bfloat16 decoder forward and backward, run once in a separate process of the backend,
    seconds; MindSpore's CPU kernels have no bfloat16 gather, for one). Nothing to check
    for ``fp32`` or no ``--dtype``: the default is one the backend runs."""
    import subprocess
    import sys

    from hyper_parallel.train.precision import DTYPES

    if cfg.dtype in (None, "fp32"):
        return
    try:
        done = subprocess.run([sys.executable, "-c", _DTYPE_PROBE, cfg.platform, cfg.dtype], capture_output=True,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise ValueError(f"--dtype {cfg.dtype}: a one-step probe of {cfg.platform} in {DTYPES[cfg.dtype]} did not "
                         "finish in 300 s; use --dtype fp32") from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip() and not line.startswith(" ")]
        kernel = [line for line in lines if "Unsupported" in line or "not implemented" in line.lower()]
        reason = (kernel or lines or ["no error message"])[-1]
        others = " or ".join(name for name in DTYPES if name != cfg.dtype)
        raise ValueError(f"--dtype {cfg.dtype} cannot run on --platform {cfg.platform}: its kernels do not take "
                         f"{DTYPES[cfg.dtype]} ({reason[:300]}); use --dtype {others} here (fp32 runs everywhere), "
                         f"or --dtype {cfg.dtype} on a backend whose kernels take it (an accelerator)")


def _check_writable(flag: str, folder: Path) -> None:
    """Create ``folder`` (with its parents) and write and remove a probe file in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(folder) else ""
        raise ValueError(f"{flag}={str(folder)!r} is not a folder this process can write: {err.strerror}{where}; "
                         f"give {flag} a writable folder") from None


def check_output_folders(cfg: TrainConfig) -> None:
    """``ValueError`` if ``--out`` or ``--checkpoint-dir`` cannot be created and written.
    Creates them (the launch would)."""
    _check_writable("--out", cfg.run_dir)
    if cfg.checkpoint_dir is not None:
        _check_writable("--checkpoint-dir", cfg.checkpoint_path)


def check_resume(cfg: TrainConfig, verify: bool = True) -> None:
    """With ``--resume``: ``ValueError`` if there is no complete checkpoint to continue from
    (starting from step 0 instead would silently discard the run being resumed), or if the
    newest one holds another model or format (``checkpoint.check_compatible``). One of
    another layout passes: the ranks reshard it.

    ``verify=False`` (inside a launcher, where every rank verifies what it loads): only
    whether any ``step_*`` folder exists, without reading the shards."""
    from hyper_parallel.train import checkpoint

    if not cfg.resume:
        return
    root = cfg.checkpoint_path
    if not verify:
        if not checkpoint.complete_steps(root):
            raise ValueError(no_checkpoint_message(cfg))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ranks warn about a skipped checkpoint themselves
        found = checkpoint.latest_manifest(root)
    if found is None:
        raise ValueError(no_checkpoint_message(cfg))
    checkpoint.check_compatible(found[0], found[1], model_record(cfg))


def no_checkpoint_message(cfg: TrainConfig) -> str:
    """What ``--resume`` says when ``cfg.checkpoint_path`` holds no usable checkpoint."""
    from hyper_parallel.train import checkpoint

    root = cfg.checkpoint_path
    where = "--checkpoint-dir" if cfg.checkpoint_dir is not None else f"the checkpoint folder of --out {cfg.out!r}"
    steps = checkpoint.complete_steps(root)
    if steps:
        reasons = "; ".join(f"step_{s:08d}: {checkpoint.verify(root / f'step_{s:08d}')}" for s in steps[-3:])
        found = f"none of its {len(steps)} checkpoints is complete ({reasons})"
    elif root.is_dir():
        found = "it holds no step_* checkpoint"
    else:
        found = "it does not exist"
    return (f"--resume: no checkpoint to resume under {str(root)!r} ({where}): {found}; drop --resume to start "
            "from step 0, or point --out/--checkpoint-dir at the run to continue")
