"""A sweep of torch's operator database (``op_db``, shipped with torch) on DTensors: each
op's first samples in float32, every tensor input laid out Replicate, Shard(0) or
Shard(-1) (the samples' odd sizes give uneven shards), each output made whole and
compared with the plain op, forward and gradients. Each case gets a verdict:

- ``ok``: every output and every gradient equals the plain op's;
- ``refused``: an exception whose message names the op (the op_db name, an alias, or
  the framework op it reached, as our refusals and torch's DTensor's name it);
- ``error``: an exception that does not name the op;
- ``wrong``: no exception, but a result or gradient differs from the plain op's;
- ``unchecked``: the plain op's values are undefined or not reproducible (uninitialised
  or random outputs), so only shapes and dtypes are compared (a mismatch is ``wrong``).

A case whose plain op fails on the sample is not counted.

One rank function runs every case of a list of ops on one mesh and returns the verdicts,
so a sweep costs one pooled job per mesh. Every rank runs the same cases in the same
order; after each case the ranks agree on the worst verdict (an all-reduce), so a case
that fails on one rank only is reported as such and cannot leave the others waiting in
a collective of the next case.

On torch the sweep runs this package's DTensor (``impl="ours"``) or torch's own
``torch.distributed.tensor`` (``impl="torch"``, for the comparison in docs/dtensor.md).
On MindSpore the same samples, as numpy arrays, go through the ``mindspore.mint``
function of the same name where one exists (``portable_cases``, ``run_mindspore``),
gradients through ``mindspore.value_and_grad``.
"""

from __future__ import annotations

import itertools
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: float32 results of sharded ops add their terms in another order than the whole op
#: (sharded reductions, Partial sums, a decomposed op's kernels beside the fused one):
#: a few ulps of the largest term of a sum of up to a few hundred. So 1e-4 relative, and
#: 1e-4 absolute scaled by the output's largest finite magnitude (an entry that cancels
#: to near zero carries the error of the large terms it summed).
RTOL, ATOL = 1e-4, 1e-4

#: per mesh axis, the placement of every tensor input: ``R`` Replicate, ``S0`` Shard(0),
#: ``S-1`` Shard(-1) (the last dim); ``mix``: Shard(0), Replicate, Shard(-1) over the
#: inputs in turn (ops of two or more tensors). A 0-dim tensor is always Replicate.
MODES_1D: tuple[tuple[str, ...], ...] = (("R",), ("S0",), ("S-1",), ("mix",))
MODES_2D: tuple[tuple[str, ...], ...] = (("S0", "S-1"), ("S-1", "S0"), ("S0", "S0"))

VERDICTS = ("ok", "unchecked", "refused", "error", "wrong")

#: ops whose output values are undefined (uninitialised memory): shapes and dtypes only
_UNDEFINED_VALUES = re.compile(r"(^|\.|_)empty")


@dataclass(frozen=True)
class Verdict:
    op: str  # op_db name, ".variant" added for a variant
    sample: int
    mode: str  # the placements, e.g. "S0" or "S0,S-1"
    verdict: str  # one of VERDICTS
    detail: str = ""


