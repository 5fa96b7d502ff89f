"""``DFunction``: a custom autograd function, written once for torch and MindSpore (the
base MindFormers' hand-written communication kernels derive from).

A subclass defines ``forward(ctx, *args)`` and ``backward(ctx, *grad_outputs)`` as
static methods, in the style of ``torch.autograd.Function``, and is called as
``MyFunction.apply(*args)``. ``ctx.save_for_backward(*tensors)`` /
``ctx.saved_tensors`` keep tensors for the backward on both frameworks (torch's
``FunctionCtx``, MindSpore's ``_Function`` context); other state goes on ``ctx`` as
attributes. Both work on **local** (plain) tensors: collectives inside them are the
author's (``Platform.all_gather_into_tensor`` etc., or the framework's own).
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import CustomFunction


def _dtensor_argument(args: tuple[Any, ...]) -> str | None:
    """Where the first DTensor among ``args`` is (top level or one list/tuple deep)."""
    for index, arg in enumerate(args):
        if isinstance(arg, DTensor):
            return f"argument {index}"
        if isinstance(arg, (tuple, list)):
            for inner, item in enumerate(arg):
                if isinstance(item, DTensor):
                    return f"argument {index}[{inner}]"
    return None


class DFunction(CustomFunction):
    """Base of a custom autograd function on local tensors.

    Subclasses define ``forward(ctx, *args) -> tensor | tuple`` (autograd off inside;
    non-tensor arguments pass through) and ``backward(ctx, *grad_outputs) -> one
    gradient per forward argument`` (``None`` for non-tensors and inputs without one).

    Example::

        class ScaledMul(DFunction):
            @staticmethod
            def forward(ctx, x, w, scale):
                ctx.save_for_backward(x, w)
                ctx.scale = scale
                return x * w * scale

            @staticmethod
            def backward(ctx, grad):
                x, w = ctx.saved_tensors
                return grad * w * ctx.scale, grad * x * ctx.scale, None

        y = ScaledMul.apply(x, w, 2.0)
    """

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run ``forward`` now and record ``backward`` for autograd
        (``Platform.apply_function``: torch ``autograd.Function``, MindSpore ``_Function``).
        No communication of its own; whatever ``forward`` does.

        Raises:
            TypeError: a keyword argument (MindSpore's ``_Function`` takes positional
                arguments only), or a DTensor argument (``forward``/``backward`` see
                local tensors; pass ``dtensor.to_local()``, and wrap the result with
                ``DTensor.from_local`` where a DTensor is wanted). Raised before
                ``forward`` runs, so before any collective in it.
        """
        if kwargs:
            raise TypeError(f"{cls.__qualname__}.apply: keyword arguments {sorted(kwargs)} are not supported "
                            "(MindSpore's custom functions take positional arguments only); pass them "
                            "positionally, in forward's order")
        where = _dtensor_argument(args)
        if where is not None:
            raise TypeError(f"{cls.__qualname__}.apply: {where} is a DTensor; a DFunction's forward and backward "
                            "run on local tensors and there is no DTensor rule for custom functions: pass "
                            "dtensor.to_local() (and wrap the result with DTensor.from_local if needed)")
        return get_platform().apply_function(cls, *args)
