"""Contract section: module hooks, module tree walk, parameter replacement.

Hook signatures follow torch (MindSpore Cells use the same ones):
``pre_hook(module, args) -> args | None`` (with ``with_kwargs=True``:
``pre_hook(module, args, kwargs) -> (args, kwargs) | None``); ``hook(module, args, output) -> output | None``;
``backward_pre_hook(module, grad_output) -> grad_output | None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from hyper_parallel.platform.contract.common import RemovableHandle


class ModulesSection(ABC):
    """Hooks on modules and tensors; walking and editing a module tree."""

    @abstractmethod
    def register_forward_pre_hook(self, module: Any, hook: Callable[..., Any], *,
                                  with_kwargs: bool = False) -> RemovableHandle:
        """Call ``hook(module, args)`` before ``module``'s forward; a non-None return
        replaces ``args`` (a tuple).

        With ``with_kwargs=True`` the hook is ``hook(module, args, kwargs)``: ``args`` the
        positional arguments (tuple), ``kwargs`` the keyword arguments (dict) of the call;
        it returns ``None`` (both unchanged) or a pair ``(args, kwargs)`` that replaces
        both (torch ``Module.register_forward_pre_hook(..., with_kwargs=True)``, MindSpore
        ``Cell.register_forward_pre_hook(..., with_kwargs=True)``). Hooks run in
        registration order, each seeing the previous one's result."""

    @abstractmethod
    def register_forward_hook(self, module: Any, hook: Callable[..., Any], *,
                              replace_forward: bool = False) -> RemovableHandle:
        """Call ``hook(module, args, output)`` after the forward; a non-None return replaces ``output``.

        With ``replace_forward=True``, ``hook(module, args, forward)`` runs *instead of*
        the module's forward (torch ``forward``, MindSpore ``construct``) and its return
        is the module's output; ``forward(*args)`` runs the forward it replaced (keyword
        arguments of the call are bound into it). The module's pre- and post-forward
        hooks still run around it. Only this module instance changes; ``remove()``
        restores the replaced forward (several replacements of one module are removed
        in reverse order, else ``RuntimeError``). The pipeline's weight-gradient split
        routes linear layers through a custom autograd function this way.
        """

    @abstractmethod
    def register_full_backward_pre_hook(self, module: Any, hook: Callable[..., Any]) -> RemovableHandle:
        """Call ``hook(module, grad_output)`` (a tuple) before the module's backward;
        a non-None return replaces ``grad_output``."""

    @abstractmethod
    def register_tensor_hook(self, tensor: Any, hook: Callable[[Any], Any]) -> RemovableHandle:
        """Call ``hook(grad)`` when the gradient of ``tensor`` is computed; a non-None
        return replaces the gradient."""

    @abstractmethod
    def named_modules(self, module: Any, *, linear_only: bool = False) -> Iterator[tuple[str, Any]]:
        """``(fqn, submodule)`` pairs, the root first as ``""``, then depth-first.

        With ``linear_only=True``, only the framework's dense linear layers, whose
        forward is ``y = x @ weight^T + bias`` on ``x [..., in]`` with parameters
        ``weight [out, in]`` and ``bias [out]`` (or no bias): torch ``nn.Linear`` and
        subclasses that keep its forward; MindSpore ``mint.nn.Linear`` and ``nn.Dense``
        without activation, likewise. A subclass with its own forward is not listed.
        """

    @abstractmethod
    def named_parameters(self, module: Any) -> Iterator[tuple[str, Any]]:
        """``(fqn, parameter)`` pairs (``"layers.0.weight"``), each parameter once."""

    @abstractmethod
    def make_parameter(self, tensor: Any, requires_grad: bool = True) -> Any:
        """A new framework parameter holding ``tensor``'s data."""

    @abstractmethod
    def set_parameter(self, module: Any, fqn: str, param: Any) -> None:
        """Replace the parameter at dotted path ``fqn`` under ``module`` with ``param``.

        Raises:
            KeyError: no parameter at ``fqn``; the message lists the nearest names.
        """
