"""Ops on DTensors (and, unchanged, on framework tensors), run under the sharding rules
of ``op_rules.py`` on both frameworks.

Each function takes DTensors on one mesh (Python numbers where noted) and returns a
DTensor whose placements follow the op's rule; given framework tensors only, it runs the
framework op and returns a framework tensor, so one model written against this module
runs sharded and unsharded. The DTensor operators (``+ - * / @ **``, unary ``-``) and
methods (``sum``, ``mean``, ``reshape``, ``transpose``, ...) call these functions.

``call(name, fn, *tensors)`` runs any other local function: under ``name``'s rule if
``OP_RULES`` has one, else through the fallback (inputs to Replicate, a warning naming
the op, a Replicate result).

Shapes in the docstrings are global; dims may be negative.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hyper_parallel.core import tensor_ops
from hyper_parallel.core.dtensor import loss_parallel
from hyper_parallel.core.dtensor.dispatch import dispatch
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.op_rules import view_groups
from hyper_parallel.platform import get_platform

Number = (int, float)


def _dim(dim: int, ndim: int, op: str) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"{op}: dim={dim} is out of range for a {ndim}-D tensor; use a dim in [{-ndim}, {ndim})")
    return dim % max(ndim, 1)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _pointwise(op: str, args: Sequence[Any], fn: Callable[..., Any]) -> Any:
    """Elementwise ``fn`` over ``args`` (tensors and Python numbers), broadcasting."""
    is_number = [isinstance(a, Number) and not isinstance(a, bool) for a in args]
    tensors = [a for a, number in zip(args, is_number) if not number]

    def local(*locals_: Any) -> Any:
        it = iter(locals_)
        return fn(*[a if number else next(it) for a, number in zip(args, is_number)])

    return dispatch(op, tensors, local, {"scalar": any(is_number), "first_is_tensor": not is_number[0]})


# -- elementwise -------------------------------------------------------------------------
def add(a: Any, b: Any) -> Any:
    """``a + b`` (broadcasting; either may be a Python number)."""
    return _pointwise("add", (a, b), lambda x, y: x + y if not isinstance(x, Number) else y + x)


def sub(a: Any, b: Any) -> Any:
    """``a - b`` (broadcasting; either may be a Python number)."""
    return _pointwise("sub", (a, b), lambda x, y: x - y if not isinstance(x, Number) else (-y) + x)


def mul(a: Any, b: Any) -> Any:
    """``a * b`` (broadcasting; either may be a Python number)."""
    return _pointwise("mul", (a, b), lambda x, y: x * y if not isinstance(x, Number) else y * x)


def div(a: Any, b: Any) -> Any:
    """``a / b`` (broadcasting; either may be a Python number)."""
    def local(x: Any, y: Any) -> Any:
        if isinstance(x, Number):
            return y.pow(-1.0) * x
        return x / y
    return _pointwise("div", (a, b), local)


def neg(x: Any) -> Any:
    """``-x``."""
    return _pointwise("neg", (x,), lambda t: -t)


def pow(x: Any, exponent: float) -> Any:  # noqa: A001  (the op's name)
    """``x ** exponent`` for a Python number ``exponent``."""
    return _pointwise("pow", (x,), lambda t: t.pow(float(exponent)))


def exp(x: Any) -> Any:
    """Elementwise ``e ** x``."""
    return _pointwise("exp", (x,), lambda t: t.exp())


def log(x: Any) -> Any:
    """Elementwise natural log."""
    return _pointwise("log", (x,), lambda t: t.log())


def _unary(name: str, fn: Callable[[Any], Any], how: str) -> Callable[[Any], Any]:
    def op(x: Any) -> Any:
        return _pointwise(name, (x,), fn)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Elementwise ``{name}`` ({how})."
    return op


sqrt = _unary("sqrt", lambda t: t.sqrt(), "the tensor method")
rsqrt = _unary("rsqrt", lambda t: t.rsqrt(), "the tensor method")
sigmoid = _unary("sigmoid", lambda t: t.sigmoid(), "the tensor method")
tanh = _unary("tanh", lambda t: t.tanh(), "the tensor method")
silu = _unary("silu", tensor_ops.silu, "``x * sigmoid(x)``, the framework's kernel")
gelu = _unary("gelu", tensor_ops.gelu, "exact erf form, the framework's kernel")
relu = _unary("relu", tensor_ops.relu, "the framework's kernel")


def to_float(x: Any) -> Any:
    """``x`` as float32 (differentiable)."""
    return _pointwise("float", (x,), lambda t: t.float())


# -- matrix products ---------------------------------------------------------------------
def matmul(a: Any, b: Any) -> Any:
    """``a @ b`` with torch.matmul semantics: ``[..., m, k] @ [..., k, n] -> [..., m, n]``,
    batch dims broadcast; a contracted dim sharded on both gives ``Partial("sum")``."""
    return dispatch("matmul", (a, b), lambda x, y: x @ y)


def bmm(a: Any, b: Any) -> Any:
    """``[batch, m, k] @ [batch, k, n] -> [batch, m, n]``.

    Raises:
        ValueError: an input that is not 3-D.
    """
    if len(a.shape) != 3 or len(b.shape) != 3:
        raise ValueError(f"bmm: inputs must be 3-D [batch, m, k] and [batch, k, n], got {_shape(a)} and {_shape(b)}")
    return dispatch("bmm", (a, b), lambda x, y: x @ y)


def linear(x: Any, weight: Any, bias: Any = None) -> Any:
    """``x @ weight^T + bias``: ``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias``
    ``[out]`` or None -> ``[..., out]``. Column-parallel (weight ``Shard(0)``) gives an
    output sharded on its last dim; row-parallel (weight ``Shard(1)``, ``x`` sharded on
    its last dim) a ``Partial("sum")`` output."""
    if bias is None:
        return dispatch("linear", (x, weight), lambda t, w: t @ w.transpose(0, 1))
    return dispatch("linear", (x, weight, bias), lambda t, w, b: t @ w.transpose(0, 1) + b)


def embedding(ids: Any, weight: Any) -> Any:
    """Rows of ``weight`` ``[vocab, dim]`` at integer ``ids`` ``[*]`` -> ``[*, dim]``."""
    return dispatch("embedding", (ids, weight), tensor_ops.embedding)


# -- reductions and normalizations -------------------------------------------------------
def _dims(x: Any, dim: int | Sequence[int] | None, op: str) -> tuple[int, ...]:
    ndim = len(x.shape)
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({_dim(d, ndim, op) for d in dims}))


def sum(x: Any, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Any:  # noqa: A001
    """Sum over ``dim`` (all dims when None); a sharded reduced dim gives ``Partial("sum")``."""
    dims = _dims(x, dim, "sum")
    if not dims:
        return x
    return dispatch("sum", (x,), lambda t: t.sum(dims, keepdim=keepdim), {"dim": dims, "keepdim": keepdim})


def mean(x: Any, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Any:
    """Mean over ``dim`` (all dims when None): the sum divided by the global count, so
    uneven shards average exactly."""
    dims = _dims(x, dim, "mean")
    count = math.prod(_shape(x)[d] for d in dims)
    return div(sum(x, dims, keepdim), float(count))


def amax(x: Any, dim: int | Sequence[int], keepdim: bool = False) -> Any:
    """Maximum over ``dim``; the reduced dims are made whole first (no gradient is
    defined for a ``Partial("max")``)."""
    dims = _dims(x, dim, "amax")
    return dispatch("amax", (x,), lambda t: t.amax(dims, keepdim), {"dim": dims, "keepdim": keepdim})


def softmax(x: Any, dim: int) -> Any:
    """Softmax along ``dim`` (made whole first if sharded)."""
    d = _dim(dim, len(x.shape), "softmax")
    return dispatch("softmax", (x,), lambda t: get_platform().softmax(t, d), {"dim": d})


def log_softmax(x: Any, dim: int) -> Any:
    """Log-softmax along ``dim`` (made whole first if sharded)."""
    d = _dim(dim, len(x.shape), "log_softmax")
    return dispatch("log_softmax", (x,), lambda t: get_platform().softmax(t, d, log=True), {"dim": d})


def cross_entropy(logits: Any, target: Any, reduction: str = "mean") -> Any:
    """Cross-entropy of ``logits`` ``[N, C]`` (float) against class indices ``target``
    ``[N]`` (int64), natural log. ``reduction``: ``"none"`` -> ``[N]``; ``"sum"``,
    ``"mean"`` -> ``[]`` (the mean divides the sum by the global ``N``, so uneven
    row shards are exact). Rows sharded: ``Partial("sum")`` for sum and mean. Classes
    sharded (``Shard(1)``): vocabulary parallel, the logits are never gathered (see
    [Note: vocabulary-parallel cross-entropy] in ``loss_parallel.py``; three
    all-reduces of ``[rows]`` over the class axis).

    Raises:
        ValueError: other shapes or reductions.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use 'none', 'sum' or 'mean'")
    if len(logits.shape) != 2 or len(target.shape) != 1 or logits.shape[0] != target.shape[0]:
        raise ValueError(f"cross_entropy: logits must be [N, C] and target [N], got {_shape(logits)} and "
                         f"{_shape(target)}; flatten the leading dims first")
    if reduction == "mean":
        return div(cross_entropy(logits, target, "sum"), float(logits.shape[0]))
    # class-sharded logits: [Note: vocabulary-parallel cross-entropy] (a plain target
    # among them is refused by the dispatch below)
    axis = loss_parallel.class_axis(logits) if isinstance(logits, DTensor) and isinstance(target, DTensor) else None
    if axis is not None:
        loss, _ = loss_parallel.vocab_parallel_cross_entropy(logits, target, axis)
        return loss if reduction == "none" else sum(loss, 0)
    return dispatch("cross_entropy", (logits, target),
                    lambda x, t: get_platform().cross_entropy(x, t, reduction), {"reduction": reduction})


