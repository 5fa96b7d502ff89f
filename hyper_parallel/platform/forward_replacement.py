"""Replacing one module's forward by a hook that may call it (``register_forward_hook``
with ``replace_forward=True``) or by its compiled form (``compile_module``), shared by the backends: they differ only in the name
of the method the module's ``__call__`` runs (torch ``forward``, MindSpore ``construct``).

The replacement is an attribute of the module instance, so the class (and every other
instance) is untouched, the module's pre- and post-forward hooks still run around it,
and removing the handle restores what was there before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class InstanceForward:
    """Handle of a module instance whose forward is ``make(forward)``: ``module.<attribute>``
    becomes what ``make`` returns for the forward in place (the class's, or an earlier
    replacement's); ``remove`` restores it. ``Platform.compile_module`` passes the
    framework's compiler as ``make``."""

    def __init__(self, module: Any, attribute: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self._module = module
        self._attribute = attribute
        # an instance attribute already there (an earlier replacement) comes back on remove
        self._previous = vars(module).get(attribute)
        self._forward = make(getattr(module, attribute))
        setattr(module, attribute, self._forward)

    def remove(self) -> None:
        """Restore the forward this replacement replaced.

        Raises:
            RuntimeError: a later replacement of the same module is still in place
                (remove replacements in the reverse order of registering them).
        """
        current = vars(self._module).get(self._attribute)
        if current is None:
            return  # already removed
        if current is not self._forward:
            raise RuntimeError(f"register_forward_hook(replace_forward=True) / compile_module: a later replacement "
                               f"of {type(self._module).__name__}.{self._attribute} is still registered; remove "
                               "replacements in the reverse order of registering them")
        if self._previous is None:
            delattr(self._module, self._attribute)
        else:
            setattr(self._module, self._attribute, self._previous)


class ForwardReplacement(InstanceForward):
    """Handle of a replaced forward: ``module.<attribute>`` is a function calling
    ``hook(module, args, forward)``, where ``forward(*args)`` runs the forward that was
    in place (keyword arguments of the call are bound into it)."""

    def __init__(self, module: Any, attribute: str, hook: Callable[..., Any]) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                return hook(module, args, functools.partial(original, **kwargs) if kwargs else original)

            return forward

        super().__init__(module, attribute, make)
