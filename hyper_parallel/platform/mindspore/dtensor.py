"""The MindSpore DTensor class: a ``mindspore.Tensor`` subclass whose PyNative ops are
routed to core's sharding rules through MindSpore 2.10's ``__fallback__`` hook.

[Note: MindSpore DTensor dispatch]
A DTensor is made with ``Tensor._make_subclass(cls, local)``: it *is* its local tensor
under another Python type (same storage, same autograd identity), carrying the spec.
So, unlike torch's wrapper, autograd records on the local tensors: ``value_and_grad``
differentiates through the ops core runs on them, and a ``Parameter`` made from a
DTensor (MindSpore derives a ``ParameterDTensor`` class) receives the gradient of its
local piece. ``shape`` (and ``size``) report the global shape to Python code; kernels
see the local tensor.

Every PyNative op with a DTensor input calls ``__fallback__(op, args, kwargs)`` with the
primitive (``AddExt``, ``Dense``, ``SumExt``, ``Reshape``, ...) and its arguments.
``_translate`` names it as ``OP_RULES`` does and reads its params; core's explicit
dispatch (``dispatch.dispatch``) then redistributes differentiably, runs the primitive on
the local tensors (under ``NoFallbackGuard``) and wraps the result. A primitive without
a translation takes core's fallback (inputs to Replicate, one warning per op). A call
that needs no communication is translated and planned once per key and then run from a
cache ([Note: MindSpore dispatch cache] at ``_call_key``).

[Note: MindSpore Tensor methods on DTensors]
MindSpore's ``__fallback__`` round trip (its C++ finds the hook, builds the primitive's
call object and the argument tuple, calls into Python, takes a Tensor subclass back)
costs more than launching a small kernel: measured on the 2-core CPU host, in the
calling thread, about 7 µs beside a 3.5 µs reshape and 20-30 µs beside a 45-70 µs
softmax or add. So the methods most called on activations, ``+ - * /`` (with a DTensor
or a number) and ``reshape`` / ``view``, are defined on the class: each builds the key
``__fallback__`` would build for the primitive MindSpore hands over for that call
(checked on MindSpore 2.10: ``AddExt``/``AddScalar``, ``SubExt``/``SubScalar``,
``Mul``/``Muls``, ``Div``/``Divs``, ``Reshape`` for both reshape and view, the
arguments as given) and, where the cache holds that key, runs the method on the local
tensors ([Note: MindSpore dispatch cache]); any other call runs the method itself,
which reaches ``__fallback__``, the one place calls are translated and planned. The
same key means the same primitive on the same arguments, so a name MindSpore changes
costs only the fast path (its key is then never held), never a wrong plan. A reshape
with a shape of ints has a shorter key still (spec, dtype, shape), filled from the
generic entry (``cached_reshape``): building the generic key cost as much as a third of
the reshape itself.
``tests/dtensor/test_mindspore_dispatch_cache.py`` checks that the methods take it.
``mint`` functions (``mint.nn.functional.softmax``, ``linear``) have no method to
define and always take the round trip.

What ``__fallback__`` does not reach (checked on MindSpore 2.10 CPU): indexing
(``x[..., :4]`` runs on the local tensor and returns it), the ops inside
``mindspore.experimental.optim.AdamW`` (they update each parameter's local storage
directly: the element-wise step on the shard, correct for AdamW), and gradients:
``value_and_grad`` returns plain local tensors, so ``ops.clip_by_global_norm`` on them
computes a norm of this rank's pieces only.

[Note: MindSpore checkpoints of DTensor parameters]
Checked on MindSpore 2.10 CPU, for a Cell under fully_shard or tensor parallelism:
``cell.parameters_dict()`` holds the ``ParameterDTensor`` parameters (global shapes,
this rank's piece inside; ``Tensor(param)`` gives the piece, of the local shape, and
``asnumpy()`` refuses unless the parameter is replicated). ``mindspore.save_checkpoint`` of the Cell, of that dict or of a list of
the parameters first calls ``init_data`` on each parameter (``Cell.init_parameters_data``,
or directly), then reads the data through ``Tensor(param.data)`` / ``get_bytes()``, which
is the piece: MindSpore's own ``Tensor.init_data`` happened to fail there with an
unrelated ``TypeError`` (no initializer), and nothing reached by a subclass could make
MindSpore write the whole parameter (its merge of parallel slices needs its own
auto-parallel layouts). So ``init_data`` refuses, naming the supported paths:
``save_sharded_state_dict`` / ``full_state_dict`` (``core/fully_shard/state_dict.py``);
a ``full_state_dict`` is a dict of numpy arrays, which ``mindspore.save_checkpoint``
writes as full tensors. ``mindspore.load_checkpoint`` + ``load_param_into_net`` of a full
checkpoint into a sharded Cell is refused by MindSpore itself (it compares the local
shape with the checkpoint's); a replicated parameter (local shape = global) loads
correctly. Load full values with ``load_full_state_dict``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

#: primitive -> (rule, kind); kind says how the params are read (see ``_translate``)
_PRIMITIVES: dict[str, tuple[str, str]] = {
    **{name: ("add", "pointwise") for name in ("AddExt", "AddScalar", "Add", "Adds")},
    **{name: ("sub", "pointwise") for name in ("SubExt", "SubScalar", "Sub")},
    **{name: ("mul", "pointwise") for name in ("Mul", "Muls")},
    **{name: ("div", "pointwise") for name in ("Div", "Divs", "RealDiv")},
    "Neg": ("neg", "pointwise"), "PowTensorScalar": ("pow", "pointwise"), "Exp": ("exp", "pointwise"),
    "Log": ("log", "pointwise"), "Sqrt": ("sqrt", "pointwise"), "Rsqrt": ("rsqrt", "pointwise"),
    "SiLU": ("silu", "pointwise"), "GeLU": ("gelu", "pointwise"), "ReLU": ("relu", "pointwise"),
    "Sigmoid": ("sigmoid", "pointwise"), "Tanh": ("tanh", "pointwise"), "Abs": ("abs", "pointwise"),
    "Reciprocal": ("reciprocal", "pointwise"), "ToDtype": ("to_copy", "pointwise"),
    "Cast": ("to_copy", "pointwise"), "Clone": ("clone", "pointwise"),
    "InplaceAddExt": ("add", "inplace"), "InplaceAddsExt": ("add", "inplace"),
    "InplaceSubExt": ("sub", "inplace"), "InplaceSubScalar": ("sub", "inplace"), "InplaceMul": ("mul", "inplace"), "InplaceMuls": ("mul", "inplace"),
    "InplaceDiv": ("div", "inplace"), "InplaceDivs": ("div", "inplace"), "InplaceCopy": ("copy", "inplace"),
    "Assign": ("copy", "inplace"),
    "Dense": ("linear", "linear"), "MatMulExt": ("matmul", "plain"), "BatchMatMulExt": ("bmm", "plain"),
    "SumExt": ("sum", "reduce"), "MeanExt": ("mean", "reduce"),
    "Softmax": ("softmax", "dim1"), "LogSoftmaxExt": ("log_softmax", "dim1"), "LogSoftmax": ("log_softmax", "dim1"),
    "Reshape": ("view", "reshape"), "ExpandDims": ("view", "unsqueeze"),
    "TransposeExtView": ("transpose", "transpose"), "TransposeExt": ("transpose", "transpose"),
    "Transpose": ("permute", "permute"), "Concat": ("cat", "cat"), "LinalgVectorNorm": ("norm", "norm"),
    # the view forms (mint.permute, Tensor.view, mint.unsqueeze) take the same arguments
    "TransposeView": ("permute", "permute"), "View": ("view", "reshape"), "ExpandDimsView": ("view", "unsqueeze"),
    "Square": ("square", "pointwise"), "ReduceSum": ("sum", "reduce"), "Gather": ("embedding", "gather"),
    # new tensors shaped like the input, not reading its values (Cell.to_empty's empty_like
    # of a meta parameter; the reset_parameter fills)
    "EmptyLike": ("empty_like", "pointwise"), "ZerosLikeExt": ("zeros_like", "pointwise"),
    "ZerosLike": ("zeros_like", "pointwise"), "OnesLikeExt": ("ones_like", "pointwise"),
    "OnesLike": ("ones_like", "pointwise"), "FullLike": ("full_like", "pointwise"),
    "InplaceFillScalar": ("fill", "inplace"), "InplaceFillTensor": ("fill", "inplace"),
    "InplaceZero": ("zeros_like", "inplace"),
    # (x, sizes or size or chunks, dim): a tuple of pieces along dim
    "SplitWithSizeView": ("split", "split"), "SplitWithSize": ("split", "split"),
    "SplitTensorView": ("split", "split"), "SplitTensor": ("split", "split"), "ChunkView": ("split", "split"),
    "Chunk": ("split", "split"),
    # a Cell's backward (pre) hook on its outputs (fully_shard's pre-backward): identity
    "CellBackwardHook": ("identity", "identity"),
    "Contiguous": ("clone", "pointwise"),
    # planned by core (core/context_parallel/flash_attention_score.py), else by the rules
    "FlashAttentionScore": ("FlashAttentionScore", "fused_attention"),
    # draws from core's stream ([Note: random ops on DTensors]), never MindSpore's
    # generator: Inplace*(x, *numbers, seed, offset) and *Like(x, seed, offset, dtype, ...)
    "InplaceNormal": ("normal", "draw"), "InplaceUniform": ("uniform", "draw"),
    "InplaceBernoulliScalar": ("bernoulli", "draw"),
    "RandLikeExt": ("uniform", "draw_like"), "RandnLike": ("normal", "draw_like"),
    # dropout: core's (its mask a bernoulli draw of the stream), with the primitives' outputs
    "FuncDropoutExt": ("dropout", "dropout"), "Dropout": ("dropout", "dropout"),
}

#: the number arguments of a ``draw`` primitive after the tensor, as core's params
_DRAW_PARAMS = {"normal": ("mean", "std"), "uniform": ("low", "high"), "bernoulli": ("p",)}
#: the params of a ``draw_like`` primitive (a standard draw)
_DRAW_LIKE_PARAMS = {"uniform": {"low": 0.0, "high": 1.0}, "normal": {"mean": 0.0, "std": 1.0}}
#: MindSpore's primitives that draw from its generator (names; their backward ops, which
#: replay a mask, are not draws): on a DTensor without a route above each rank would draw
#: its own values, so they are refused
_RANDOM_NAME = re.compile(r"Rand|Normal(?!ize)|Uniform|Bernoulli|Dropout|Multinomial|Poisson|Laplace|Shuffle")


def _draws_from_generator(name: str) -> bool:
    return bool(_RANDOM_NAME.search(name)) and "Grad" not in name and "DoMask" not in name


def _name(op: Any) -> str:
    # ``name`` first: the primitives MindSpore hands over (``OpCall``, a new one per call;
    # legacy ``Primitive`` objects) have it, and a failed attribute lookup costs more
    name = getattr(op, "name", None)
    return name if isinstance(name, str) else getattr(op, "__name__", None) or type(op).__name__


def _dims(dim: Any) -> tuple[int, ...] | None:
    if dim is None:
        return None
    if isinstance(dim, int):
        return (dim,)
    return tuple(int(d) for d in dim) or None


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def build_dtensor_type(base: type, ms: Any) -> type:
    """The MindSpore DTensor class over core's ``base`` (see [Note: MindSpore DTensor
    dispatch]); ``ms``: the ``mindspore`` module."""
    from mindspore._c_expression import NoFallbackGuard

    Tensor, Parameter = ms.Tensor, ms.Parameter
    entry = base.entry()  # [Note: the backend entry] in core/op_entry.py

    def is_dtensor(x: Any) -> bool:
        return isinstance(x, DTensor)

    def unwrap(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value._local
        if isinstance(value, (list, tuple)):
            return type(value)(unwrap(v) for v in value)
        return value

    def call_op(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        with NoFallbackGuard():
            return op(*args, **kwargs)

    make_subclass = Tensor._make_subclass

    def wrap(out: Any, spec: Any) -> DTensor:
        # DTensor(out, spec) without the Python-level __new__/__init__ calls
        t = make_subclass(DTensor, out)
        t._local_tensor = out
        t._spec = spec
        return t

    def run_cached(cached: _Cached, op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """A call whose key is cached ([Note: MindSpore dispatch cache]): ``op`` on the
        local tensors, the result wrapped in the plan's output spec."""
        if recording() is not None:
            entry.record_rule(cached.rule)
        call_args = list(args)
        plain = True  # every local a plain Tensor: op cannot reach a __fallback__ again
        grads = cached.grads if cached.grads is not None and records() else None
        for index, position in enumerate(cached.positions):
            a = args[position]
            # a parameter's local tensor is read through the property (see _local)
            local = a._local_tensor if type(a) is DTensor else a._local
            if grads is not None and grads[index] is not None:
                local = entry.to_local_with_grad_placements(local, a._spec, grads[index])
            if type(local) is not Tensor:
                plain = False
            call_args[position] = local
        if cached.shape_args is not None:
            call_args = [call_args[0], *cached.shape_args]
        if plain:
            out = op(*call_args, **kwargs) if kwargs else op(*call_args)
        else:
            with NoFallbackGuard():
                out = op(*call_args, **kwargs)
        if cached.inplace is not None:
            _written(call_args[cached.inplace], out)
            return args[cached.inplace]
        return wrap(out, cached.out_spec)

    def cached_method(name: str, method: Any, args: tuple[Any, ...]) -> Any:
        """``method`` (a ``Tensor`` method) on ``args`` (the DTensor first): from the cache
        where MindSpore's ``__fallback__`` would hand over a call of primitive ``name``
        with these arguments whose key is held, else the method itself, which reaches
        ``__fallback__`` (see [Note: MindSpore Tensor methods on DTensors])."""
        if not skipped():
            try:
                cached = plans.get(_call_key(DTensor, name, args, _NO_KWARGS))
            except TypeError:  # an argument that cannot be hashed
                cached = None
            if type(cached) is _Cached:
                return run_cached(cached, method, args, _NO_KWARGS)
        return method(*args)

    def cached_reshape(method: Any, self: Any, shape: tuple[Any, ...]) -> Any:
        """``Tensor.reshape`` / ``view``: ``cached_method``, and for a shape of ints (spread
        out or one tuple) a shorter key, (spec, dtype, shape) -> (this rank's shape
        arguments, output spec, rule), filled from the generic entry after the first call
        where that entry only reshapes the local tensor (a reshape costs less than the
        generic key)."""
        # (a plain local tensor: the reshape on it cannot reach a __fallback__ again)
        fast = type(self) is DTensor and type(self._local_tensor) is Tensor and shape and not skipped()
        if fast:
            for s in shape[0] if len(shape) == 1 and type(shape[0]) is tuple else shape:
                if type(s) is not int:
                    fast = False
                    break
        if not fast:
            return cached_method("Reshape", method, (self, *shape))
        key = (self._spec, self.dtype, shape)
        hit = reshapes.get(key)
        if hit is not None:
            if recording() is not None:
                entry.record_rule(hit[2])
            return wrap(method(self._local_tensor, *hit[0]), hit[1])
        out = cached_method("Reshape", method, (self, *shape))
        cached = plans.get(_call_key(DTensor, "Reshape", (self, *shape), _NO_KWARGS))
        if type(cached) is _Cached and cached.grads is None and cached.shape_args is not None:
            if len(reshapes) >= _PLAN_CACHE_SIZE:
                reshapes.clear()
            reshapes[key] = (cached.shape_args, cached.out_spec, cached.rule)
        return out

    def binary(tensor_name: str, scalar_name: str, method: Any) -> Callable[[Any, Any], Any]:
        def call(self: Any, other: Any) -> Any:
            kind = type(other)
            name = scalar_name if kind is int or kind is float or kind is bool else tensor_name
            return cached_method(name, method, (self, other))

        call.__name__ = method.__name__
        return call

    def dispatch_uncached(op: Any, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """A call the cache does not hold (yet): translated and handed to core."""
        if len(args) == 3 and isinstance(args[1], str) and isinstance(args[2], tuple):
            # a legacy primitive (ops.gather, ReduceSum) calls op(primitive, name, inputs)
            prim, name, inputs = args
            legacy = op

            def op(*inner: Any, **_: Any) -> Any:  # noqa: ANN401
                return legacy(prim, name, tuple(inner))

            args = list(inputs)
            legacy_call = True  # the wrapper is made per call: not cached
        else:
            legacy_call = False
        if skipped():
            out = call_op(op, unwrap(args), unwrap(kwargs))
            inplace = _PRIMITIVES.get(name, ("", ""))[1] == "inplace"
            return args[0] if inplace else out
        key = None if legacy_call else _call_key(DTensor, name, args, kwargs)
        try:
            cached = plans.get(key, _UNSEEN) if key is not None else None
        except TypeError:  # an argument that cannot be hashed: not cached
            key = cached = None
        rule, kind = _PRIMITIVES.get(name, (name, "plain"))
        if name not in _PRIMITIVES and _draws_from_generator(name):
            # core's fallback would draw the whole tensor on each rank from its own
            # generator: a Replicate result whose replicas differ, silently
            raise RuntimeError(f"{name} on a DTensor draws from MindSpore's generator, whose values would "
                               "differ across ranks and layouts; the draws hyper_parallel makes layout-invariant "
                               "are Tensor.normal_, uniform_, bernoulli_(p), mint.rand_like, mint.randn_like, "
                               "ops.dropout and mint.nn.functional.dropout (from its own stream: "
                               "hyper_parallel.core.dtensor.random.manual_seed); draw with one of them, or on "
                               "the local tensor (DTensor.to_local()) if per-rank values are meant")
        if name not in _PRIMITIVES and name.startswith("Inplace"):
            # core's fallback computes on Replicate copies and returns a new DTensor:
            # the DTensor the call was to write would keep its old values, silently
            raise RuntimeError(f"{name} on a DTensor: this in-place operation has no sharding rule in "
                               "hyper_parallel, and running it on copies would leave the DTensor unchanged; "
                               "use the out-of-place operation (x = op(x, ...)), or run it on the local tensor "
                               "(DTensor.to_local()) where per-rank values are meant")
        out = _dispatch(entry, op, name, rule, kind, args, kwargs, is_dtensor, call_op)
        if cached is _UNSEEN:
            # only once the call went through: what it raised, the next call raises too
            if len(plans) >= _PLAN_CACHE_SIZE:
                plans.clear()
            plans[key] = _remember(entry, rule, kind, args, kwargs, is_dtensor)
        return out

    class DTensor(Tensor, base):  # type: ignore[misc, valid-type]
        # MindSpore's optimizers create their state with Parameter.clone, whose initializer
        # rejects a zero-size shape: a parameter may not have an empty local piece.
        empty_parameters = False

        def __new__(cls, local: Any, spec: Any = None) -> DTensor:
            t = Tensor._make_subclass(cls, local)
            if spec is None and isinstance(local, DTensor):
                # mindspore.Parameter(dtensor) makes its ParameterDTensor class this way
                t._local_tensor, t._spec = local._local_tensor, local._spec
            else:
                t._local_tensor, t._spec = local, spec
            return t

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass  # __new__ sets the attributes

        # [Note: MindSpore Tensor methods on DTensors]: the primitive each one hands over
        __add__ = binary("AddExt", "AddScalar", Tensor.__add__)
        __sub__ = binary("SubExt", "SubScalar", Tensor.__sub__)
        __mul__ = binary("Mul", "Muls", Tensor.__mul__)
        __truediv__ = binary("Div", "Divs", Tensor.__truediv__)

        def reshape(self, *shape: Any, **kwargs: Any) -> Any:
            if kwargs:  # reshape(shape=...)
                return Tensor.reshape(self, *shape, **kwargs)
            return cached_reshape(Tensor.reshape, self, shape)

        def view(self, *shape: Any, **kwargs: Any) -> Any:
            if kwargs:
                return Tensor.view(self, *shape, **kwargs)
            return cached_reshape(Tensor.view, self, shape)

        @property
        def _local(self) -> Any:
            """The local tensor, typed as a plain ``mindspore.Tensor``. A parameter's is
            a same-shape reshape of the parameter itself (under ``NoFallbackGuard``):
            ``value_and_grad`` differentiates with respect to the ``Parameter`` object, so
            the ops must read that object, and its current values (``set_data`` and the
            optimizers' ``Assign`` write the parameter, not the tensor it was made from)."""
            if isinstance(self, Parameter) and not self.is_meta:  # a meta tensor has no values to read
                with NoFallbackGuard():
                    return ms.mint.reshape(self, tuple(self._local_tensor.shape))
            return self._local_tensor

        @property
        def shape(self) -> tuple[int, ...]:
            """The global shape (kernels see the local tensor's)."""
            return tuple(self._spec.shape)

        @property
        def size(self) -> int:
            """The number of elements of the global tensor."""
            return _numel(self._spec.shape)

        def numel(self) -> int:
            return _numel(self._spec.shape)

        def __repr__(self) -> str:
            return base.__repr__(self)

        __str__ = __repr__

        def init_data(self, *args: Any, **kwargs: Any) -> Any:
            """Refuse: see [Note: MindSpore checkpoints of DTensor parameters].

            Raises:
                TypeError: always, naming the supported ways to save.
            """
            raise TypeError(
                f"mindspore.save_checkpoint (or Cell.init_parameters_data) of a hyper_parallel DTensor parameter "
                f"(global shape {tuple(self._spec.shape)}, placements {list(self._spec.placements)}): this rank "
                "holds one piece, which MindSpore would read as the whole parameter. Save with "
                "hyper_parallel.core.fully_shard.save_sharded_state_dict(cell, path) (each rank's pieces with their "
                "boxes; loads into any layout), or full_state_dict(cell) (full numpy arrays on rank 0, which "
                "mindspore.save_checkpoint(dict, path) accepts; load them back with load_full_state_dict)")

        def asnumpy(self) -> Any:
            """The value as numpy where this rank holds all of it (every placement
            ``Replicate``); else refuse: the storage is this rank's piece (or a partial
            sum), which a caller of ``cell.parameters_dict()`` would take for the whole
            parameter (see [Note: MindSpore checkpoints of DTensor parameters]).

            Raises:
                TypeError: a ``Shard`` or ``Partial`` placement, naming the paths that read it.
            """
            if all(pl.is_replicate() for pl in self._spec.placements):
                return super().asnumpy()
            raise TypeError(
                f"asnumpy() of a hyper_parallel DTensor (global shape {tuple(self._spec.shape)}, placements "
                f"{list(self._spec.placements)}): this rank holds one piece, not the value. Read the whole value "
                "with x.full_tensor().asnumpy() (collective), this rank's piece with x.to_local().asnumpy(), or a "
                "module's parameters with hyper_parallel.core.fully_shard.full_state_dict(cell)")

        def __fallback__(self, op: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
            name = _name(op)
            if kwargs is None:
                kwargs = {}
            # [Note: MindSpore dispatch cache]: a cached call first, with nothing copied
            if not (len(args) == 3 and isinstance(args[1], str)) and not skipped():
                key = _call_key(DTensor, name, args, kwargs)
                try:
                    cached = plans.get(key, _UNSEEN) if key is not None else None
                except TypeError:  # an argument that cannot be hashed: not cached
                    key = cached = None
                if type(cached) is _Cached:
                    return run_cached(cached, op, args, kwargs)
            return dispatch_uncached(op, name, list(args), dict(kwargs))

    DTensor.__qualname__ = DTensor.__name__ = "DTensor"
    # [Note: MindSpore dispatch cache] (call key -> _Cached, or None: the call takes
    # _dispatch every time); owned by this class, which the platform instance builds once;
    # bounded (cleared when full)
    plans: dict[tuple[Any, ...], _Cached | None] = {}
    # the same for reshape / view with the shape spread out as ints (see cached_reshape)
    reshapes: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any, str]] = {}
    skipped = entry.skip_depth()
    recording = entry.recording
    records = recording_gradients()
    return DTensor