# -- shapes ------------------------------------------------------------------------------
def transpose(x: Any, dim0: int, dim1: int) -> Any:
    """Swap ``dim0`` and ``dim1``; a shard moves with its dim."""
    ndim = len(x.shape)
    d0, d1 = _dim(dim0, ndim, "transpose"), _dim(dim1, ndim, "transpose")
    return dispatch("transpose", (x,), lambda t: t.transpose(d0, d1), {"dim0": d0, "dim1": d1})


def permute(x: Any, *dims: int) -> Any:
    """Reorder the dims to ``dims``; a shard moves with its dim.

    Raises:
        ValueError: ``dims`` is not a permutation of the dims.
    """
    if len(dims) == 1 and not isinstance(dims[0], int):
        dims = tuple(dims[0])
    ndim = len(x.shape)
    order = tuple(_dim(d, ndim, "permute") for d in dims)
    if sorted(order) != list(range(ndim)):
        raise ValueError(f"permute: dims={list(dims)} is not a permutation of the {ndim} dims")
    return dispatch("permute", (x,), lambda t: t.permute(*order), {"dims": order})


def _resolve_shape(x: Any, shape: Sequence[int], op: str) -> tuple[int, ...]:
    if len(shape) == 1 and not isinstance(shape[0], int):
        shape = tuple(shape[0])
    shape = tuple(int(s) for s in shape)
    total = math.prod(_shape(x))
    if shape.count(-1) > 1:
        raise ValueError(f"{op}: shape={list(shape)} has more than one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or total % known:
            raise ValueError(f"{op}: shape={list(shape)} does not fit {total} elements")
        shape = tuple(total // known if s == -1 else s for s in shape)
    if math.prod(shape) != total:
        raise ValueError(f"{op}: shape={list(shape)} has {math.prod(shape)} elements, the tensor {_shape(x)} has {total}")
    return shape


def reshape(x: Any, *shape: int) -> Any:
    """``x`` with the global ``shape`` (one ``-1`` allowed). A sharded dim keeps its
    shard when it maps to one dim of the same size, or is the outermost dim of a
    split/merge whose chunks line up; otherwise it is made whole first."""
    out = _resolve_shape(x, shape, "reshape")
    return _view("reshape", x, out)


def view(x: Any, *shape: int) -> Any:
    """Same as ``reshape`` (local tensors are reshaped, which copies when needed)."""
    out = _resolve_shape(x, shape, "view")
    return _view("view", x, out)


def _view(op: str, x: Any, out: tuple[int, ...]) -> Any:
    return dispatch(op, (x,), _LocalView(out, x).apply, {"shape": out})


class _LocalView:
    """The local reshape of a view: the output piece's shape is the global output shape
    with each sharded dim cut to this rank's chunk, found from the input piece (the
    rule maps each sharded input dim to one output dim with the same chunking)."""

    def __init__(self, out: tuple[int, ...], x: Any) -> None:
        self.out = out
        self.x = x

    def apply(self, t: Any) -> Any:
        src, local = _shape(self.x), _shape(t)
        shape = list(self.out)
        for ins, outs in view_groups(src, self.out):
            if ins and outs and local[ins[0]] != src[ins[0]]:
                # the outermost input dim of the group is sharded: scale the outermost
                # output dim by the same fraction (exact by the rule's alignment check)
                inner_in = math.prod(src[k] for k in ins[1:])
                inner_out = math.prod(self.out[k] for k in outs[1:])
                shape[outs[0]] = local[ins[0]] * inner_in // inner_out
        return t.reshape(tuple(shape))


# -- anything else -----------------------------------------------------------------------
def call(name: str, fn: Callable[..., Any], *tensors: Any, **params: Any) -> Any:
    """Run ``fn(*local_tensors)`` on DTensors under the rule ``OP_RULES[name]`` (``params``
    as the rule family reads them), or, for a name without a rule, through the
    fallback: every input redistributed to Replicate, ``fn`` on the whole tensors, a
    Replicate result, and a ``UserWarning`` naming the op (once per op)."""
    return dispatch(name, tensors, fn, params)
