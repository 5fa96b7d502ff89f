"""Sharding-propagation rules for ops on DTensors, declared as data.

``OP_RULES`` maps an op name to an ``OpRule``: the *family* of the op (which fixes how
its output shape and its strategies follow from its input shapes) and the family's
options. A **strategy** says, for ONE mesh axis, which placement each DTensor input must
have on that axis and which placement the output then has there, e.g. for ``matmul``
``(Shard(-1), Shard(-2)) -> Partial("sum")`` (each rank multiplies its slice of the
contracted dim and holds one term of the sum). ``dispatch.py`` picks one strategy per
mesh axis (the one whose inputs are cheapest to reach from the current placements),
redistributes the inputs, runs the local op and wraps its result.

Every family lists the all-``Replicate`` strategy last, so every op in the table always
has a correct (if communication-heavy) way to run. An op that is not in the table runs
through the fallback of ``dispatch.py`` (inputs to Replicate, a warning naming the op).

Families (``n``: the size of the mesh axis; dims are dims of the global tensors):

| family | strategies on one axis (inputs -> output) |
|---|---|
| ``pointwise`` | every output dim ``d``: each input ``Shard`` of its dim aligned with ``d`` (broadcast dims of size 1 or missing: ``Replicate``) -> ``Shard(d)``; ``Partial`` where the op is linear (``partial`` option) |
| ``matmul`` | batch dim ``d`` sharded on both (or broadcast) -> ``Shard(d)``; ``(Shard(-2), R) -> Shard(-2)``; ``(R, Shard(-1)) -> Shard(-1)``; ``(Shard(-1), Shard(-2)) -> Partial``; ``(Partial, R)``, ``(R, Partial) -> Partial`` |
| ``linear`` | ``x [..., in]``, ``weight [out, in]``, ``bias [out]``: ``(Shard(d<-1), R, R) -> Shard(d)``; colwise ``(R, Shard(0), Shard(0)) -> Shard(-1)``; rowwise ``(Shard(-1), Shard(1), Partial) -> Partial``; ``(Partial, R, Partial) -> Partial`` |
| ``embedding`` | ``ids [*]``, ``weight [vocab, dim]``: ``(Shard(d), R) -> Shard(d)``; ``(R, Shard(1)) -> Shard(-1)``; vocabulary parallel ``(R, Shard(0)) -> Partial`` |
| ``reduce`` | reduced dim sharded -> ``Partial(reduce_op)`` when the reduction allows it (sum), kept dim ``Shard(d)`` -> ``Shard(d')``; ``Partial -> Partial`` for sum |
| ``along_dim`` | ``softmax``/``log_softmax`` along ``dim``: ``Shard(d != dim) -> Shard(d)`` |
| ``cross_entropy`` | ``logits [N, C]``, ``target [N]``: ``(Shard(0), Shard(0)) -> Shard(0)`` (``reduction="none"``) or ``Partial`` (``"sum"``) |
| ``transpose``/``permute`` | ``Shard(d) -> Shard(d moved)``; ``Partial -> Partial`` |
| ``view`` | ``Shard(d) -> Shard(d')`` when ``d`` maps to one output dim of the same size, or is the first dim of a split/merge whose chunks line up (``ceil(size / n)`` a whole multiple of the inner sizes); ``Partial -> Partial`` |
| ``norm`` | p-norm (``ord``) over ``dim``: reduced dim sharded -> ``NormPartial(ord)``; kept dim ``Shard(d) -> Shard(d')``; ``NormPartial(ord) -> NormPartial(ord)`` (a norm of norms); without ``ord`` only the kept-dim strategies |
| ``stack`` | ``Shard(d)`` on every input -> ``Shard(d')`` (``d' = d`` before the new dim, ``d + 1`` from it); a ``Partial`` that an input has -> the same ``Partial`` on every input |
| ``expand`` | ``Shard(d)`` of a dim that is not broadcast -> ``Shard(d')``; ``Partial -> Partial`` |
| ``addmm`` | ``bias + x @ y`` (2-D): the ``matmul`` strategies of ``(x, y)``, the bias aligned to the output's shard (``Partial`` with a ``Partial`` output) |
| ``like`` | a new tensor of the input's shape that does not read its values (``ones_like``, ``fill``): ``Shard(d) -> Shard(d)``; ``Partial -> Replicate`` (no communication) |
| ``attention`` | ``q [b, hq, sq, d]``, ``k``/``v [b, hkv, skv, d]`` (BNSD): ``Shard(0)`` on all -> ``Shard(0)``; ``Shard(1)`` on all -> ``Shard(1)`` when the axis divides both head counts (query head groups stay with their key/value head); sequences whole (that is context parallelism's job) |
| ``embedding_backward`` | ``grad [*ids, dim]``, ``ids``: ``(Shard(-1), R) -> Shard(1)``; ``(Shard(d), Shard(d)) -> Partial``; ``(Partial, R) -> Partial`` |
| ``random`` | a draw shaped like the input (``normal``, ``uniform``, ``bernoulli``, ``trunc_normal``): ``Shard(d) -> Shard(d)``; no ``Partial`` (a draw is no term of a sum); each rank's piece comes from core's stream, never the framework's generator ([Note: random ops on DTensors] in ``philox.py``) |

``along_dim`` takes any number of inputs of the same rank (``cat``, a softmax's backward)
and an output ``shape`` when it differs from the first input's (``cat``, ``slice``); with
``partial="all"`` a ``Partial`` passes through (the op is linear).

Strategies use only ``Partial("sum")`` (and ``NormPartial`` in ``norm`` / ``stack``);
inputs with another reduction are reduced first. ``params["current"]`` (set by the
dispatcher) holds the ``Partial`` placements the inputs have on the axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hyper_parallel.core.dtensor.placement_types import NormPartial, Partial, Placement, Replicate, Shard

R = Replicate()
P = Partial("sum")


@dataclass(frozen=True)
class Strategy:
    """One mesh axis: the placement each DTensor input needs, and the output's."""

    inputs: tuple[Placement, ...]
    output: Placement