_UNSEEN = object()  # a key not in the cache yet
_NO_KWARGS: dict[str, Any] = {}  # never written
_PLAN_CACHE_SIZE = 4096
#: the kinds whose local call is the primitive on the local tensors (with this rank's
#: shape for a reshape): what the cache may run itself
_CACHED_KINDS = frozenset({"pointwise", "inplace", "reduce", "dim1", "reshape", "unsqueeze", "transpose", "permute",
                           "linear", "plain"})
_SCALAR_TENSOR = ("0-dim tensor",)


class _Cached(NamedTuple):
    """A cached call (see [Note: MindSpore dispatch cache])."""

    rule: str
    positions: tuple[int, ...]  # the arguments that are DTensors, in order
    #: per DTensor argument, the grad_placements its local tensor is taken with (core's
    #: LocalCall.grads); None where no argument needs one
    grads: tuple[Any, ...] | None
    out_spec: Any  # the plan's output spec
    inplace: int | None  # the argument an in-place op writes (and returns)
    shape_args: tuple[Any, ...] | None  # a reshape's shape arguments for this rank's piece


def recording_gradients() -> Callable[[], bool]:
    """Whether MindSpore records the ops run now for a gradient (inside ``value_and_grad``,
    ``grad``, ``vjp``, with grad enabled): ``_pynative_executor.requires_grad``, the
    executor's own flag (PyNative records only while such a transform runs its function;
    at top level, under ``no_grad`` and inside a custom function's forward it is off)."""
    from mindspore.graph.api import _pynative_executor

    return _pynative_executor.requires_grad


