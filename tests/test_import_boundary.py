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


def test_core_reaches_the_platform_only_through_the_contract() -> None:
    """issue 34 item 3: every helper module of ``hyper_parallel.platform`` (a module
    beside ``base`` and ``selection``, outside ``contract/`` and the backends) is on the
    forbidden list of core's contract, so a helper added later cannot be imported by core
    unnoticed: it goes into ``contract/`` (part of the contract) or into core."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["name"].startswith("core imports from the platform only the contract"))
    helpers = {f"hyper_parallel.platform.{path.stem}" for path in (REPO / "hyper_parallel" / "platform").glob("*.py")
               if path.stem not in ("__init__", "base", "selection")}
    assert helpers == set(contract["forbidden_modules"]), (
        f"platform helper modules not forbidden to core: {sorted(helpers - set(contract['forbidden_modules']))}; "
        f"listed but gone: {sorted(set(contract['forbidden_modules']) - helpers)}")
