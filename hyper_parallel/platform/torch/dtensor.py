"""The torch DTensor class: a ``torch.Tensor`` wrapper subclass whose aten ops are routed
to core's sharding rules through ``__torch_dispatch__``.

[Note: torch DTensor dispatch]
A DTensor is a wrapper subclass (``torch.Tensor._make_wrapper_subclass``, as torch's own
DTensor): it has the global shape, dtype and device and no storage; its local tensor is
``_local``. Its ``__torch_function__`` is torch's disabled one (as torch's DTensor's), so
torch's C++ hands every torch function straight on: autograd records the op on the
DTensors, composite ops (``F.linear``, ``reshape``, ``F.cross_entropy``,
``F.scaled_dot_product_attention``) decompose, and each aten op then arrives at
``__torch_dispatch__`` below autograd, forward and backward alike. There ``_translate`` names the op as
``OP_RULES`` does (``aten.mm`` -> ``"matmul"``, ``aten._softmax`` -> ``"softmax"``) and
reads its non-tensor arguments into the rule's params; core plans the redistributions
and the output placements and runs the aten op on the local tensors. An aten op without
a translation takes core's fallback (inputs to ``Replicate``, one warning per op).
The fused attention kernels (several outputs) and softmax / ``nll_loss`` over a
class-sharded dim (vocabulary parallel, never gathering the logits) go to core's fused
dispatch instead (``fused_ops.py``). ``@`` / ``Tensor.matmul`` of two DTensors of 3 dims
or more run whole under the matmul rule, above autograd (their decomposition merges the
batch and head dims, which cannot keep a head sharding); the function ``torch.matmul``
cannot be reached above autograd without a Python ``__torch_function__`` on every op,
so it decomposes, and a head sharding of a batch of more than one is redistributed
(correct, with an all-to-all); ``numpy()`` / ``tolist()`` refuse (methods of the class).

The translation is cached per call signature (the op, each DTensor's spec, the other
arguments' values). Where core says the call needs no communication and no other local
op (``entry.local_plan``: every input already where the rule wants it), the cached entry
holds the plan, and the next such call runs the aten op on the local tensors and wraps
the result in the plan's output spec right here (the shape checked against the plan),
without planning again: most ops of a training step (an optimizer's in-place updates,
the element-wise ops between matmuls, their backward ops) take this path.

Arguments: Python numbers and 0-dim framework tensors (torch wraps Python scalars into
those) stay in the local call as they are; a framework tensor with dims among DTensors
that are all replicated is a replicated DTensor (core's [Note: framework tensors among
replicated DTensors]; torch's DTensor asks for ``implicit_replication()`` there);
among others it raises ``RuntimeError``, as torch's DTensor does (a ``TypeError``
would turn into Python's generic "unsupported operand" inside a binary operator): wrap
it with ``DTensor.from_local`` first.

``_foreach_*`` ops (the optimizers' and ``clip_grad_norm_``'s multi-tensor paths) run
as one aten call on the local tensors when, at every list index, the DTensors share one
spec without ``Partial`` (an optimizer's parameter, gradient and states); otherwise
index by index through the rule of the op's single-tensor form. They go to that path
straight from ``__torch_dispatch__``, and the verdict is kept per tuple of spec objects
(``_foreach_locals``).

Cost: torch 2.13's own DTensor dispatches in C++; a Python ``__torch_dispatch__`` costs
a few microseconds per op more in torch's C++ before and after it (see
``benchmarks/results/dtensor_dispatch.md``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyper_parallel.platform.torch import checkpoint as dcp_protocol
from hyper_parallel.platform.torch import fused_ops

aten = torch.ops.aten

#: pointwise aten ops whose rule has the op's own name
_POINTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "silu", "gelu", "relu", "sigmoid",
    "tanh", "abs", "sign", "sin", "cos", "reciprocal", "clamp", "addcmul", "addcdiv", "maximum", "minimum", "where",
    "masked_fill", "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "isnan", "isinf",
    "isfinite", "ones_like", "empty_like", "full_like", "fill", "silu_backward", "sigmoid_backward",
    "tanh_backward", "gelu_backward", "threshold_backward", "clone", "detach", "alias", "copy", "zeros_like",
    "lerp",
})
#: pointwise aten ops under another rule name
#: aten's in-place draws core makes from its own stream ([Note: random ops on DTensors] in
#: core/dtensor/random.py): per op and overload, (param, aten argument name, default) in
#: aten's positional order after the tensor. bernoulli.default is absent: its p is a tensor.
_DRAWS = {("normal", "default"): (("mean", "mean", 0.0), ("std", "std", 1.0)),
          ("uniform", "default"): (("low", "from", 0.0), ("high", "to", 1.0)),
          ("bernoulli", "float"): (("p", "p", 0.5),)}
#: aten's out-of-place draws shaped like their input, as the in-place draw of core's stream
#: they equal (``torch.rand_like(x)`` is ``uniform_`` on a tensor like ``x``)
_DRAWS_LIKE = {"rand_like": ("uniform", {"low": 0.0, "high": 1.0}), "randn_like": ("normal", {"mean": 0.0, "std": 1.0})}
_RENAMED = {"_to_copy": "to_copy", "rsub": "sub", "clamp_min": "clamp", "clamp_max": "clamp", "zero": "zeros_like",
            "mm": "matmul", "bmm": "bmm", "addmm": "addmm", "_softmax": "softmax", "_log_softmax": "log_softmax",
            "_softmax_backward_data": "softmax_backward", "_log_softmax_backward_data": "log_softmax_backward",
            "embedding_dense_backward": "embedding_backward"}


def _shape_arg(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    """A view's size argument with ``-1`` resolved."""
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        shape[shape.index(-1)] = numel // known if known else 0
    return tuple(shape)


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def _dims(dim: Any) -> tuple[int, ...] | None:
    if dim is None:
        return None
    if isinstance(dim, int):
        return (dim,)
    return tuple(dim) or None  # aten reads an empty dim list as "every dim"