@dataclass(frozen=True)
class OpRule:
    """How an op propagates sharding.

    Attributes:
        family: one of the families of the module doc.
        partial: ``pointwise`` only; which inputs a ``Partial("sum")`` passes through:
            ``"all"`` (the op is additive: add, sub, neg), ``"one"`` (linear in each input
            alone: mul), ``"first"`` (linear in the first: div), ``""`` (none).
        reduce_op: ``reduce`` only; the placement a reduction over a sharded dim gives
            (``"sum"``), or ``""`` when the reduced dims must be whole (amax).
    """

    family: str
    partial: str = ""
    reduce_op: str = ""


OP_RULES: MappingProxyType[str, OpRule] = MappingProxyType({
    "add": OpRule("pointwise", partial="all"),
    "sub": OpRule("pointwise", partial="all"),
    "neg": OpRule("pointwise", partial="all"),
    "mul": OpRule("pointwise", partial="one"),
    "div": OpRule("pointwise", partial="first"),
    # identities, copies and casts are linear (a Partial passes through)
    **{name: OpRule("pointwise", partial="all") for name in ("clone", "detach", "alias", "to_copy", "copy", "lerp")},
    # new tensors shaped like the input, whose values they do not read
    **{name: OpRule("like") for name in ("ones_like", "empty_like", "full_like", "fill")},
    "zeros_like": OpRule("like", partial="all"),  # zeros are a valid Partial("sum") too (zero_ of a Partial)
    # draws: the local op is core's (dispatch.py's _random_local), see [Note: random ops on DTensors]
    **{name: OpRule("random") for name in ("normal", "uniform", "bernoulli", "trunc_normal")},
    **{name: OpRule("pointwise") for name in (
        "pow", "exp", "log", "sqrt", "rsqrt", "square", "silu", "gelu", "relu", "sigmoid", "tanh", "float", "abs", "sign",
        "sin", "cos", "reciprocal", "clamp", "addcmul", "addcdiv", "maximum", "minimum", "where", "masked_fill",
        "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "isnan", "isinf",
        "isfinite", "silu_backward", "sigmoid_backward", "erfinv",
        "tanh_backward", "gelu_backward", "threshold_backward")},
    "matmul": OpRule("matmul"),
    "bmm": OpRule("matmul"),
    "linear": OpRule("linear"),
    "embedding": OpRule("embedding"),
    "sum": OpRule("reduce", reduce_op="sum"),
    "amax": OpRule("reduce"),
    "amin": OpRule("reduce"),
    "norm": OpRule("norm"),
    "softmax": OpRule("along_dim"),
    "log_softmax": OpRule("along_dim"),
    "softmax_backward": OpRule("along_dim"),
    "log_softmax_backward": OpRule("along_dim"),
    "cat": OpRule("along_dim", partial="all"),
    "slice": OpRule("along_dim", partial="all"),
    "stack": OpRule("stack"),
    "expand": OpRule("expand"),
    "addmm": OpRule("addmm"),
    "embedding_backward": OpRule("embedding_backward"),
    "scaled_dot_product_attention": OpRule("attention"),
    "cross_entropy": OpRule("cross_entropy"),
    "transpose": OpRule("transpose"),
    "permute": OpRule("permute"),
    "view": OpRule("view"),
    "reshape": OpRule("view"),
})


