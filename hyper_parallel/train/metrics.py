"""What a run shows: per-step metrics as JSON lines, a progress bar, the loss-curve PNG.

One line of ``metrics.jsonl`` per optimizer step::

    {"step": 12, "loss": 3.91, "grad_norm": 0.83, "lr": 0.0024, "tokens_per_s": 5123.4,
     "step_time_s": 0.2, "peak_memory_bytes": [r0, r1, ...], "dtype": "fp32",
     "val_loss": 3.95}   # val_loss every K steps; "loss_scale": 65536.0 with --dtype fp16

``loss`` and ``val_loss`` are mean next-byte cross-entropies in nats; ``grad_norm`` is the
global L2 norm of the gradients before clipping (``grad_norm.py``); ``tokens_per_s``
counts the tokens of the whole (global) batch; ``peak_memory_bytes`` holds each rank's
``platform.memory_stats().peak`` (device memory, or peak RSS on CPU); ``dtype`` is the
compute dtype the run resolved (``--dtype`` or the device's default, ``precision``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"

#: ``--log`` values: where the metrics go besides ``metrics.jsonl``, and the package each
#: needs (``pip install -e '.[logging]'``): TensorBoard event files under
#: ``<out>/tensorboard`` (the ``tensorboard`` package's own ``tensorboard.summary.Writer``,
#: no framework needed), a Weights & Biases run in offline mode under ``<out>/wandb``
#: (``wandb sync`` uploads it later).
LOGGERS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"


def missing_logger_package(name: str) -> str | None:
    """The package ``--log name`` needs when it is not installed (``None`` when it is)."""
    package = LOGGERS[name]
    return None if importlib.util.find_spec(package) is not None else package


class ExtraLoggers:
    """The ``--log`` destinations of rank 0: each row's numbers (``loss``, ``val_loss``,
    ``grad_norm``, ``lr``, ``tokens_per_s``, ``step_time_s``, ``loss_scale``, and the
    largest ``peak_memory_bytes`` as ``peak_memory_bytes_max``) as scalars at the row's
    step. Built before the first step; ``close`` flushes them.

    Raises:
        ValueError: a package of ``names`` is not installed.
    """

    def __init__(self, names: tuple[str, ...], out: Path, config: dict[str, Any], run_name: str) -> None:
        self._tensorboard: Any = None
        self._wandb: Any = None
        for name in names:
            missing = missing_logger_package(name)
            if missing is not None:
                raise ValueError(f"--log {name} needs the {missing} package, which is not installed: pip install "
                                 f"{missing} (or pip install -e '.[logging]'), or drop --log {name}")
        if "tensorboard" in names:
            from tensorboard.summary import Writer

            self._tensorboard = Writer(str(out / TENSORBOARD_DIR))
        if "wandb" in names:
            import wandb

            # offline: no account, no network; the run is a folder that `wandb sync` uploads
            self._wandb = wandb.init(mode="offline", dir=str(out), project="hyper-parallel", name=run_name,
                                     config=config, reinit=True)

    @staticmethod
    def scalars(row: dict[str, Any]) -> dict[str, float]:
        """The numbers of a metrics row, as ``{tag: value}``."""
        values = {key: float(value) for key, value in row.items()
                  if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if row.get("peak_memory_bytes"):
            values["peak_memory_bytes_max"] = float(max(row["peak_memory_bytes"]))
        return values

    def write(self, row: dict[str, Any]) -> None:
        values = self.scalars(row)
        if self._tensorboard is not None:
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, step=row["step"])
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=row["step"])

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (``[]`` if there is none)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """Appends rows to ``<out>/metrics.jsonl``. On resume from ``start_step`` the rows after
    it (from the interrupted run) are dropped first, so the file reads as one run."""

    def __init__(self, out: Path, start_step: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / METRICS_FILE
        kept = [row for row in read_metrics(self.path) if row["step"] <= start_step] if start_step else []
        self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self._file = self.path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Progress:
    """A tqdm bar over the steps showing the loss and tokens/s (no bar when disabled)."""

    def __init__(self, total: int, start: int, enabled: bool, description: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc=description, unit="step", dynamic_ncols=True)

    def update(self, row: dict[str, Any]) -> None:
        if self._bar is None:
            return
        postfix = {"loss": f"{row['loss']:.3f}", "gnorm": f"{row['grad_norm']:.2f}",
                   "tok/s": f"{row['tokens_per_s']:.0f}"}
        if "val_loss" in row:
            postfix["val"] = f"{row['val_loss']:.3f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def plot_losses(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """The train and validation loss against the step, as a PNG (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", linewidth=1.2)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