def op_key(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def float32_ops() -> list[Any]:
    """The OpInfos of ``op_db`` that support float32 on CPU: the swept ops."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def samples(op: Any, count: int) -> list[Any]:
    """The first ``count`` float32 samples of ``op``, seeded (every process builds the
    same ones); none when building them fails here."""
    import torch

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return list(itertools.islice(op.sample_inputs("cpu", torch.float32,
                                                          requires_grad=op.supports_autograd), count))
        except Exception:  # noqa: BLE001 - an op without buildable samples is not swept
            return []


def placement_names(mode: Sequence[str], index: int) -> tuple[str, ...]:
    """The per-axis placement names of tensor input ``index`` under ``mode``."""
    return tuple(("S0", "R", "S-1")[index % 3] if name == "mix" else name for name in mode)


def modes_for(mesh_ndim: int, n_tensors: int, index: int, rotate: bool) -> list[tuple[str, ...]]:
    """The modes a case of ``n_tensors`` tensor inputs runs on a mesh of ``mesh_ndim``
    axes; ``rotate``: only the one that the op's ``index`` picks."""
    modes = [m for m in (MODES_1D if mesh_ndim == 1 else MODES_2D) if m != ("mix",) or n_tensors >= 2]
    return [modes[index % len(modes)]] if rotate else modes


_FIRST_CLAUSE = re.compile(r"^(?:in-place )?([A-Za-z_][\w.]*)(?::| on a DTensor)")


def names_op(message: str, key: str, aliases: Sequence[str], is_op_name: Callable[[str], bool]) -> bool:
    """Whether an error message names the op: the op_db name (whole, or its last dotted
    part), an alias, an ``aten.`` op (torch's DTensor's refusals), our fallback's
    ``DTensor op '...'``, or a message that opens with an op name (``view: ...``,
    ``in-place copy on a DTensor ...``: our rules name the framework op they planned)."""
    text = message.split(": ", 1)[-1]
    lowered = text.lower()
    names = {key, key.split(".")[0], *aliases}
    if "." in key:
        names.add(key.rsplit(".", 1)[0].rsplit(".", 1)[-1])
        names.add(key.rsplit(".", 1)[-1])
    if any(len(n) > 2 and n.lower() in lowered for n in names):
        return True
    if "aten." in lowered or "dtensor op '" in lowered:
        return True
    match = _FIRST_CLAUSE.match(text)
    return bool(match) and is_op_name(match.group(1))


def compare(got: np.ndarray, want: np.ndarray) -> str:
    """'' when ``got`` equals ``want`` (exactly for integers and booleans, within
    RTOL/ATOL for floats), else what differs."""
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if got.dtype.kind in "biu" and want.dtype.kind in "biu":
        same = np.array_equal(got, want)
        return "" if same else f"integer values differ ({int((got != want).sum())} of {got.size})"
    finite = np.abs(want[np.isfinite(want)])
    scale = max(float(finite.max()) if finite.size else 1.0, 1.0)
    ok = np.isclose(got, want, rtol=RTOL, atol=ATOL * scale, equal_nan=True)
    if ok.all():
        return ""
    bad = tuple(int(i) for i in np.argwhere(~ok)[0])
    return f"{int((~ok).sum())} of {ok.size} entries differ, e.g. at {bad}: {got[bad]!r}, expected {want[bad]!r}"


def summarize(verdicts: Sequence[Verdict]) -> dict[str, int]:
    counts = dict.fromkeys(VERDICTS, 0)
    for v in verdicts:
        counts[v.verdict] += 1
    return counts


def _grad_output(shape: Sequence[int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(tuple(shape)).astype(np.float32)


# --------------------------------------------------------------------------- torch


def _torch_numpy(t: Any) -> np.ndarray:
    """A torch tensor's values (conjugate and negative views resolved, zero tensors of
    autograd made real)."""
    import torch

    t = t.detach()
    if t._is_zerotensor():
        return np.zeros(tuple(t.shape), dtype=torch.empty(0, dtype=t.dtype).numpy().dtype)
    return t.resolve_conj().resolve_neg().cpu().numpy()


def _flatten(sample: Any) -> tuple[list[Any], Any]:
    from torch.utils._pytree import tree_flatten

    return tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))


def _call(op: Any, leaves: Sequence[Any], spec: Any) -> list[Any]:
    """The op on the arguments ``leaves`` (rebuilt by ``spec``): its output tensors."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    inp, args, kwargs = tree_unflatten(list(leaves), spec)
    return [leaf for leaf in tree_flatten(op.op(inp, *args, **kwargs))[0] if isinstance(leaf, torch.Tensor)]


@dataclass
class _TorchCase:
    """One sample of one op, with the plain op's results."""

    leaves: list[Any]  # the arguments, tensors detached
    wants_grad: list[bool]  # per leaf: a tensor whose gradient is compared
    spec: Any
    outs: list[Any]
    grads: list[Any] | None  # per leaf that wants a gradient
    defined: bool  # the output values are defined and reproducible


def _torch_reference(op: Any, sample: Any) -> _TorchCase:
    """The plain op on ``sample`` (twice, under different seeds, to tell random or
    uninitialised outputs). Raises what the plain op raises."""
    import torch

    leaves, spec = _flatten(sample)
    base = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    wants = [isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves]

    def run(seed: int) -> tuple[list[Any], list[Any]]:
        torch.manual_seed(seed)
        inputs = [b.clone().requires_grad_(w) if isinstance(b, torch.Tensor) else b for b, w in zip(base, wants)]
        return inputs, _call(op, inputs, spec)

    inputs, outs = run(0)
    _, again = run(1)
    defined = not _UNDEFINED_VALUES.search(op.name) and len(outs) == len(again) and all(
        a.shape == b.shape and torch.equal(a.detach(), b.detach()) for a, b in zip(outs, again))
    grads = None
    diff = [(k, o) for k, o in enumerate(outs) if o.requires_grad and o.dtype.is_floating_point]
    if op.supports_autograd and any(wants) and diff and defined:
        loss = sum((o * torch.from_numpy(_grad_output(o.shape, 100 + k)).to(o.dtype)).sum() for k, o in diff)
        grads = list(torch.autograd.grad(loss, [t for t, w in zip(inputs, wants) if w], allow_unused=True))
    else:
        wants = [False] * len(wants)
    return _TorchCase(base, wants, spec, [o.detach() for o in outs], grads, defined)


def _torch_dtensor_api(impl: str) -> tuple[Any, Any, Any, Any, Any]:
    """``(DTensor, distribute_tensor, init_device_mesh, Replicate, Shard)`` of ``impl``."""
    if impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    else:
        from hyper_parallel import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
    return DTensor, distribute_tensor, init_device_mesh, Replicate, Shard


def _torch_case(op: Any, case: _TorchCase, mesh: Any, mode: Sequence[str], impl: str) -> tuple[str, str]:
    """The verdict of ``op`` on DTensors of ``case``'s inputs laid out by ``mode``."""
    import torch

    DTensor, distribute_tensor, _, Replicate, Shard = _torch_dtensor_api(impl)
    inputs, k = [], 0
    for leaf, wants in zip(case.leaves, case.wants_grad):
        if isinstance(leaf, torch.Tensor):
            names = placement_names(mode, k) if leaf.dim() else ("R",) * len(mode)
            k += 1
            pl = [Replicate() if n == "R" else Shard(0) if n == "S0" else Shard(leaf.dim() - 1) for n in names]
            leaf = distribute_tensor(leaf.clone(), mesh, pl).requires_grad_(wants)
        inputs.append(leaf)
    torch.manual_seed(0)
    got = _call(op, inputs, case.spec)
    whole = [o.full_tensor() if isinstance(o, DTensor) else o for o in got]
    if len(whole) != len(case.outs):
        return "wrong", f"{len(whole)} outputs, expected {len(case.outs)}"
    for k, (g, w) in enumerate(zip(whole, case.outs)):
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            return "wrong", f"output {k}: {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
        why = compare(_torch_numpy(g), _torch_numpy(w)) if case.defined else ""
        if why:
            return "wrong", f"output {k}: {why}"
    if not case.defined:
        return "unchecked", "output values undefined or random"
    if case.grads is None:
        return "ok", ""
    diff = [(k, o) for k, o in enumerate(whole) if o.requires_grad and o.dtype.is_floating_point]
    if not diff:
        return "wrong", "no output requires grad"
    loss = sum((o * torch.from_numpy(_grad_output(o.shape, 100 + k)).to(o.dtype)).sum() for k, o in diff)
    got_grads = torch.autograd.grad(loss, [t for t, w in zip(inputs, case.wants_grad) if w], allow_unused=True)
    for k, (g, w) in enumerate(zip(got_grads, case.grads)):
        if (g is None) != (w is None):
            return "wrong", f"gradient {k}: {'none' if g is None else 'a gradient'}, expected the other"
        if g is not None:
            why = compare(_torch_numpy(g.full_tensor() if isinstance(g, DTensor) else g), _torch_numpy(w))
            if why:
                return "wrong", f"gradient {k}: {why}"
    return "ok", ""


def _agree(verdict: str, detail: str, all_reduce_max: Callable[[int], int]) -> tuple[str, str]:
    """Every rank's worst verdict; the detail stays this rank's when it is its own."""
    agreed = VERDICTS[all_reduce_max(VERDICTS.index(verdict))]
    return agreed, detail if agreed == verdict else f"on another rank; here: {verdict} {detail}".strip()


def _classify(err: BaseException, key: str, aliases: Sequence[str], is_op_name: Callable[[str], bool]) -> tuple[str, str]:
    message = f"{type(err).__name__}: {err}"
    first = message.splitlines()[0][:300]
    return ("refused" if names_op(message, key, aliases, is_op_name) else "error"), first


def run_torch(impl: str, mesh_shape: tuple[int, ...], ops: Sequence[str] | None = None, per_op: int = 1,
              rotate: bool = False, trace: bool = False) -> list[Verdict]:
    """Rank function (torch): every case of ``ops`` (op_db keys; ``None``: every float32
    op) on a mesh of ``mesh_shape``, the first ``per_op`` samples each, under ``impl``
    (``"ours"`` or ``"torch"``); ``rotate``: one mode per op (see ``modes_for``);
    ``trace``: print each exception's traceback. The same verdicts on every rank."""
    import torch
    import torch.distributed as dist

    _, _, init_device_mesh, _, _ = _torch_dtensor_api(impl)
    mesh = init_device_mesh("cpu", mesh_shape)

    def all_reduce_max(value: int) -> int:
        t = torch.tensor([value])
        dist.all_reduce(t, dist.ReduceOp.MAX)
        return int(t)

    from hyper_parallel.core.dtensor import OP_RULES

    def is_op_name(name: str) -> bool:
        return name in OP_RULES or hasattr(torch.ops.aten, name.split(".")[0])

    verdicts: list[Verdict] = []
    selected = [op for op in float32_ops() if ops is None or op_key(op) in ops]
    for index, op in enumerate(selected):
        key, aliases = op_key(op), [a.name for a in op.aliases]
        for s, sample in enumerate(samples(op, per_op)):
            try:
                case = _torch_reference(op, sample)
            except Exception:  # noqa: BLE001 - the plain op refuses its own sample: nothing to compare
                continue
            n_tensors = sum(isinstance(leaf, torch.Tensor) for leaf in case.leaves)
            for mode in modes_for(len(mesh_shape), n_tensors, index, rotate):
                if trace:
                    print(f"rank {dist.get_rank()}: {key} [{','.join(mode)}]", file=sys.stderr, flush=True)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        verdict, detail = _torch_case(op, case, mesh, mode, impl)
                except Exception as err:  # noqa: BLE001 - the verdict records it
                    if trace:
                        import traceback

                        traceback.print_exc()
                    verdict, detail = _classify(err, key, aliases, is_op_name)
                verdict, detail = _agree(verdict, detail, all_reduce_max)
                verdicts.append(Verdict(key, s, ",".join(mode), verdict, detail))
    return verdicts


def merge(per_rank: Sequence[Sequence[Verdict]]) -> list[Verdict]:
    """One list from every rank's (the same verdicts, case by case): each case with the
    detail of a rank that found its verdict itself."""
    merged = []
    for cases in zip(*per_rank):
        own = [v for v in cases if not v.detail.startswith("on another rank")]
        merged.append(own[0] if own else cases[0])
    return merged


def sweep_torch(impl: str, mesh_shape: tuple[int, ...], ops: Sequence[str] | None = None, per_op: int = 1,
                rotate: bool = False, trace: bool = False) -> list[Verdict]:
    """``run_torch`` for the pool (``merge`` the ranks' lists)."""
    return run_torch(impl, mesh_shape, ops, per_op, rotate, trace)


# --------------------------------------------------------------------------- MindSpore


@dataclass(frozen=True)
class Array:
    """A tensor argument as numpy values; ``grad``: its gradient is compared."""

    value: np.ndarray
    grad: bool


@dataclass(frozen=True)
class DType:
    """A dtype argument, by name (``float32``)."""

    name: str


@dataclass(frozen=True)
class PortableCase:
    """One sample of one op, in framework-free values: ``(input, args, kwargs)`` with
    ``Array`` for tensors and ``DType`` for dtypes."""

    op: str  # op_db key
    function: str  # the op_db name: the mint function of that name runs it
    aliases: tuple[str, ...]
    index: int  # the op's position in op_db (picks its mode when rotating)
    sample: int
    call: tuple[Any, tuple[Any, ...], dict[str, Any]]


class _NotPortable(Exception):
    pass


def _portable(value: Any, grad_ok: bool) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype not in (torch.float32, torch.int64, torch.int32, torch.bool):
            raise _NotPortable(str(value.dtype))
        return Array(value.detach().numpy().copy(), bool(value.requires_grad and grad_ok))
    if isinstance(value, torch.dtype):
        return DType(str(value).split(".")[-1])
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v, grad_ok) for v in value)
    if isinstance(value, dict):
        return {k: _portable(v, grad_ok) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _NotPortable(type(value).__name__)


def mint_function(name: str) -> Callable[..., Any] | None:
    """``mindspore.mint``'s function of the dotted op_db ``name``, or None."""
    from mindspore import mint

    obj: Any = mint
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if callable(obj) else None


def portable_cases(names: Sequence[str], per_op: int = 1) -> list[PortableCase]:
    """The first ``per_op`` float32 samples of the op_db ops named ``names`` (op_db names,
    each with every variant) as framework-free values; samples holding what has no numpy
    form (complex tensors, generators, memory formats) are left out. Needs torch."""
    out = []
    for index, op in enumerate(float32_ops()):
        if op.name not in names:
            continue
        for s, sample in enumerate(samples(op, per_op)):
            try:
                call = (_portable(sample.input, op.supports_autograd),
                        tuple(_portable(a, op.supports_autograd) for a in sample.args),
                        {k: _portable(v, op.supports_autograd) for k, v in sample.kwargs.items()})
            except _NotPortable:
                continue
            out.append(PortableCase(op_key(op), op.name, tuple(a.name for a in op.aliases), index, s, call))
    return out


def _ms_map(value: Any, fn: Callable[[Array], Any]) -> Any:
    """``value`` with each ``Array`` replaced by ``fn(array)`` and each ``DType`` by
    MindSpore's dtype."""
    import mindspore

    if isinstance(value, Array):
        return fn(value)
    if isinstance(value, DType):
        return getattr(mindspore, value.name)
    if isinstance(value, (list, tuple)):
        return type(value)(_ms_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _ms_map(v, fn) for k, v in value.items()}
    return value


def _arrays(value: Any) -> list[Array]:
    if isinstance(value, Array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    return []


def _ms_outputs(out: Any) -> list[Any]:
    import mindspore

    if isinstance(out, mindspore.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _ms_outputs(v)]
    return []


def _ms_run(fn: Callable[..., Any], case: PortableCase, tensors: Sequence[Any]) -> list[Any]:
    """``fn`` on ``case``'s call with its arrays replaced, in order, by ``tensors``."""
    it = iter(tensors)
    inp, args, kwargs = _ms_map(case.call, lambda _: next(it))
    return _ms_outputs(fn(inp, *args, **kwargs))


def _ms_numpy(t: Any) -> np.ndarray:
    return t.asnumpy()


def _ms_loss(outs: Sequence[Any]) -> Any:
    """The sum of each float output times its fixed random gradient, or None when no
    output is float."""
    import mindspore
    from mindspore import mint

    terms = [mint.sum(o * mindspore.Tensor(_grad_output(o.shape, 100 + k))) for k, o in enumerate(outs)
             if o.dtype in (mindspore.float32,)]
    if not terms:
        return None
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def run_mindspore(mesh_shape: tuple[int, ...], cases: Sequence[PortableCase], rotate: bool = False,
                  trace: bool = False) -> list[Verdict]:
    """Rank function (MindSpore): each case through ``mindspore.mint``'s function of its
    name, plain and on this package's DTensors, on a mesh of ``mesh_shape`` (see
    ``run_torch``). Gradients through ``mindspore.value_and_grad``."""
    import mindspore

    from hyper_parallel import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.platform import get_platform

    p = get_platform()
    mesh = init_device_mesh(p.device_type, mesh_shape)

    def all_reduce_max(value: int) -> int:
        t = p.from_numpy(np.array([value], np.int32))
        return int(p.to_numpy(p.all_reduce(t, "max").wait())[0])

    from hyper_parallel.core.dtensor import OP_RULES

    def is_op_name(name: str) -> bool:
        return name in OP_RULES or name[:1].isupper() or hasattr(mindspore.mint, name)

    verdicts: list[Verdict] = []
    for case in cases:
        fn = mint_function(case.function)
        if fn is None:
            continue
        arrays = _arrays(case.call)
        grads_at = tuple(i for i, a in enumerate(arrays) if a.grad)
        try:
            reference = _ms_reference(fn, case, arrays, grads_at)
        except Exception:  # noqa: BLE001 - the plain mint op refuses this sample: nothing to compare
            continue
        for mode in modes_for(len(mesh_shape), len(arrays), case.index, rotate):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    verdict, detail = _ms_case(fn, case, arrays, grads_at, reference, mesh, mode,
                                               (DTensor, Replicate, Shard, distribute_tensor))
            except Exception as err:  # noqa: BLE001 - the verdict records it
                if trace:
                    import traceback

                    traceback.print_exc()
                verdict, detail = _classify(err, case.op, case.aliases, is_op_name)
            verdict, detail = _agree(verdict, detail, all_reduce_max)
            verdicts.append(Verdict(case.op, case.sample, ",".join(mode), verdict, detail))
    return verdicts


def _ms_reference(fn: Callable[..., Any], case: PortableCase, arrays: Sequence[Array],
                  grads_at: tuple[int, ...]) -> tuple[list[np.ndarray], list[np.ndarray] | None, bool]:
    """The plain mint op: (outputs, gradients of the arrays at ``grads_at`` or None,
    whether the outputs are defined: reproducible under another seed)."""
    import mindspore

    tensors = [mindspore.Tensor(a.value) for a in arrays]
    mindspore.set_seed(0)
    outs = [_ms_numpy(o) for o in _ms_run(fn, case, tensors)]
    mindspore.set_seed(1)
    again = [_ms_numpy(o) for o in _ms_run(fn, case, tensors)]
    defined = not _UNDEFINED_VALUES.search(case.function) and len(outs) == len(again) and all(
        a.shape == b.shape and np.array_equal(a, b, equal_nan=True) for a, b in zip(outs, again))
    grads = None
    if grads_at and defined:
        grads = _ms_grads(lambda *ts: _ms_loss(_ms_run(fn, case, ts)), tensors, grads_at)
    return outs, grads, defined


def _ms_grads(loss_fn: Callable[..., Any], tensors: Sequence[Any], grads_at: tuple[int, ...]) -> list[np.ndarray] | None:
    import mindspore

    probe = loss_fn(*tensors)
    if probe is None:
        return None
    _, grads = mindspore.value_and_grad(loss_fn, grad_position=grads_at)(*tensors)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return [_ms_numpy(g) for g in grads]


def _ms_case(fn: Callable[..., Any], case: PortableCase, arrays: Sequence[Array], grads_at: tuple[int, ...],
             reference: tuple[list[np.ndarray], list[np.ndarray] | None, bool], mesh: Any, mode: Sequence[str],
             api: tuple[Any, ...]) -> tuple[str, str]:
    import mindspore

    DTensor, Replicate, Shard, distribute_tensor = api
    outs, grads, defined = reference
    placements = []
    for k, a in enumerate(arrays):
        names = placement_names(mode, k) if a.value.ndim else ("R",) * len(mode)
        placements.append([Replicate() if n == "R" else Shard(0) if n == "S0" else Shard(a.value.ndim - 1)
                           for n in names])
    # the local pieces are what value_and_grad differentiates (a DTensor is made from its
    # local tensor inside the function, so the gradient of each piece comes back)
    # src_data_rank=None: every rank holds the same sample (no broadcast)
    locals_ = [distribute_tensor(mindspore.Tensor(a.value), mesh, pl, src_data_rank=None).to_local()
               for a, pl in zip(arrays, placements)]

    def on_dtensors(*pieces: Any) -> list[Any]:
        dts = [DTensor.from_local(t, mesh, pl, shape=a.value.shape) for t, pl, a in zip(pieces, placements, arrays)]
        got = _ms_run(fn, case, dts)
        return [o.full_tensor() if isinstance(o, DTensor) else o for o in got]

    mindspore.set_seed(0)
    whole = on_dtensors(*locals_)
    if len(whole) != len(outs):
        return "wrong", f"{len(whole)} outputs, expected {len(outs)}"
    for k, (g, w) in enumerate(zip(whole, outs)):
        g = _ms_numpy(g)
        if g.shape != w.shape or g.dtype != w.dtype:
            return "wrong", f"output {k}: {g.shape} {g.dtype}, expected {w.shape} {w.dtype}"
        why = compare(g, w) if defined else ""
        if why:
            return "wrong", f"output {k}: {why}"
    if not defined:
        return "unchecked", "output values undefined or random"
    if grads is None:
        return "ok", ""
    got_grads = _ms_grads(lambda *ts: _ms_loss(on_dtensors(*ts)), locals_, grads_at)
    if got_grads is None:
        return "wrong", "no float output"
    for k, (g, w, i) in enumerate(zip(got_grads, grads, grads_at)):
        # each rank's gradient is its piece's: compare with the same piece of the whole one
        piece = distribute_tensor(mindspore.Tensor(w), mesh, placements[i], src_data_rank=None).to_local()
        why = compare(g, _ms_numpy(piece))
        if why:
            return "wrong", f"gradient {k}: {why}"
    return "ok", ""


def sweep_mindspore(mesh_shape: tuple[int, ...], cases: Sequence[PortableCase], rotate: bool = False,
                    trace: bool = False) -> list[Verdict]:
    """``run_mindspore`` for the pool (``merge`` the ranks' lists)."""
    return run_mindspore(mesh_shape, cases, rotate, trace)