def _translate(name: str, overload: str, args: tuple[Any, ...], kwargs: dict[str, Any],
               is_dtensor: Callable[[Any], bool]) -> tuple[str, dict[str, Any]]:
    """``(rule name, params)`` of an aten op (``name`` without a trailing ``_``); a rule
    name not in ``OP_RULES`` takes core's fallback."""
    x = args[0] if args else None
    if name in _POINTWISE or name in ("_to_copy", "rsub", "clamp_min", "clamp_max", "zero"):
        operands = args if name not in ("lerp",) else args[:2]
        scalar = any(not is_dtensor(a) and (isinstance(a, (int, float)) or (isinstance(a, torch.Tensor)))
                     for a in operands)
        return _RENAMED.get(name, name), {"scalar": scalar, "first_is_tensor": is_dtensor(x)}
    if name in ("mm", "bmm", "addmm", "embedding_dense_backward"):
        params = {"num_weights": int(args[2])} if name == "embedding_dense_backward" else {}
        return _RENAMED[name], params
    if name in ("sum", "mean", "amax", "amin"):
        dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else None)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        return name, {"dim": _dims(dim), "keepdim": bool(keepdim)}
    if name == "linalg_vector_norm":
        ord_ = float(kwargs.get("ord", args[1] if len(args) > 1 else 2.0))
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
        keepdim = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
        rule = "norm" if ord_ > 0 else "linalg_vector_norm"
        return rule, {"ord": ord_, "dim": _dims(dim), "keepdim": bool(keepdim)}
    if name in ("_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"):
        return _RENAMED[name], {"dim": int(args[1] if name in ("_softmax", "_log_softmax") else args[2])}
    if name in ("view", "_unsafe_view") and overload in ("default", ""):
        return "view", {"shape": _shape_arg(args[1], _numel(x.shape))}
    if name == "unsqueeze":
        dim = int(args[1]) % (x.dim() + 1)
        shape = tuple(x.shape)
        return "view", {"shape": shape[:dim] + (1,) + shape[dim:]}
    if name == "squeeze":
        # squeeze.dims with an empty list squeezes nothing; a 0-dim tensor has no dim to drop
        dims = range(x.dim()) if len(args) < 2 else (_dims(args[1]) or ()) if x.dim() else ()
        drop = {d % x.dim() for d in dims if x.shape[d] == 1}
        return "view", {"shape": tuple(s for d, s in enumerate(x.shape) if d not in drop)}
    if name == "expand":
        size = [int(s) for s in args[1]]
        offset = len(size) - x.dim()
        return "expand", {"shape": tuple(x.shape[k - offset] if s == -1 else s for k, s in enumerate(size))}
    if name == "t":
        return "transpose", {"dim0": 0, "dim1": min(1, x.dim() - 1)}
    if name == "transpose":
        return "transpose", {"dim0": int(args[1]) % x.dim(), "dim1": int(args[2]) % x.dim()}
    if name == "permute":
        return "permute", {"dims": tuple(int(d) % x.dim() for d in args[1])}
    if name == "slice":
        dim = int(kwargs.get("dim", args[1] if len(args) > 1 else 0)) % x.dim()
        start = kwargs.get("start", args[2] if len(args) > 2 else None)
        end = kwargs.get("end", args[3] if len(args) > 3 else None)
        step = kwargs.get("step", args[4] if len(args) > 4 else 1)
        shape = list(x.shape)
        shape[dim] = len(range(*slice(start, end, step).indices(shape[dim])))
        return "slice", {"dim": dim, "shape": tuple(shape)}
    if name in ("cat", "stack"):
        tensors = list(args[0])
        dim = int(kwargs.get("dim", args[1] if len(args) > 1 else 0))
        if name == "stack":
            return "stack", {"dim": dim % (tensors[0].dim() + 1)}
        dim %= tensors[0].dim()
        shape = list(tensors[0].shape)
        shape[dim] = sum(int(t.shape[dim]) for t in tensors)
        return "cat", {"dim": dim, "shape": tuple(shape)}
    if name == "embedding":
        return "embedding", {}
    if name in _DRAWS_LIKE and kwargs.get("dtype") in (None, getattr(x, "dtype", None)):
        rule, params = _DRAWS_LIKE[name]
        return rule, dict(params)
    if (name, overload) in _DRAWS:
        return name, {key: float(kwargs.get(aten_name, args[i + 1] if len(args) > i + 1 else default))
                      for i, (key, aten_name, default) in enumerate(_DRAWS[name, overload])}
    return name, {}