def _call_key(cls: type, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """Everything a call's translation and plan depend on; ``None`` for a call the cache
    does not take (a list of tensors, a framework tensor with dims among DTensors; an
    unhashable argument makes the lookup raise ``TypeError``, which the caller reads so).

    [Note: MindSpore dispatch cache]
    As torch's DTensor caches sharding propagation by the op's schema, an intercepted call
    is keyed by the primitive's name and, per argument: a DTensor's spec (mesh,
    placements, global shape) and dtype; a number's type and value; a 0-dim tensor as a
    marker (it reads as a scalar, whatever its value); a list of ints as it is (sizes,
    dims); and the keyword arguments likewise. The first call of a key takes
    ``_dispatch`` (core plans it, checks the result's shape and dtype) and stores core's
    ``explicit_local_plan`` when the call needs no communication and no other local op;
    the next calls of that key run the primitive on the local tensors (through
    ``to_local_with_grad_placements`` where an input's gradient must be summed over an
    axis) and wrap the result in the plan's output spec, without translating or planning
    again, and without reading the result's shape or dtype (each such read waits for
    PyNative's asynchronous queue). Same key, same local shapes and dtypes (a rank's
    coordinate is fixed), so the first call's checks hold for every later one. Two
    things a cached call leaves out when they cannot matter: the gradient sum
    (``to_local_with_grad_placements``, a custom function costing about as much as a
    small kernel) while MindSpore records nothing (``recording_gradients``: outside
    ``value_and_grad``/``grad``/``vjp`` no backward can reach the call), and
    ``NoFallbackGuard`` when every local tensor is a plain ``Tensor`` (then nothing in
    the call can reach a ``__fallback__``).
    ``tests/dtensor/test_mindspore_dispatch_cache.py`` changes one part of the key at a
    time and checks the values."""
    parts: list[Any] = [name]
    for a in args:
        kind = type(a)
        # the common arguments (this class's DTensors, numbers) are told by their exact
        # type before any isinstance, which costs more against tensor classes
        if kind is cls:
            parts.append((a._spec, a.dtype))
        elif kind is int or kind is float or kind is bool:
            parts.append((kind, a))
        elif a is None:
            parts.append(None)
        elif isinstance(a, cls):
            parts.append((a._spec, a.dtype))
        elif hasattr(a, "shape") and hasattr(a, "dtype"):
            if len(a.shape) != 0:
                return None  # a framework tensor among DTensors: _dispatch decides
            parts.append(_SCALAR_TENSOR)
        elif kind is list or kind is tuple:
            if not all(type(v) is int for v in a):
                return None
            parts.append((kind, tuple(a)))
        else:
            parts.append((kind, a))
    for key, value in kwargs.items():
        if isinstance(value, (list, tuple, dict)) or hasattr(value, "shape"):
            return None
        parts.append((key, type(value), value))
    return tuple(parts)  # unhashable parts are found by the cache lookup


def _remember(entry: Any, rule: str, kind: str, args: Sequence[Any], kwargs: dict[str, Any],
              is_dtensor: Callable[[Any], bool]) -> _Cached | None:
    """The cache entry of a call seen for the first time: core's ``explicit_local_plan``
    of its translation, or ``None`` where ``_dispatch`` must run every time."""
    if kind not in _CACHED_KINDS or (kind == "reduce" and rule == "mean") or not args:
        return None
    positions = tuple(i for i, a in enumerate(args) if is_dtensor(a))
    if not positions or (kind == "inplace" and positions[0] != 0):
        return None
    rule, params, inplace = _params(kind, rule, args, kwargs, is_dtensor)
    call = entry.explicit_local_plan(rule, [args[i]._spec for i in positions], entry.freeze_params(params),
                                     inplace, [args[i].dtype for i in positions])
    if call is None:
        return None
    shape_args = None
    if kind == "reshape":
        local_shape = tuple(call.plan.out_local_shape)
        shape_args = (local_shape,) if len(args) == 2 and isinstance(args[1], (list, tuple)) else local_shape
    grads = call.grads if any(grad is not None for grad in call.grads) else None
    return _Cached(rule, positions, grads, call.plan.out_spec, None if inplace is None else positions[inplace],
                   shape_args)


def _dispatch(entry: Any, op: Any, name: str, rule: str, kind: str, args: list[Any], kwargs: dict[str, Any],
              is_dtensor: Callable[[Any], bool], call_op: Callable[..., Any]) -> Any:
    """One intercepted primitive: its DTensor inputs, params and local call, handed to
    core (``entry``: ``core/op_entry``)."""
    tensors: list[Any] = []
    positions: list[tuple[int, int | None]] = []  # (argument index, list index)
    for i, a in enumerate(args):
        if is_dtensor(a):
            tensors.append(a)
            positions.append((i, None))
        elif isinstance(a, (list, tuple)):
            for j, item in enumerate(a):
                if is_dtensor(item):
                    tensors.append(item)
                    positions.append((i, j))
        elif hasattr(a, "shape") and hasattr(a, "dtype") and len(a.shape) > 0:
            tensors.append(a)  # a framework tensor among DTensors: dispatch refuses it by name
            positions.append((i, None))

    def local_call(*locals_: Any, local_shape: Sequence[int] | None = None) -> Any:
        call_args = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
        for (i, j), local in zip(positions, locals_):
            if j is None:
                call_args[i] = local
            else:
                call_args[i][j] = local
        call_args = [type(args[i])(a) if isinstance(args[i], (list, tuple)) else a for i, a in enumerate(call_args)]
        if local_shape is not None and kind == "reshape":
            # the shape as the call gave it: one tuple (the Reshape primitive, under
            # mint.reshape / ops.reshape) or spread out (Tensor.reshape(*shape))
            shape_as_one = len(args) == 2 and isinstance(args[1], (list, tuple))
            call_args = [call_args[0], tuple(local_shape)] if shape_as_one else [call_args[0], *local_shape]
        return call_op(op, call_args, kwargs)

    x = args[0] if args else None
    if kind == "fused_attention":
        routed = entry.flash_attention_score(args, kwargs)
        if routed is not None:
            return routed
    if kind == "identity":
        return _identity(op, args, kwargs, is_dtensor, call_op)
    if kind in ("draw", "draw_like", "dropout"):
        return _draw(entry, name, rule, kind, args)
    if kind == "split" and is_dtensor(x) and not any(is_dtensor(a) for a in args[1:]):
        dim = int(args[2] if len(args) > 2 else kwargs.get("dim", kwargs.get("axis", 0)))
        return entry.dispatch_split(x, dim, lambda local: call_op(op, [local, *args[1:]], kwargs))
    if kind == "reduce" and rule == "mean":
        dims = _dims(args[1] if len(args) > 1 else kwargs.get("dim"))
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        # the sum over the global count (an exact mean of uneven shards; a sharded
        # reduced dim gives Partial("sum"), as for functional.mean)
        every = tuple(range(len(x.shape))) if dims is None else dims
        count = _numel([x.shape[d] for d in every])

        def mean(local: Any) -> Any:
            return local.sum(every, keepdim=keepdim) / count

        return entry.dispatch_explicit("sum", tensors, mean, {"dim": dims, "keepdim": keepdim})
    if kind == "gather":
        # Gather(weight, ids, axis, batch_dims): an embedding lookup when axis = 0
        if int(args[2]) != 0 or (len(args) > 3 and int(args[3]) != 0):
            rule = name
        else:
            return entry.dispatch_explicit(rule, tensors[::-1], lambda ids, w: local_call(w, ids))
    if kind == "linear" and len(args) > 2 and args[2] is None:
        # Dense(x, w, None): the rule takes (x, w)
        return entry.dispatch_explicit(rule, tensors, lambda xl, wl: call_op(op, [xl, wl, None], kwargs))
    if kind == "norm" and float(args[1] if len(args) > 1 and args[1] is not None else 2.0) <= 0:
        rule = name  # no partial form: the fallback
    rule, params, inplace = _params(kind, rule, args, kwargs, is_dtensor)
    if kind == "reshape":
        return entry.dispatch_explicit(rule, tensors, local_call, params, with_local_shape=True)
    if inplace is not None:
        def written(*locals_: Any) -> Any:
            return _written(locals_[inplace], local_call(*locals_))

        return entry.dispatch_explicit(rule, tensors, written, params, inplace=inplace)
    return entry.dispatch_explicit(rule, tensors, local_call, params, inplace=inplace)


def _written(target: Any, out: Any) -> Any:
    """``target``, holding ``out``: an in-place primitive's result written into the tensor
    it was to write. MindSpore 2.10's CPU kernels of ``Tensor.add_`` / ``sub_`` / ``mul_``
    / ``div_`` (``InplaceAddExt``, ``InplaceMul``, ...) return a new tensor and leave their
    input unchanged, which on a DTensor would drop the update silently; ``copy_``'s kernel
    writes."""
    if out is not target:
        target.copy_(out)
    return target


def _params(kind: str, rule: str, args: Sequence[Any], kwargs: dict[str, Any],
            is_dtensor: Callable[[Any], bool]) -> tuple[str, dict[str, Any], int | None]:
    """``(rule, params, inplace)``: the rule's params a primitive of ``kind`` gives (read
    from its arguments as ``OP_RULES`` reads them) and the index of the input an in-place
    op writes. The mean, gather and bias-free linear forms are read by ``_dispatch``."""
    x = args[0] if args else None
    if kind in ("pointwise", "inplace"):
        # a number (or 0-dim tensor) anywhere among the inputs, ``2 - x`` included:
        # then no Partial passes through an add (an extra argument such as an ``alpha``
        # counts too, which only costs a reduction)
        scalar = any(not is_dtensor(a) and (isinstance(a, (int, float)) and not isinstance(a, bool)
                                            or hasattr(a, "shape") and len(a.shape) == 0) for a in args)
        return rule, {"scalar": scalar, "first_is_tensor": is_dtensor(x)}, 0 if kind == "inplace" else None
    if kind == "reduce":
        return rule, {"dim": _dims(args[1] if len(args) > 1 else kwargs.get("dim")),
                      "keepdim": bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))}, None
    if kind == "dim1":
        return rule, {"dim": int(args[1] if len(args) > 1 else kwargs.get("dim", -1)) % len(x.shape)}, None
    if kind == "reshape":
        shape = [int(s) for s in (args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])]
        if -1 in shape:
            known = _numel([s for s in shape if s != -1])
            shape[shape.index(-1)] = _numel(x.shape) // known if known else 0
        return rule, {"shape": tuple(shape)}, None
    if kind == "unsqueeze":
        dim = int(args[1]) % (len(x.shape) + 1)
        return rule, {"shape": tuple(x.shape[:dim]) + (1,) + tuple(x.shape[dim:])}, None
    if kind == "transpose":
        return rule, {"dim0": int(args[1]) % len(x.shape), "dim1": int(args[2]) % len(x.shape)}, None
    if kind == "permute":
        perm = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return rule, {"dims": tuple(int(d) % len(x.shape) for d in perm)}, None
    if kind == "cat":
        items = list(args[0])
        dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(items[0].shape)
        shape = list(items[0].shape)
        shape[dim] = sum(int(t.shape[dim]) for t in items)
        return rule, {"dim": dim, "shape": tuple(shape)}, None
    if kind == "norm":
        return rule, {"ord": float(args[1] if len(args) > 1 and args[1] is not None else 2.0),
                      "dim": _dims(args[2] if len(args) > 2 else None),
                      "keepdim": bool(args[3] if len(args) > 3 else False)}, None
    return rule, {}, None


