#!/usr/bin/env python3
"""Run the test suite once per backend and compare the backends.

For each backend (default: those whose framework is installed and whose device exists
here), load ``platform/<backend>/env``, run pytest with ``HYPER_PARALLEL_PLATFORM`` set,
and record every test's outcome from a JUnit report. Then print a per-backend summary
and check conformance parity: a test of ``tests/platform_contract`` that passes on one
backend must pass on every other, or be skipped there with a reason.

Exit status: non-zero if the import-boundary check, any pytest run, or parity fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_BACKENDS = {"torch-cpu": "torch", "mindspore-cpu": "mindspore"}


def usable_backends() -> list[str]:
    """The CPU backends whose framework is installed (accelerator backends are opt-in)."""
    return [name for name, framework in CPU_BACKENDS.items() if importlib.util.find_spec(framework)]


def backend_env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    env["HYPER_PARALLEL_PLATFORM"] = name  # unless the entry names its backend (mindformers-cpu: mindspore-cpu)
    env_file = REPO / "platform" / name / "env"
    for line in env_file.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, skip reason) from a JUnit XML file."""
    result: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome, reason = "skipped", child.get("message", "")
        result[test_id] = (outcome, reason)
    return result


def run_backend(name: str, pytest_args: list[str], out_dir: Path) -> tuple[int, dict[str, tuple[str, str]], float]:
    junit = out_dir / f"junit-{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}", *pytest_args]
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    code = subprocess.call(cmd, cwd=REPO, env=backend_env(name))
    elapsed = time.monotonic() - start
    return code, (outcomes(junit) if junit.exists() else {}), elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=None, help="backend names (folders of platform/)")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "matrix", help="where JUnit reports go")
    parser.add_argument("pytest_args", nargs="*", default=["tests"], help="passed to pytest (default: tests)")
    args = parser.parse_args()
    backends = args.backends or usable_backends()
    if not backends:
        print("no backend is usable here: install torch or mindspore", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)

    print("=== import boundary: lint-imports", flush=True)
    # The console script of the interpreter running this file (the CI venv's), so the
    # check cannot silently resolve to another installation or to nothing.
    lint_imports = Path(sys.executable).parent / "lint-imports"
    lint = subprocess.call([str(lint_imports), "--config", str(REPO / "pyproject.toml")], cwd=REPO)

    results = {name: run_backend(name, args.pytest_args, args.out) for name in backends}

    print("\n=== matrix summary")
    print(f"{'backend':<18}{'passed':>8}{'failed':>8}{'skipped':>9}{'seconds':>9}  exit")
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for name, (code, tests, elapsed) in results.items():
        counts = {k: sum(1 for o, _ in tests.values() if o == k) for k in totals}
        for key in totals:
            totals[key] += counts[key]
        print(f"{name:<18}{counts['passed']:>8}{counts['failed']:>8}{counts['skipped']:>9}{elapsed:>9.0f}  {code}")

    parity_problems = []
    contract = "tests.platform_contract"
    all_ids = sorted({tid for _, tests, _ in results.values() for tid in tests if tid.startswith(contract)})
    for tid in all_ids:
        seen = {name: tests.get(tid, ("missing", ""))[0] for name, (_, tests, _) in results.items()}
        if "passed" in seen.values() and any(o in ("failed", "missing") for o in seen.values()):
            parity_problems.append(f"  {tid}: {seen}")
    skipped = [(name, tid, reason) for name, (_, tests, _) in results.items()
               for tid, (o, reason) in tests.items() if o == "skipped" and tid.startswith(contract)]
    print(f"import boundary (lint-imports): {'kept' if lint == 0 else 'BROKEN'}")
    print(f"conformance: {len(all_ids)} test ids; parity problems: {len(parity_problems)}")
    for line in parity_problems:
        print(line)
    for name, tid, reason in skipped:
        print(f"  skipped on {name}: {tid} ({reason})")

    failed = lint != 0 or parity_problems or any(code != 0 for code, _, _ in results.values())
    print(f"matrix: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