def _substituting(func: Any, leaves: Sequence[Any], positions: Sequence[int],
                  unflatten: Any = None, kwargs: dict[str, Any] | None = None) -> Callable[..., Any]:
    """``func`` called with ``leaves`` whose entries at ``positions`` are replaced by the
    given local tensors (rebuilt into ``(args, kwargs)`` by ``unflatten`` when given; else
    ``leaves`` are the positional arguments and ``kwargs``, holding no DTensor, the rest)."""
    def call(*locals_: Any) -> Any:
        filled = list(leaves)
        for i, local in zip(positions, locals_):
            filled[i] = local
        if unflatten is None:
            return func(*filled, **(kwargs or {}))
        local_args, local_kwargs = tree_unflatten(filled, unflatten)
        return func(*local_args, **local_kwargs)

    return call


def _local_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                is_dtensor: Callable[[Any], bool]) -> tuple[list[Any], Callable[..., Any]]:
    """The DTensors among ``args``/``kwargs`` (in order) and the op as a function of
    their local tensors."""
    if not kwargs and not any(isinstance(a, (list, tuple)) for a in args):
        # the common case, without pytree: flat positional arguments
        positions = [i for i, a in enumerate(args) if is_dtensor(a)]
        _check_mixed(func, args, is_dtensor)
        return [args[i] for i in positions], _substituting(func, args, positions)
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(flat) if is_dtensor(leaf)]
    _check_mixed(func, flat, is_dtensor)
    return [flat[i] for i in positions], _substituting(func, flat, positions, spec)


def _check_mixed(func: Any, leaves: Sequence[Any], is_dtensor: Callable[[Any], bool]) -> None:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and not is_dtensor(leaf) and leaf.dim() > 0:
            name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
            # an optimizer's in-place update is where torch's set_optimizer_state_dict(
            # full_state_dict=True) surfaces: [Note: DTensors and torch's state-dict functions]
            hint = ("; an optimizer state loaded from a full state dict by torch's set_optimizer_state_dict is "
                    "such a tensor: load it with hyper_parallel.platform.torch.state_dict.set_optimizer_state_dict"
                    if name.startswith("_foreach_") or name.endswith("_") else "")
            kinds = ["DTensor" if is_dtensor(x) else f"torch.Tensor{tuple(x.shape)}"
                     for x in leaves if isinstance(x, torch.Tensor)]
            cls = next(type(x) for x in leaves if is_dtensor(x))  # core's static methods are the class's
            raise RuntimeError(cls.entry().mixed_operand_message(str(func), kinds) + hint)