def _draw(entry: Any, name: str, rule: str, kind: str, args: list[Any]) -> Any:
    """A draw or a dropout on DTensor ``args[0]``, from core's stream (the random rules:
    each rank draws its piece of what one device draws for the whole tensor).

    Raises:
        RuntimeError: a draw into another dtype, an in-place dropout. ValueError: a
            dropout probability outside ``[0, 1)`` (core's)."""
    x = args[0]
    if kind == "draw":  # Inplace*(x, *numbers, seed, offset): x, written in place
        keys = _DRAW_PARAMS[rule]
        params = {key: float(value) for key, value in zip(keys, args[1:1 + len(keys)])}
        return entry.dispatch_explicit(rule, [x], lambda local: local, params, inplace=0)
    if kind == "draw_like":  # *Like(x, seed, offset, dtype, ...): a new tensor like x
        dtype = args[3] if len(args) > 3 else None
        if dtype is not None and dtype != x.dtype:
            raise RuntimeError(f"{name} on a DTensor draws in its dtype {x.dtype}; dtype={dtype} is not taken: "
                               "draw, then cast")
        return entry.dispatch_explicit(rule, [x], lambda local: local, dict(_DRAW_LIKE_PARAMS[rule]))
    if name == "Dropout":  # ops.dropout: Dropout(x, keep_prob, seed0, seed1) -> (output, mask)
        return entry.dropout_with_mask(x, 1.0 - float(args[1]))
    # mint.nn.functional.dropout: FuncDropoutExt(x, p, training, inplace, seed, offset)
    p, training, inplace = float(args[1]), bool(args[2]), bool(args[3])
    if inplace and training:
        raise RuntimeError("mint.nn.functional.dropout(inplace=True) on a DTensor is not taken (the mask comes "
                           "from hyper_parallel's stream as a new tensor): use inplace=False")
    return entry.dropout(x, p, training)


def _identity(op: Any, args: list[Any], kwargs: dict[str, Any], is_dtensor: Callable[[Any], bool],
              call_op: Callable[..., Any]) -> Any:
    """``CellBackwardHook([tensors])``, which MindSpore puts on the outputs of a Cell with a
    backward (pre) hook (fully_shard's pre-backward on every unit): the hook runs on the
    local tensors (its hook function sees their gradients, this rank's pieces) and each
    DTensor comes back with its placements. Without this it took the fallback, which
    all-gathered every sharded output of a fully_shard unit (MindFormers' vocabulary-sharded
    logits, its sequence-sharded layer outputs) and handed it on replicated."""
    items = list(args[0])
    locals_ = [t.to_local() if is_dtensor(t) else t for t in items]
    outs = call_op(op, [locals_], kwargs)
    return type(outs)(type(t).from_local(o, t.device_mesh, t.placements, shape=t.shape) if is_dtensor(t) else o
                      for o, t in zip(outs, items))
