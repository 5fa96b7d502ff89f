"""The import-linter contract holds on this tree, and it does fail when core imports a
framework (checked on a copy with one offending module, so the check cannot pass vacuously)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")
def test_core_is_framework_free(tmp_path: Path) -> None:
    done = _lint(REPO)
    assert done.returncode == 0, done.stdout + done.stderr

    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(REPO / "pyproject.toml", copy)
    shutil.copytree(REPO / "hyper_parallel", copy / "hyper_parallel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "hyper_parallel" / "core" / "_offender.py").write_text("import torch\n")
    done = _lint(copy)
    assert done.returncode != 0 and "hyper_parallel.core._offender -> torch" in done.stdout, done.stdout
