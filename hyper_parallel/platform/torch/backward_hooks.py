"""The torch backend's module backward pre-hook, on the gradients of the module's outputs.

[Note: backward pre-hooks on output tensors]
torch's ``Module.register_full_backward_pre_hook`` wraps the module's inputs and outputs
in ``BackwardHook`` nodes. That machinery warns on every call of a module whose output is
not a tensor or a tuple of tensors (a Hugging Face model's ``CausalLMOutputWithPast``, a
dict, a dataclass: the hook then never fires) and once for a module none of whose inputs
require gradients (a model whose input is token ids). FSDP2 hooks the output tensors
instead, and so does this backend: a forward hook finds the tensors in the output
(tensors, lists, tuples, dicts and dataclasses, nested) that require gradients and
registers on them

- one output tensor: a tensor hook, which calls ``hook(module, (grad,))`` when the
  tensor's gradient is computed, before the module's backward, and returns what the hook
  returns in its place (``grad_output`` replacement, as the platform contract says);
- several: ``torch.autograd.graph.register_multi_grad_hook(mode="any")``, which calls
  ``hook(module, (grad,))`` once, with the first output gradient computed; a hook that
  then returns a replacement raises (``RuntimeError``: it has one gradient of several).

A module called several times in a forward gets its hook once per call, as with torch's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hyper_parallel.platform.base import RemovableHandle


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in ``output`` that require gradients, in order (through lists, tuples,
    dicts, ``Mapping`` types such as Hugging Face's ``ModelOutput``, and dataclasses)."""
    found: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                found.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name))

    walk(output)
    return found


def register_output_grad_pre_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> RemovableHandle:
    """``hook(module, grad_output)`` before ``module``'s backward, on its output tensors
    (see [Note: backward pre-hooks on output tensors]). Removing the handle stops the hook
    from being attached to later forwards.

    Raises (in the backward):
        RuntimeError: ``hook`` returns a replacement gradient for a module with several
            output tensors (it was given only the first one's gradient).
    """

    def attach(mod: torch.nn.Module, _args: Any, output: Any) -> None:
        tensors = output_tensors(output)
        if len(tensors) == 1:
            def one(grad: torch.Tensor) -> torch.Tensor | None:
                replaced = hook(mod, (grad,))
                return None if replaced is None else replaced[0]

            tensors[0].register_hook(one)
        elif tensors:
            def first(grad: torch.Tensor) -> None:
                if hook(mod, (grad,)) is not None:
                    raise RuntimeError(f"a backward pre-hook of {type(mod).__name__}, whose output has "
                                       f"{len(tensors)} tensors, returned a replacement gradient; only a module "
                                       "with one output tensor can have its output gradient replaced")

            torch.autograd.graph.register_multi_grad_hook(tensors, first, mode="any")

    return module.register_forward_hook(attach)
