"""Contract section: module hooks, module tree walk, parameter replacement.

Hook signatures follow torch (MindSpore Cells use the same ones):
``pre_hook(module, args) -> args | None`` (with ``with_kwargs=True``:
``pre_hook(module, args, kwargs) -> (args, kwargs) | None``); ``hook(module, args, output) -> output | None``;
``backward_pre_hook(module, grad_output) -> grad_output | None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from hyper_parallel.platform.contract.common import RemovableHandle


@dataclass(frozen=True)
class ModuleTypes:
    """The framework's module classes, enough to define a model once for every backend
    (``Platform.module_types``; the job's decoder in ``train/model.py`` is written so).

    Attributes:
        Module: the base class of a model's modules. A subclass defines ``__init__``
            (calling ``super().__init__()`` first, then assigning submodules, parameters
            made by ``make_parameter`` and plain tensors as attributes) and
            ``forward(*args, **kwargs)``, which calling the module runs with the hooks of
            this section around it. torch: ``torch.nn.Module``; MindSpore: a
            ``mindspore.nn.Cell`` whose ``construct`` calls ``forward``. A tensor attribute
            that is not a parameter is a constant: not a parameter, not in checkpoints.
        Linear: the dense linear layer ``Linear(in_features, out_features, bias=False)``,
            parameters ``weight [out, in]`` (and ``bias [out]``), the layer
            ``named_modules(linear_only=True)`` lists and tensor parallelism shards
            (torch ``nn.Linear``, MindSpore ``mint.nn.Linear``).
        ModuleList: ``ModuleList(modules)``: indexed by int, iterable; children named
            ``"0"``, ``"1"``, ... (torch ``nn.ModuleList``, MindSpore ``nn.CellList``).
        ModuleDict: ``ModuleDict({name: module})``: indexed by name, ``keys()``,
            ``values()``, ``items()`` in insertion order (torch ``nn.ModuleDict``,
            MindSpore ``nn.CellDict``).
        meta_device: ``meta_device()`` is a context manager inside which the framework's
            module constructors make parameters with a shape and dtype and no storage (a
            model too large for one rank is built there, parallelized, then given each
            rank's pieces: ``fully_shard.materialize``). torch ``torch.device("meta")``,
            MindSpore ``mindspore.DeviceCtx("meta")``. The platform's own factories
            (``zeros``, ``full``, ...) may still allocate inside it (torch's name their
            device): what they make is small (norms, tables) and replaced by the pieces.
    """

    Module: type
    Linear: type
    ModuleList: type
    ModuleDict: type
    meta_device: Callable[[], AbstractContextManager[Any]]


class ModulesSection(ABC):
    """Hooks on modules and tensors; walking and editing a module tree."""

    @abstractmethod
    def module_types(self) -> ModuleTypes:
        """The framework's module classes (``ModuleTypes``): the same classes on every
        call, so ``isinstance`` against them holds across calls."""

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
    def compile_module(self, module: Any) -> RemovableHandle:
        """Run ``module``'s own forward compiled by the framework's compiler from now on:
        same inputs, outputs and gradients (up to the compiler's float reordering), with the
        module's parameters (and the tensors its hooks put in their place) as the compiled
        code's inputs. Only this module instance changes (its forward becomes an instance
        attribute, as ``register_forward_hook(replace_forward=True)``); its own pre- and
        post-forward hooks still run eagerly around the compiled forward, and
        ``remove()`` restores the eager forward. Compiles at the first call (seconds to
        minutes), again when the input shapes, dtypes or grad mode change.

        torch: ``torch.compile`` of the forward, backend ``inductor`` (on CPU where a C++
        compiler is found, else ``aot_eager`` with a warning that names the missing
        compiler). Every hook registered through this section is excluded from tracing, so
        the hooks of the module's submodules (tensor parallelism's, context parallelism's)
        run eagerly between compiled pieces, their collectives included
        (``Capability.COMPILE_AROUND_HOOKS``). MindSpore: ``mindspore.jit`` of the Cell's
        ``construct`` (``capture_mode="bytecode"``), which traces submodules' hooks and
        the Python functions the forward calls: compile only modules of framework
        operations whose submodules carry no hooks (no capability reported).

        Raises:
            TypeError: ``module`` is not the framework's module type.
        """

    @abstractmethod
    def register_full_backward_pre_hook(self, module: Any, hook: Callable[..., Any]) -> RemovableHandle:
        """Call ``hook(module, grad_output)`` (a tuple) before the module's backward;
        a non-None return replaces ``grad_output``."""

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
