"""The contract itself: an ABC whose every member is abstract, typed and documented, and
backend selection. Runs in the pytest process (no ranks) and in fresh interpreters."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

from hyper_parallel.platform import BACKENDS, installed_frameworks
from hyper_parallel.platform.base import Platform, contract_members, derived_members

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_member_is_abstract_typed_and_documented() -> None:
    members = contract_members()
    derived = derived_members()
    # Every member counts, abstract and derived (issue 34: 67 + 8 = 75 with a string-keyed
    # ``local_op`` table; 61 + 8 = 69 after it and the members core never called went;
    # 70 with ``module_types``, the job's decoder defined once; still 70 with ``adamw``, the
    # framework's optimizer, and ``mesh_device_types`` a function of BACKENDS; 65 with ``stack``,
    # ``clone``, ``dtype_name`` in core/tensor_ops and ``split_group``, ``barrier`` in
    # core/process_groups, each composed from the members once; 66 with ``grouped_matmul``, the
    # experts' grouped GEMM kernel (issue 36), which no composition of members reaches; 67 with
    # ``compile_module`` (issue 38: the framework's compiler, torch.compile or mindspore.jit,
    # which no member composes). Compose existing members or extend one with a keyword
    # argument rather than raising the bound.
    total = len(members) + len(derived)
    assert total <= 67, f"the contract has {len(members)} abstract + {len(derived)} derived = {total} members"
    assert not set(members) & set(derived)
    for name in derived:
        assert inspect.getdoc(getattr(Platform, name)), f"derived member {name} has no docstring"
    assert set(members) == set(Platform.__abstractmethods__)
    for name in members:
        attr = inspect.getattr_static(Platform, name)
        func = attr.fget if isinstance(attr, property) else attr
        assert getattr(func, "__isabstractmethod__", False), f"{name} is not abstract"
        assert inspect.getdoc(func) and len(inspect.getdoc(func)) > 20, f"{name} has no docstring"
        hints = inspect.signature(func)
        assert hints.return_annotation is not inspect.Signature.empty, f"{name} lacks a return annotation"
        for pname, param in hints.parameters.items():
            if pname != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                assert param.annotation is not inspect.Parameter.empty, f"{name}({pname}) lacks a type hint"


def _backend_class():
    framework = installed_frameworks()[0]
    if framework == "torch":
        from hyper_parallel.platform.torch import TorchPlatform

        return TorchPlatform
    from hyper_parallel.platform.mindspore import MindSporePlatform

    return MindSporePlatform


def test_backend_missing_one_member_cannot_be_constructed() -> None:
    backend = _backend_class()
    for member in ("all_to_all_single", "attention", "vjp", "name"):
        # Re-declaring the member with the contract's abstract definition is what a
        # backend that forgot to implement it looks like to ABCMeta.
        broken = type("Broken", (backend,), {member: getattr(Platform, member)})
        with pytest.raises(TypeError, match=member):
            broken()


def test_real_backends_construct() -> None:
    # A plain construction must not raise: every member is implemented.
    assert _backend_class()("cpu").name.endswith("-cpu")


def _select(code: str, env: dict[str, str] | None = None) -> str:
    full_env = {k: v for k, v in os.environ.items() if k != "HYPER_PARALLEL_PLATFORM"}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_selection_order(framework: str) -> None:
    if framework not in installed_frameworks():
        pytest.skip(f"{framework} is not installed")
    other = "mindspore" if framework == "torch" else "torch"
    # 1. explicit init beats the environment
    assert _select(f"import hyper_parallel as hp; print(hp.init('{framework}-cpu').name)",
                   {"HYPER_PARALLEL_PLATFORM": f"{other}-cpu"}) == f"{framework}-cpu"
    # 2. the environment variable
    assert _select("import hyper_parallel as hp; print(hp.get_platform().name)",
                   {"HYPER_PARALLEL_PLATFORM": framework}) == f"{framework}-cpu"
    # 3. the one framework already imported
    assert _select(f"import {framework}, hyper_parallel as hp; print(hp.get_platform().framework)") == framework


def test_default_with_both_installed_is_mindspore() -> None:
    if len(installed_frameworks()) < 2:
        pytest.skip("needs both torch and MindSpore installed")
    assert _select("import hyper_parallel as hp; print(hp.get_platform().framework)") == "mindspore"


def test_bad_requests_raise_clear_errors() -> None:
    out = _select("""
        import hyper_parallel as hp
        try:
            hp.init('tensorflow')
        except ValueError as err:
            print(err)
    """)
    assert "platform='tensorflow'" in out and "torch-cpu" in out and "mindspore-ascend" in out
    if "torch" in installed_frameworks():
        out = _select("""
            import hyper_parallel as hp
            try:
                hp.init('torch-cuda')
            except RuntimeError as err:
                print(err)
        """)
        assert "torch-cuda" in out and "cuda.is_available()" in out
        out = _select("""
            import hyper_parallel as hp
            hp.init('torch-cpu')
            try:
                hp.init('mindspore-cpu')
            except RuntimeError as err:
                print(err)
        """)
        assert "already uses torch-cpu" in out


def test_backend_table_matches_platform_folders() -> None:
    folders = sorted(d for d in os.listdir(os.path.join(REPO, "platform")) if not d.startswith("."))
    assert set(BACKENDS) <= set(folders), sorted(set(BACKENDS) - set(folders))
    for extra in set(folders) - set(BACKENDS):
        # a matrix entry that is not a backend (mindformers-cpu) runs on one: its env names it
        with open(os.path.join(REPO, "platform", extra, "env")) as env:
            named = [line.split("=", 1)[1].strip() for line in env if line.startswith("HYPER_PARALLEL_PLATFORM=")]
        assert named and named[0] in BACKENDS, f"platform/{extra}/env names no backend of {sorted(BACKENDS)}"
    for folder in folders:
        for required in ("requirements.txt", "env", "README.md"):
            assert os.path.isfile(os.path.join(REPO, "platform", folder, required)), f"platform/{folder}/{required}"
        assert not os.path.exists(os.path.join(REPO, "platform", folder, "__init__.py"))
    assert not os.path.exists(os.path.join(REPO, "platform", "__init__.py"))
