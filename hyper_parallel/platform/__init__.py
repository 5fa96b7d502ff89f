"""Backend selection: ``get_platform()`` and ``init(platform=...)``.

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

from hyper_parallel.platform.base import BACKENDS, FULL, AttentionMask, Capability, P2POp, Platform, ReduceOp, Work

__all__ = ["BACKENDS", "FULL", "AttentionMask", "Capability", "P2POp", "Platform", "ReduceOp", "Work", "get_platform", "init",
           "installed_frameworks", "reset_platform"]

ENV_VAR = "HYPER_PARALLEL_PLATFORM"

_FRAMEWORKS = ("torch", "mindspore")

_log = logging.getLogger(__name__)


class _Selected:
    """The resolved platform of this process (one per process, guarded by a lock)."""

    lock = threading.Lock()
    platform: Platform | None = None


def installed_frameworks() -> list[str]:
    """The frameworks importable in this environment, in ``("torch", "mindspore")`` order."""
    return [name for name in _FRAMEWORKS if importlib.util.find_spec(name) is not None]


def _parse(name: str) -> tuple[str, str | None]:
    name = name.strip().lower()
    if name in _FRAMEWORKS:
        return name, None
    if name in BACKENDS:
        return BACKENDS[name]
    choices = ", ".join(list(_FRAMEWORKS) + list(BACKENDS))
    raise ValueError(f"platform={name!r} is not a backend; use one of {choices}")


def _default_framework() -> str:
    installed = installed_frameworks()
    imported = [name for name in _FRAMEWORKS if name in sys.modules]
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