def _replicate_plain(entry: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     is_dtensor: Callable[[Any], bool], inplace: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` / ``kwargs`` with each torch.Tensor (with dims) among DTensors that are all
    replicated made a replicated DTensor (see core's [Note: framework tensors among
    replicated DTensors]); as they are otherwise (``_check_mixed`` then refuses them), and
    when an in-place op would write such a tensor."""
    # flat positional arguments (most ops) without pytree, as in _local_call
    flat_args = not kwargs and not any(isinstance(a, (list, tuple)) for a in args)
    flat, spec = (list(args), None) if flat_args else tree_flatten((args, kwargs))
    plain = [i for i, leaf in enumerate(flat)
             if isinstance(leaf, torch.Tensor) and not is_dtensor(leaf) and leaf.dim() > 0]
    if not plain or (inplace and not is_dtensor(args[0])):
        return args, kwargs
    dtensors = [leaf for leaf in flat if is_dtensor(leaf)]
    if not entry.replicated_operands(dtensors):
        return args, kwargs
    mesh = dtensors[0].device_mesh
    for i in plain:
        flat[i] = entry.replicated(flat[i], mesh)
    return (tuple(flat), kwargs) if flat_args else tree_unflatten(flat, spec)


def _unwrap_all(args: Any, is_dtensor: Callable[[Any], bool]) -> Any:
    flat, spec = tree_flatten(args)
    return tree_unflatten([leaf._local if is_dtensor(leaf) else leaf for leaf in flat], spec)


class _ForeachOp(NamedTuple):
    """What ``__torch_dispatch__`` needs of a ``_foreach_*`` op, read once per op."""

    single: str  # the single-tensor op's name, without a trailing "_" ("mul" for _foreach_mul_)
    inplace: bool  # writes its first list
    pointwise: bool  # the single-tensor op is in _POINTWISE (one call may cover every index)


def _foreach_op(func: Any) -> _ForeachOp | None:
    """``func`` read as a ``_foreach_*`` op; ``None`` for any other op."""
    name = func.overloadpacket.__name__
    if not name.startswith("_foreach_"):
        return None
    single = name[len("_foreach_"):]
    return _ForeachOp(single.rstrip("_"), single.endswith("_"), single.rstrip("_") in _POINTWISE)


def _run_foreach(cls: type, func: Any, op: _ForeachOp, args: tuple[Any, ...], kwargs: dict[str, Any],
                 fits: dict[tuple[Any, ...], tuple[Any, bool]]) -> Any:
    """A ``_foreach_*`` op: one call on the local tensors when every index's DTensors
    share a spec without ``Partial`` and the op is pointwise, else index by index
    (``fits``: see ``_foreach_locals``)."""
    def is_dtensor(x: Any) -> bool:
        return isinstance(x, cls)

    single, inplace = op.single, op.inplace
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    count = len(args[lists[0]])
    local_args = _foreach_locals(cls, args, lists, fits) if op.pointwise and not kwargs else None
    if local_args is not None:
        out = func(*local_args)
        if inplace:
            return out
        return [cls(local, args[lists[0]][k]._spec) for k, local in enumerate(out)]
    results = []
    for k in range(count):
        per_index = tuple([a[k]] if i in lists else a for i, a in enumerate(args))
        rule, params = _translate(single if single != "norm" else "linalg_vector_norm", "default",
                                  _single_args(single, per_index, lists), kwargs, is_dtensor)
        dtensors, call = _local_call(func, per_index, kwargs, is_dtensor)
        if not dtensors:
            out = call()
            results.append(None if inplace else out[0])
            continue
        writes_dtensor = inplace and is_dtensor(args[lists[0]][k])
        results.append(cls.entry().dispatch_op(rule, dtensors,
                                               lambda *ls, call=call: _foreach_result(call(*ls), ls, inplace),
                                               params, inplace=0 if writes_dtensor else None))
    return None if inplace else results


def _foreach_locals(cls: type, args: tuple[Any, ...], lists: list[int],
                   fits: dict[tuple[Any, ...], tuple[Any, bool]]) -> list[Any] | None:
    """The arguments of a pointwise foreach op with each list's DTensors replaced by
    their local tensors, when the op can run as one call on them: every tensor argument
    is a list of DTensors, and at each index they share one spec without ``Partial``
    (the result then has that spec). ``None`` otherwise (the op then runs index by
    index).

    Called on every optimizer step with the same parameter, gradient and state lists,
    whose specs are equal but mostly distinct objects (each parameter's, each state's),
    so comparing them by value each time would cost more than the op: the verdict is
    kept in ``fits`` per tuple of the lists' spec ids; the entry holds the specs, so
    the ids stay theirs while it exists. Bounded (cleared when full). The lists are
    read with C-level ``map`` calls: a list holds DTensors of this exact class, or no
    tensor at all (a ``ScalarList``); anything else runs index by index."""
    for i, a in enumerate(args):
        if i not in lists and isinstance(a, torch.Tensor):
            return None
    local_args = list(args)
    spec_lists = []
    for i in lists:
        a = args[i]
        types = set(map(type, a))
        if len(types) == 1 and cls in types:
            spec_lists.append(tuple(map(_get_spec, a)))
            local_args[i] = list(map(_get_local, a))
        elif i == lists[0] or any(issubclass(t, torch.Tensor) for t in types):
            # the first list holds something other than DTensors of this class (a plain
            # tensor, nothing to write, a subclass); or a plain tensor in another list
            return None
    key = tuple(tuple(map(id, specs)) for specs in spec_lists)
    hit = fits.get(key)
    if hit is None:
        if len(fits) >= _PLAN_CACHE_SIZE:
            fits.clear()
        first = spec_lists[0]
        # zip stops at the shorter list; aten raises for lists of different lengths
        verdict = (not any(pl.is_partial() for spec in set(first) for pl in spec.placements)
                   and all(spec is f or spec == f for specs in spec_lists[1:] for spec, f in zip(specs, first)))
        hit = fits[key] = (spec_lists, verdict)
    return local_args if hit[1] else None


def _single_args(single: str, per_index: tuple[Any, ...], lists: list[int]) -> tuple[Any, ...]:
    """The arguments of the single-tensor op an index of a foreach op runs (for reading
    its params): each list argument's element."""
    return tuple(a[0] if i in lists else a for i, a in enumerate(per_index))


def _foreach_result(out: Any, locals_: Sequence[Any], inplace: bool) -> Any:
    """The local result of one index: the written tensor for an in-place op (which
    returns nothing), else the one-element list's element."""
    return locals_[0] if inplace else out[0]


@functools.lru_cache(maxsize=4096)  # every op's output wrapper asks for its shape's strides
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(strides))


def _batched_matmul(cls: type, entry: Any, args: tuple[Any, ...]) -> Any:
    """``@`` / ``Tensor.matmul`` of two DTensors of 3 dims or more: run whole under the
    matmul rule (batch dims shard), as the explicit ``dtensor_functional.matmul`` does,
    because the decomposition reshapes to merge the batch and head dims, which cannot
    keep a head sharding; ``None`` for other calls (they decompose)."""
    if (len(args) == 2 and all(isinstance(a, cls) for a in args)
            and min(a.dim() for a in args) >= 3 and not entry.dispatch_skipped()):
        return entry.dispatch_explicit("matmul", args, torch.matmul)
    return None


def _view(func: Any) -> Callable[..., Any]:
    def call(x: torch.Tensor, local_shape: Sequence[int]) -> torch.Tensor:
        try:
            return func(x, list(local_shape))
        except RuntimeError:
            # The global (contiguous) strides said a view is possible but this rank's
            # piece is not viewable (a transposed or sliced piece): a copy, as torch's
            # reshape makes of a non-contiguous tensor (in-place writes to the result
            # then do not reach the input).
            return x.reshape(list(local_shape))
    return call


def build_dtensor_type(base: type) -> type:
    """The torch DTensor class over core's ``base`` (see [Note: torch DTensor dispatch])."""
    entry = base.entry()  # [Note: the backend entry] in core/op_entry.py

    class DTensor(torch.Tensor, base):  # type: ignore[misc, valid-type]
        # autograd records ops on the wrappers; their aten ops run below it
        wrapper_autograd = True

        # torch's disabled one, which torch's C++ skips: every torch function goes
        # straight on to autograd and the aten ops (what torch's DTensor does)
        __torch_function__ = torch._C._disabled_torch_function_impl

        def __matmul__(self, other: Any) -> Any:
            routed = _batched_matmul(type(self), entry, (self, other))
            return torch.Tensor.__matmul__(self, other) if routed is None else routed

        def __rmatmul__(self, other: Any) -> Any:
            routed = _batched_matmul(type(self), entry, (other, self))
            return torch.Tensor.__rmatmul__(self, other) if routed is None else routed

        def matmul(self, other: Any) -> Any:
            routed = _batched_matmul(type(self), entry, (self, other))
            return torch.Tensor.matmul(self, other) if routed is None else routed

        # reads of a DTensor as plain values: [Note: DTensors and torch's state-dict functions]
        def numpy(self, *, force: bool = False) -> Any:
            dcp_protocol.refuse_plain_read(self, "numpy()")

        def tolist(self) -> Any:
            dcp_protocol.refuse_plain_read(self, "tolist()")

        @staticmethod
        def __new__(cls, local: torch.Tensor, spec: Any) -> DTensor:
            shape = tuple(spec.shape)
            # The strides are the contiguous ones of the global shape on every rank, never
            # derived from the local piece: composite ops (reshape, contiguous) decide
            # between a view and a copy from them, and a decision that differed between
            # ranks (a size-1 piece is contiguous where its peers are not) would send the
            # ranks down different op sequences and mismatch their collectives. A view of
            # a piece that is not viewable copies instead (see ``_view``).
            r = torch.Tensor._make_wrapper_subclass(cls, shape, strides=_contiguous_strides(shape),
                                                    dtype=local.dtype, device=local.device, layout=local.layout,
                                                    requires_grad=False)
            r._local = local
            r._spec = spec
            return r

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass  # __new__ sets the attributes

        def __repr__(self, *, tensor_contents: Any = None) -> str:
            return base.__repr__(self)

        def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:
            # A copy of the local tensor under the same spec: meshes (and their process
            # groups, which cannot be copied) are shared, as torch's DTensor shares them.
            if id(self) in memo:
                return memo[id(self)]
            with torch.no_grad():
                out = type(self)(self._local.clone(), self._spec)
            out.requires_grad_(self.requires_grad)
            if getattr(self, "_is_param", False):
                out._is_param = True
            memo[id(self)] = out
            return out

        # torch.distributed.checkpoint's extension protocol: [Note: DTensors in DCP checkpoints]
        def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
            return dcp_protocol.create_write_items(self, fqn)

        def __create_chunk_list__(self) -> list[Any]:
            return dcp_protocol.create_chunk_list(self)

        def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
            return dcp_protocol.tensor_shard(self, index)

        def __reduce_ex__(self, protocol: Any) -> Any:
            dcp_protocol.refuse_pickle(self)

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            if skipped():
                return _run_skipped(cls, func, args, kwargs or {})
            kwargs = kwargs or {}
            if args and type(args[0]) is list:
                # a list of tensors first: a _foreach_* op (an optimizer's step) goes
                # straight to its path, with what it needs of the op read once; cat and
                # stack go on to _run_op
                op = foreach_ops.get(func, _NOT_READ)
                if op is _NOT_READ:
                    op = foreach_ops[func] = _foreach_op(func)
                if op is not None:
                    return _run_foreach(cls, func, op, args, kwargs, foreach_fits)
            key = _flat_key(cls, func, args, kwargs)
            cached = plans.get(key) if key is not None else None
            if cached is not None:
                rule, params, inplace, positions, local, shaped, shape, strides = cached
                if local is not None:
                    # no communication and the op as it is: run it on the local tensors
                    # and wrap the result (dispatch_local's work, planned once per key)
                    if recording() is not None:  # [Note: recorded rules] in core/op_entry.py
                        entry.record_rule(rule)
                    if shaped is not None:
                        out = shaped(args[positions[0]]._local, local_shape=local.out_local_shape)
                    else:
                        out = func(*[a._local if type(a) is cls else a for a in args], **kwargs)
                    if inplace is not None:
                        return args[inplace]
                    if out.shape != local.out_local_shape:
                        entry.check_result(rule, out, local)  # raises, naming the op
                    # __new__'s work, with the output's shape and strides from the entry
                    r = torch.Tensor._make_wrapper_subclass(cls, shape, strides=strides, dtype=out.dtype,
                                                            device=out.device, layout=out.layout,
                                                            requires_grad=False)
                    r._local = out
                    r._spec = local.out_spec
                    return r
                return entry.dispatch_op(rule, [args[i] for i in positions],
                                        shaped or _substituting(func, args, positions, kwargs=kwargs), params,
                                        inplace=inplace, with_local_shape=shaped is not None)
            return _run_op(cls, entry, func, args, kwargs, key, plans)

    # (func, argument specs and values) -> (rule, params, inplace, DTensor positions,
    # the plan when it needs no communication: ``entry.local_plan``, the local call of a
    # view or an expand, which takes this rank's size) of the ops that run as they are or
    # with their size: the translation, the frozen params and such a plan are computed
    # once per such key; bounded (cleared when full).
    DTensor.__torch_function__ = torch._C._disabled_torch_function_impl
    plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    # aten ops whose first argument was a list -> their _ForeachOp (None: not a foreach
    # op); one entry per op overload, so unbounded
    foreach_ops: dict[Any, _ForeachOp | None] = {}
    # the ids of a foreach call's specs, list by list -> (the specs, verdict): see _foreach_locals
    foreach_fits: dict[tuple[Any, ...], tuple[Any, bool]] = {}
    skipped = entry.skip_depth()
    recording = entry.recording
    return DTensor


def _flat_key(cls: type, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A hashable key of an op call whose DTensors are positional arguments (the others:
    numbers, 0-dim tensors, lists of ints such as sizes and dims; keyword arguments that
    are no tensors nor containers, such as a dtype), or None.

    Built on every intercepted op: the common arguments (this class's DTensors, Python
    numbers) are told by their exact type before any ``isinstance`` (which costs more
    against tensor classes). A value's type is kept beside it: ``1``, ``1.0`` and
    ``True`` hash alike."""
    parts: list[Any] = [func]
    for a in args:
        kind = type(a)
        if kind is cls:
            parts.append(a._spec)
        elif kind is int or kind is float or kind is bool:
            parts.append((kind, a))
        elif isinstance(a, cls):
            parts.append(a._spec)
        elif isinstance(a, torch.Tensor):
            if a.dim() != 0:
                return None
            parts.append(_SCALAR_TENSOR)
        elif isinstance(a, (list, tuple)):
            if not all(type(v) is int for v in a):
                return None
            parts.append((kind, tuple(a)))
        else:
            parts.append((kind, a))
    for name, value in kwargs.items():
        if isinstance(value, (torch.Tensor, list, tuple, dict)):
            return None
        parts.append((name, type(value), value))
    return tuple(parts)


def _remember(entry: Any, plans: dict[tuple[Any, ...], tuple[Any, ...]], key: tuple[Any, ...] | None, rule: str,
              frozen: tuple[Any, ...], written: int | None, args: tuple[Any, ...], is_dtensor: Callable[[Any], bool],
              shaped: Callable[..., Any] | None = None) -> None:
    """Cache a translated op under ``key`` (see ``plans`` in ``build_dtensor_type``)."""
    if key is None:
        return
    if len(plans) >= _PLAN_CACHE_SIZE:
        plans.clear()
    positions = tuple(i for i, a in enumerate(args) if is_dtensor(a))
    local = entry.local_plan(rule, [args[i]._spec for i in positions], frozen, written)
    shape = None if local is None else tuple(local.out_spec.shape)
    strides = None if shape is None else _contiguous_strides(shape)
    plans[key] = (rule, frozen, written, positions, local, shaped, shape, strides)


_SCALAR_TENSOR = ("0-dim tensor",)
_NOT_READ = object()  # a foreach_ops lookup of an op not read yet
_get_spec = operator.attrgetter("_spec")
_get_local = operator.attrgetter("_local")
_PLAN_CACHE_SIZE = 4096


def _written(func: Any, args: tuple[Any, ...], is_dtensor: Callable[[Any], bool]) -> int | None:
    """The index among the DTensor arguments of the first one the op's schema says it
    writes (``rrelu_with_noise``'s ``noise``), or None: it is planned as an in-place op's
    input (kept in its placements; refused, naming the op, where that is impossible)."""
    position = 0
    for value, argument in zip(args, func._schema.arguments):
        if is_dtensor(value):
            if argument.alias_info is not None and argument.alias_info.is_write:
                return position
            position += 1
    return None


def _run_skipped(cls: type, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Under ``SkipDTensorDispatch``: the op on the local tensors; an in-place op returns
    the DTensor it wrote."""
    def is_dtensor(x: Any) -> bool:
        return isinstance(x, cls)

    name = func.overloadpacket.__name__
    out = func(*_unwrap_all(args, is_dtensor), **_unwrap_all(kwargs, is_dtensor))
    inplace = name.endswith("_") and not name.endswith("__") and not name.startswith("_foreach_")
    return args[0] if inplace else out


def _run_op(cls: type, entry: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            key: tuple[Any, ...] | None, plans: dict[tuple[Any, ...], tuple[Any, ...]]) -> Any:
    """An intercepted op the plan cache does not hold: translate it, run it, and cache
    its translation when the op runs as it is."""
    def is_dtensor(x: Any) -> bool:
        return isinstance(x, cls)

    name = func.overloadpacket.__name__
    inplace = name.endswith("_") and not name.endswith("__")
    if name.startswith("_foreach_"):
        # a foreach op whose first list came as a tuple (__torch_dispatch__ routes lists)
        return _run_foreach(cls, func, _foreach_op(func), args, kwargs, {})
    if name in ("_local_scalar_dense", "equal", "is_same_size"):
        return func(*[entry.full_local(a) if is_dtensor(a) else a for a in args], **kwargs)
    if name.startswith("new_") and is_dtensor(args[0]):
        # x.new_zeros(size) and the like: a new tensor every rank makes whole
        # (torch's DTensor makes it replicated too)
        return entry.replicated(func(args[0]._local, *args[1:], **kwargs), args[0].device_mesh)
    if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor) and args[1].dim() > 0:
        # a plain operand of a copy: [Note: DTensors and torch's state-dict functions]
        if is_dtensor(args[0]) and not is_dtensor(args[1]):
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            return dcp_protocol.copy_from_full(args[0], args[1], non_blocking)
        if not is_dtensor(args[0]):
            dcp_protocol.refuse_plain_read(args[1], "copy_ into a plain torch.Tensor")
    args, kwargs = _replicate_plain(entry, args, kwargs, is_dtensor, inplace)
    if name in ("split", "split_with_sizes") and is_dtensor(args[0]) and not any(map(is_dtensor, args[1:])):
        # torch.split / Tensor.chunk: core plans the pieces' placements (one rule for both frameworks)
        dim = int(kwargs.get("dim", args[2] if len(args) > 2 else 0))
        return list(entry.dispatch_split(args[0], dim, lambda local: func(local, *args[1:], **kwargs),
                                         differentiable=False))
    routed = fused_ops.route(entry, cls, name, func, args, kwargs, lambda f, leaves: _check_mixed(f, leaves, is_dtensor))
    if routed is not fused_ops.NOT_ROUTED:
        return routed
    rule, params = _translate(name.rstrip("_") if inplace else name, func._overloadname, args, kwargs, is_dtensor)
    if torch.Tag.nondeterministic_seeded in func.tags and not entry.has_rule(rule):
        # core's fallback would draw the whole tensor from each rank's own generator: a
        # Replicate result whose replicas differ, silently
        raise RuntimeError(f"{func} on a DTensor draws from torch's generator, whose values would differ across "
                           "ranks and layouts; the draws hyper_parallel makes layout-invariant are normal_, "
                           "uniform_, bernoulli_(p), rand_like, randn_like and dropout (from its own stream: "
                           "hyper_parallel.core.dtensor.random.manual_seed); draw with one of them, or on the "
                           "local tensor (DTensor.to_local()) if per-rank values are meant")
    dtensors, call = _local_call(func, args, kwargs, is_dtensor)
    if rule in ("view", "expand") and name in ("view", "_unsafe_view", "expand", "squeeze", "unsqueeze") and not kwargs:
        # the size argument is global; the local call takes this rank's (a squeeze as a
        # view too: a piece's own size-1 dims, 1 row of an uneven shard, are not the tensor's)
        if name in ("squeeze", "unsqueeze"):
            func = aten.view.default
        local_fn = _view(func) if rule == "view" else (lambda x, local_shape: func(x, list(local_shape)))
        frozen = entry.freeze_params(params)
        out = entry.dispatch_op(rule, dtensors, local_fn, frozen, with_local_shape=True)
        _remember(entry, plans, key, rule, frozen, None, args, is_dtensor, local_fn)
        return out
    if name == "mean":
        # the sum over the global count (an exact mean of uneven shards; a sharded
        # reduced dim gives Partial("sum"), as for functional.mean)
        dims = params["dim"] if params["dim"] is not None else tuple(range(args[0].dim()))
        count = _numel([args[0].shape[d] for d in dims])
        dtype = kwargs.get("dtype")

        def mean(x: torch.Tensor) -> torch.Tensor:
            return aten.sum.dim_IntList(x, list(dims), params["keepdim"], dtype=dtype) / count

        return entry.dispatch_op("sum", dtensors, mean, params)
    if rule == "embedding":
        # aten.embedding(weight, indices); the rule takes (indices, weight)
        return entry.dispatch_op(rule, dtensors[::-1], lambda ids, w: call(w, ids), params)
    written = 0 if inplace and is_dtensor(args[0]) else _written(func, args, is_dtensor)
    frozen = entry.freeze_params(params)
    out = entry.dispatch_op(rule, dtensors, call, frozen, inplace=written)
    _remember(entry, plans, key, rule, frozen, written, args, is_dtensor)
    return out
