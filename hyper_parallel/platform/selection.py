"""Backend selection, the one rule: ``get_platform()``, ``init(platform=...)`` and the
name a launcher starts its ranks with (``requested_platform``).

Resolution order (first match wins), done once per process and cached:

1. an explicit ``hyper_parallel.init(platform=NAME)``;
2. the environment variable ``HYPER_PARALLEL_PLATFORM``;
3. the framework this process has already imported, if exactly one is;
4. the only installed framework;
5. both installed, neither imported: MindSpore (Ascend first), logged once.

``NAME`` is a framework (``"torch"``, ``"mindspore"``: the device comes from the
framework) or a full backend name, one of the folders of the repository's
``platform/`` directory. A request that cannot be met raises ``RuntimeError`` listing
what is installed; there is no silent fallback.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading

from hyper_parallel.platform.base import BACKENDS, Platform

__all__ = ["ENV_VAR", "FRAMEWORKS", "backend_problem", "framework_of", "get_platform", "init", "installed_frameworks",
           "requested_platform", "reset_platform"]

ENV_VAR = "HYPER_PARALLEL_PLATFORM"

#: the frameworks, by the name ``--platform`` and ``init`` take without a device
FRAMEWORKS = ("torch", "mindspore")

_log = logging.getLogger(__name__)


class _Selected:
    """The resolved platform of this process (one per process, guarded by a lock)."""

    lock = threading.Lock()
    platform: Platform | None = None


def installed_frameworks() -> list[str]:
    """The frameworks importable in this environment, in ``("torch", "mindspore")`` order."""
    return [name for name in FRAMEWORKS if importlib.util.find_spec(name) is not None]


def _parse(name: str) -> tuple[str, str | None]:
    """``(framework, device or None)`` of a platform name.

    Raises:
        ValueError: the name is not a framework or a backend.
    """
    name = name.strip().lower()
    if name in FRAMEWORKS:
        return name, None
    if name in BACKENDS:
        return BACKENDS[name]
    choices = ", ".join(list(FRAMEWORKS) + list(BACKENDS))
    raise ValueError(f"platform={name!r} is not a backend; use one of {choices}")


def framework_of(name: str) -> str:
    """``"torch"`` or ``"mindspore"`` for a backend name (or a bare framework name).

    Raises:
        ValueError: the name is not a backend.
    """
    return _parse(name)[0]


def requested_platform() -> str:
    """The platform name this process would select, without importing a framework:
    ``$HYPER_PARALLEL_PLATFORM``, else steps 3-5 of the resolution order (a framework name).
    What ``hyper-parallel train`` and the test harness start their ranks with when no
    platform is given.

    Raises:
        RuntimeError: no framework is installed.
    """
    return os.environ.get(ENV_VAR, "").strip() or _default_framework()


def _default_framework() -> str:
    installed = installed_frameworks()
    imported = [name for name in FRAMEWORKS if name in sys.modules]
    if len(imported) == 1:
        return imported[0]
    if len(installed) == 1:
        return installed[0]
    if not installed:
        raise RuntimeError(
            "hyper_parallel found no framework: install torch (pip install 'hyper_parallel[torch]') "
            "or MindSpore (pip install 'hyper_parallel[mindspore]')"
        )
    _log.info("hyper_parallel: torch and MindSpore are both installed and neither is imported; using MindSpore "
              "(set %s=torch to choose torch)", ENV_VAR)
    return "mindspore"


def _construct(framework: str, device: str | None) -> Platform:
    if importlib.util.find_spec(framework) is None:
        raise RuntimeError(
            f"platform {framework!r} was requested but {framework} is not installed; "
            f"installed frameworks: {installed_frameworks() or 'none'}"
        )
    if framework == "torch":
        from hyper_parallel.platform.torch import TorchPlatform

        return TorchPlatform(device)
    from hyper_parallel.platform.mindspore import MindSporePlatform

    return MindSporePlatform(device)


def init(platform: str | None = None) -> Platform:
    """Select the backend explicitly (step 1 of the resolution order) and return it.

    Args:
        platform: ``"torch"``, ``"mindspore"`` or a full backend name such as
            ``"torch-cuda"``; ``None`` resolves as ``get_platform()`` does.

    Raises:
        ValueError: unknown name.
        RuntimeError: the framework or device is unavailable, or another backend was
            already selected in this process.
    """
    with _Selected.lock:
        if platform is None:
            requested = os.environ.get(ENV_VAR)
            framework, device = _parse(requested) if requested else (_default_framework(), None)
        else:
            framework, device = _parse(platform)
        current = _Selected.platform
        if current is not None:
            if current.framework == framework and device in (None, current.device_type):
                return current
            raise RuntimeError(
                f"hyper_parallel already uses {current.name} in this process; "
                f"init(platform={platform!r}) must come before the first get_platform()"
            )
        _Selected.platform = _construct(framework, device)
        return _Selected.platform


def get_platform() -> Platform:
    """The platform of this process, resolved on first use (see the module doc)."""
    selected = _Selected.platform
    return selected if selected is not None else init()


def reset_platform() -> None:
    """Forget the selected platform (tests that exercise selection use this)."""
    with _Selected.lock:
        _Selected.platform = None


def backend_problem(name: str) -> str | None:
    """Why the backend ``name`` (``torch``, ``mindspore`` or a ``BACKENDS`` name) cannot run
    on this machine, or ``None`` if it can: what a launcher checks before it starts ranks.

    CPU backends are checked by finding the framework (no import); an accelerator backend
    is constructed once, in this process, without being selected, so the rule is the
    backend's own (its constructor raises ``RuntimeError`` for a device it cannot use).
    That imports the framework here (seconds).
    """
    try:
        framework, device = _parse(name)
    except ValueError:
        return f"it is not a backend; use one of {', '.join(FRAMEWORKS + tuple(BACKENDS))}"
    if importlib.util.find_spec(framework) is None:
        return f"{framework} is not installed here (installed: {', '.join(installed_frameworks()) or 'none'})"
    if device in (None, "cpu"):
        return None
    if (framework, device) == ("torch", "npu") and importlib.util.find_spec("torch_npu") is None:
        # checked first: without it the constructor's message cannot say which part is missing
        return "torch_npu is not installed here (it needs Ascend CANN)"
    try:
        _construct(framework, device)
    except (RuntimeError, ImportError, OSError) as err:  # torch_npu without CANN fails to import
        return f"{type(err).__name__}: {err}"
    return None
