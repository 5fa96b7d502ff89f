"""``compile_module`` on torch: ``torch.compile`` of one module's forward, with the hooks
registered through the platform left out of the traced code.

[Note: hooks stay eager under torch.compile]
torch.compile traces a module's ``__call__`` of every submodule the compiled forward calls,
its forward hooks included. The hooks of this library are not traceable code: the
tensor-parallel styles put local tensors into a module's ``__dict__`` and build DTensors
(``_make_wrapper_subclass``, which dynamo cannot trace), fully_shard all-gathers into
buffers, context parallelism exchanges K/V. Traced with graph breaks they still ran, but
with wrong gradients (seen: the tp 2 job's gradient norm 1.945 against PyNative's
2.081 with ``backend="aot_eager"``). So the platform registers every forward hook
wrapped in ``torch.compiler.disable``: dynamo breaks the graph at each hook and runs it
eagerly, and the compiled pieces between hooks see local tensors only (tp 2: the same
gradient norm as eager, to the last digit). ``EagerHooks`` does it without importing
dynamo in runs that never compile. Saved-tensor hooks (fully_shard's
``release_saved_tensors``) are wrapped alike once a module is compiled: they run when a
compiled graph saves its inputs for backward, which must not be traced either.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hyper_parallel.platform.contract.common import RemovableHandle
from hyper_parallel.platform.forward_replacement import InstanceForward


class _Hook:
    """A hook as registered: calls ``run``, the hook itself until ``EagerHooks`` swaps in
    the hook excluded from tracing."""

    __slots__ = ("__weakref__", "hook", "run")

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook: Callable[..., Any] = hook
        self.run: Callable[..., Any] = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class EagerHooks:
    """The forward hooks one ``TorchPlatform`` registered, per module, so that
    ``compile_module`` can exclude those of the compiled module's subtree from tracing
    ([Note: hooks stay eager under torch.compile]). ``torch.compiler.disable`` imports
    ``torch._dynamo`` (seconds), which a run that never compiles must not pay: until the
    first ``compile_module`` a hook is registered as a ``_Hook`` that calls it directly,
    and ``exclude`` swaps in the disabled hook; after it, hooks are disabled at once."""

    def __init__(self) -> None:
        # module -> its registered hooks, held weakly: a removed hook (torch drops it) leaves
        # the set, so hooks registered and removed every step do not pile up
        self._pending: weakref.WeakKeyDictionary[Any, weakref.WeakSet[_Hook]] = weakref.WeakKeyDictionary()
        self.compiling = False  # a compile_module has run in this process

    def wrap(self, module: Any, hook: Callable[..., Any]) -> Callable[..., Any]:
        """What to register for ``hook`` on ``module``."""
        if self.compiling:
            return _disabled(hook)
        wrapper = _Hook(hook)
        self._pending.setdefault(module, weakref.WeakSet()).add(wrapper)
        return wrapper

    def exclude(self, root: Any) -> None:
        """Every hook registered on ``root`` and its submodules runs eagerly from now on,
        and so does every hook registered later."""
        self.compiling = True
        for module in root.modules():
            for wrapper in list(self._pending.pop(module, ())):
                wrapper.run = _disabled(wrapper.hook)


def _disabled(hook: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compiler.disable(hook, recursive=True)


def eager_if_compiling(hooks: EagerHooks, hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (a saved-tensor hook, made for one forward) excluded from tracing once a
    ``compile_module`` has run in the process, else ``hook`` itself."""
    return _disabled(hook) if hooks.compiling else hook


@functools.cache
def compile_backend(device_type: str) -> str:
    """torch.compile's backend for ``device_type``: ``inductor`` (generated kernels), except on
    CPU without a C++ compiler (inductor builds its CPU kernels with ``$CXX``, else
    ``g++``), where it is ``aot_eager`` (the same traced graphs and autograd, run by
    eager kernels) and a warning names the missing compiler, once per process."""
    if device_type != "cpu":
        return "inductor"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        warnings.warn(f"compile_module: no C++ compiler ({cxx!r}, from $CXX or the default g++) on PATH, which "
                      "torch.compile's inductor backend needs for CPU kernels; compiling with backend "
                      "'aot_eager' instead (traced graphs, eager kernels: little speed-up). Install g++ or set $CXX",
                      RuntimeWarning, stacklevel=3)
        return "aot_eager"
    return "inductor"


def compile_module(module: Any, device_type: str, hooks: EagerHooks) -> RemovableHandle:
    """``module.forward`` as ``torch.compile(forward)`` (an instance attribute; ``remove``
    restores it), the hooks of its subtree excluded from tracing (``hooks.exclude``). See
    ``Platform.compile_module``.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"compile_module: module is {type(module).__name__}, not a torch.nn.Module")
    hooks.exclude(module)
    backend = compile_backend(device_type)
    return InstanceForward(module, "forward", lambda forward: torch.compile(forward, backend=backend))