def broadcast_shape(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The numpy broadcast of ``shapes``.

    Raises:
        ValueError: shapes that do not broadcast.
    """
    ndim = max(len(s) for s in shapes)
    out = []
    for d in range(ndim):
        sizes = {s[d - ndim + len(s)] for s in shapes if d - ndim + len(s) >= 0} - {1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast (dim {d} has sizes {sorted(sizes)})")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _aligned(shape: Sequence[int], out_shape: Sequence[int], d: int) -> Placement:
    """``Shard`` of the dim of ``shape`` that broadcasts to output dim ``d``, or Replicate
    when that dim is missing or of size 1 (broadcast)."""
    k = d - (len(out_shape) - len(shape))
    return Shard(k) if k >= 0 and shape[k] == out_shape[d] else R


def _reduced(shape: Sequence[int], dims: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(range(len(shape))) if dims is None else tuple(sorted(d % len(shape) for d in dims))


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of ``src`` dims with runs of ``dst`` dims of equal product (a reshape
    keeps each run's elements together); size-1 dims form their own groups.

    Raises:
        ValueError: ``src`` and ``dst`` hold different numbers of elements.
    """
    if math.prod(src) != math.prod(dst):
        raise ValueError(f"reshape/view: a DTensor of shape {tuple(src)} ({math.prod(src)} elements) cannot take "
                         f"shape {tuple(dst)} ({math.prod(dst)} elements); give a shape whose sizes multiply to "
                         f"{math.prod(src)}")
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        ins, outs, pi, po = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po:
                pi *= src[i]
                ins.append(i)
                i += 1
            else:
                po *= dst[j]
                outs.append(j)
                j += 1
        groups.append((ins, outs))
    return groups


def output_shape(rule: OpRule, shapes: Sequence[tuple[int, ...]], params: dict[str, Any]) -> tuple[int, ...]:
    """The global output shape of an op of ``rule``'s family on inputs of ``shapes``."""
    family = rule.family
    if family == "pointwise":
        return broadcast_shape(shapes)
    if family == "matmul":
        x, y = shapes
        if len(x) == 1 and len(y) == 1:  # torch.matmul's vector cases
            return ()
        if len(x) == 1:
            return y[:-2] + y[-1:]
        if len(y) == 1:
            return x[:-1]
        return broadcast_shape([x[:-2], y[:-2]]) + (x[-2], y[-1])
    if family == "linear":
        return shapes[0][:-1] + (shapes[1][0],)
    if family == "embedding":
        return shapes[0] + (shapes[1][1],)
    if family in ("reduce", "norm"):
        reduced = _reduced(shapes[0], params.get("dim"))
        if params.get("keepdim", False):
            return tuple(1 if d in reduced else s for d, s in enumerate(shapes[0]))
        return tuple(s for d, s in enumerate(shapes[0]) if d not in reduced)
    if family == "along_dim":
        return tuple(params.get("shape", shapes[0]))
    if family in ("like", "random"):
        return shapes[0]
    if family == "stack":
        dim = params["dim"] % (len(shapes[0]) + 1)
        return shapes[0][:dim] + (len(shapes),) + shapes[0][dim:]
    if family == "expand":
        return tuple(params["shape"])
    if family == "addmm":
        return (shapes[1][0], shapes[2][1])
    if family == "embedding_backward":
        return (params["num_weights"], shapes[0][-1])
    if family == "attention":
        return shapes[0][:-1] + (shapes[2][-1],)
    if family == "cross_entropy":
        return (shapes[0][0],) if params["reduction"] == "none" else ()
    if family == "transpose":
        out = list(shapes[0])
        d0, d1 = params["dim0"], params["dim1"]
        out[d0], out[d1] = out[d1], out[d0]
        return tuple(out)
    if family == "permute":
        return tuple(shapes[0][d] for d in params["dims"])
    if family == "view":
        return tuple(params["shape"])
    raise ValueError(f"unknown rule family {family!r}")


def strategies(rule: OpRule, shapes: Sequence[tuple[int, ...]], params: dict[str, Any],
               num: int) -> list[Strategy]:
    """The strategies of one mesh axis of size ``num`` for inputs of global ``shapes``
    (all-Replicate last). ``params`` carries the op's non-tensor arguments; ``scalar``
    marks a pointwise op with a Python number operand, ``nested`` (view) the input dims
    that more than one mesh axis shards."""
    n_in = len(shapes)
    out_shape = output_shape(rule, shapes, params)
    found: list[Strategy] = []
    family = rule.family

    def add(inputs: Sequence[Placement], output: Placement) -> None:
        found.append(Strategy(tuple(inputs), output))

    if family == "pointwise":
        for d in range(len(out_shape)):
            if out_shape[d] > 1:
                add([_aligned(s, out_shape, d) for s in shapes], Shard(d))
        if rule.partial == "all" and not params.get("scalar"):
            add([P] * n_in, P)
        elif rule.partial == "one":
            for i in range(n_in):
                add([P if k == i else R for k in range(n_in)], P)
        elif rule.partial == "first" and params.get("first_is_tensor", True):
            add([P] + [R] * (n_in - 1), P)
    elif family == "matmul":
        x, y = shapes
        if len(x) >= 2 and len(y) >= 2:
            nb = len(out_shape) - 2
            for d in range(nb):
                if out_shape[d] > 1:
                    add([_aligned(x[:-2], out_shape[:-2], d), _aligned(y[:-2], out_shape[:-2], d)], Shard(d))
            add([Shard(len(x) - 2), R], Shard(nb))
            add([R, Shard(len(y) - 1)], Shard(nb + 1))
            add([Shard(len(x) - 1), Shard(len(y) - 2)], P)
            add([P, R], P)
            add([R, P], P)
    elif family == "linear":
        x = shapes[0]
        bias = n_in == 3
        for d in range(len(x) - 1):
            add([Shard(d), R] + [R] * bias, Shard(d))
        add([R, Shard(0)] + [Shard(0)] * bias, Shard(len(x) - 1))
        add([Shard(len(x) - 1), Shard(1)] + [P] * bias, P)
        add([P, R] + [P] * bias, P)
    elif family == "embedding":
        for d in range(len(shapes[0])):
            add([Shard(d), R], Shard(d))
        add([R, Shard(1)], Shard(len(shapes[0])))
        # vocabulary parallel: each rank looks up the rows it holds, zeros for the others
        # (dispatch runs the masked lookup, see [Note: vocabulary-parallel embedding])
        add([R, Shard(0)], P)
    elif family == "reduce":
        reduced = _reduced(shapes[0], params.get("dim"))
        keepdim = params.get("keepdim", False)
        for d in range(len(shapes[0])):
            if d in reduced:
                if rule.reduce_op:
                    add([Shard(d)], Partial(rule.reduce_op))
            else:
                add([Shard(d)], Shard(d if keepdim else d - sum(1 for r in reduced if r < d)))
        if rule.reduce_op == "sum":
            add([P], P)
    elif family == "along_dim":
        for d in range(len(shapes[0])):
            if d != params["dim"] % len(shapes[0]):
                add([Shard(d)] * n_in, Shard(d))
        if rule.partial == "all":
            add([P] * n_in, P)
    elif family == "norm":
        reduced = _reduced(shapes[0], params.get("dim"))
        keepdim = params.get("keepdim", False)
        # without its order the norm of pieces cannot be combined (a sum of p-th powers,
        # or a max for p = inf): the reduced dims are then made whole
        partial = NormPartial(float(params["ord"])) if "ord" in params else None
        for d in range(len(shapes[0])):
            if d in reduced:
                if partial is not None:
                    add([Shard(d)], partial)
            else:
                add([Shard(d)], Shard(d if keepdim else d - sum(1 for r in reduced if r < d)))
        if partial is not None:
            add([partial], partial)
    elif family == "stack":
        dim = params["dim"] % (len(shapes[0]) + 1)
        for d in range(len(shapes[0])):
            add([Shard(d)] * n_in, Shard(d if d < dim else d + 1))
        for partial in sorted(params.get("current", ()), key=repr):
            add([partial] * n_in, partial)
    elif family == "expand":
        offset = len(out_shape) - len(shapes[0])
        for k, size in enumerate(shapes[0]):
            if size == out_shape[k + offset] and size > 1:
                add([Shard(k)], Shard(k + offset))
        add([P], P)
    elif family == "addmm":
        bias = shapes[0]
        for x_pl, y_pl, out in ((Shard(0), R, Shard(0)), (R, Shard(1), Shard(1)), (Shard(1), Shard(0), P),
                                (P, R, P), (R, P, P)):
            add([_aligned(bias, out_shape, out.dim) if isinstance(out, Shard) else out, x_pl, y_pl], out)
    elif family == "like":
        for d in range(len(shapes[0])):
            add([Shard(d)], Shard(d))
        for partial in sorted(params.get("current", ()), key=repr):
            if rule.partial == "all":
                add([partial], partial)
            add([partial], R)
    elif family == "random":
        for d in range(len(shapes[0])):
            add([Shard(d)], Shard(d))
    elif family == "attention":
        if shapes[0][0] > 1:
            add([Shard(0)] * n_in, Shard(0))
        if shapes[0][1] % num == 0 and shapes[1][1] % num == 0:
            add([Shard(1)] * n_in, Shard(1))
    elif family == "embedding_backward":
        ids = shapes[1]
        add([Shard(len(ids)), R], Shard(1))
        for d in range(len(ids)):
            add([Shard(d), Shard(d)], P)
        add([P, R], P)
    elif family == "cross_entropy":
        add([Shard(0), Shard(0)], Shard(0) if params["reduction"] == "none" else P)
    elif family == "transpose":
        d0, d1 = params["dim0"], params["dim1"]
        for d in range(len(shapes[0])):
            add([Shard(d)], Shard(d1 if d == d0 else d0 if d == d1 else d))
        add([P], P)
    elif family == "permute":
        for k, d in enumerate(params["dims"]):
            add([Shard(d)], Shard(k))
        add([P], P)
    elif family == "view":
        _view_strategies(shapes[0], out_shape, params.get("nested", frozenset()), num, add)
        add([P], P)
    add([R] * n_in, R)
    return found


def view_keeps_dim(src: Sequence[int], dst: Sequence[int], dim: int) -> bool:
    """Whether input dim ``dim`` of a reshape ``src -> dst`` becomes one output dim of
    the same size (then nested shards of it stay aligned)."""
    return any(ins == [dim] and len(outs) == 1 for ins, outs in view_groups(src, dst))


def _view_strategies(src: tuple[int, ...], dst: tuple[int, ...], nested: frozenset[int], num: int, add: Any) -> None:
    if 0 in src:
        return
    for ins, outs in view_groups(src, dst):
        if not ins or not outs:
            continue
        d, size = ins[0], src[ins[0]]
        if len(ins) == 1 and len(outs) == 1:
            add([Shard(d)], Shard(outs[0]))
        elif d in nested:
            continue  # chunks of chunks only line up dim for dim
        elif len(ins) == 1:  # split: the sharded dim becomes the first of several
            inner = math.prod(dst[k] for k in outs[1:])
            if -(-size // num) == -(-dst[outs[0]] // num) * inner:
                add([Shard(d)], Shard(outs[0]))
        elif len(outs) == 1:  # merge: the sharded dim is the outermost of those merged
            inner = math.prod(src[k] for k in ins[1:])
            if -(-(size * inner) // num) == -(-size // num) * inner:
                add([Shard(d)], Shard(outs[0]))
