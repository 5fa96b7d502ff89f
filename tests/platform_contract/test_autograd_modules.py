"""Conformance: custom functions, vjp, grad mode, module hooks, module tree, parameter
replacement. World size 1: none of this communicates."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import CustomFunction
from tests.platform_contract._data import close, rank_data
from tests.platform_contract._models import build_keyword_scale, build_mlp, mlp_numpy, mlp_weights
from hyper_parallel.core.tensor_ops import clone


class _ScaleAndShift(CustomFunction):
    """y = a * x + b with a non-tensor ``a``; a hand-written backward that doubles as a
    check that ``ctx`` carries attributes and that None gradients are accepted."""

    @staticmethod
    def forward(ctx, x, b, a):
        ctx.a = a
        return x * a + b

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.a, grad, None


def check_apply_function() -> None:
    p = get_platform()
    x, b, g = rank_data(0, (3, 4)), rank_data(1, (3, 4)), rank_data(2, (3, 4))
    out, backward = p.vjp(lambda x_, b_: p.apply_function(_ScaleAndShift, x_, b_, 3.0),
                          [p.from_numpy(x), p.from_numpy(b)])
    close(p.to_numpy(out), 3 * x + b, "custom function forward")
    (gx, gb), params = backward([p.from_numpy(g)])
    close(p.to_numpy(gx), 3 * g, "custom function backward")
    close(p.to_numpy(gb), g, "custom function second input")
    assert params == ()


def test_apply_function(run_on_ranks) -> None:
    run_on_ranks(check_apply_function, world_size=1)


def check_vjp_and_hooks() -> None:
    p = get_platform()
    weights = mlp_weights(4, 5, 3)
    model = build_mlp(p, weights)
    assert [name for name, _ in p.named_modules(model)] == ["", "fc1", "fc2"]
    params = list(p.named_parameters(model))
    assert [name for name, _ in params] == list(weights)
    events: list[str] = []
    handles = [
        p.register_forward_pre_hook(model.fc1, lambda m, args: events.append("pre")),
        p.register_forward_hook(model.fc1, lambda m, args, out: events.append("fwd")),
        p.register_full_backward_pre_hook(model.fc2, lambda m, grad_out: events.append("bwd_pre")),
    ]
    x = rank_data(0, (6, 4))
    g = rank_data(1, (6, 3))
    assert p.grad_enabled()
    out, backward = p.vjp(model, [p.from_numpy(x)], [param for _, param in params])
    close(p.to_numpy(out), mlp_numpy(weights, x), "mlp forward")
    assert events == ["pre", "fwd"], events
    (gx,), param_grads = backward([p.from_numpy(g)])
    assert events[2:] == ["bwd_pre"], events

    pre = x @ weights["fc1.weight"].T + weights["fc1.bias"]
    h = np.maximum(pre, 0.0)
    gh = (g @ weights["fc2.weight"]) * (pre > 0)
    expected = {"fc1.weight": gh.T @ x, "fc1.bias": gh.sum(0), "fc2.weight": g.T @ h, "fc2.bias": g.sum(0)}
    close(p.to_numpy(gx), gh @ weights["fc1.weight"], "input gradient")
    for (name, _), grad in zip(params, param_grads):
        close(p.to_numpy(grad), expected[name], f"gradient of {name}")

    for handle in handles:
        handle.remove()
    events.clear()
    with p.no_grad():
        assert not p.grad_enabled()
        model(p.from_numpy(x))
    assert events == [], "removed hooks still fired"


def test_vjp_and_module_hooks(run_on_ranks) -> None:
    run_on_ranks(check_vjp_and_hooks, world_size=1)


def check_forward_pre_hook_with_kwargs() -> None:
    p = get_platform()
    model = build_keyword_scale(p)
    x, s, t = (rank_data(i, (2, 3)) for i in range(3))
    seen: list[tuple[int, list[str]]] = []

    def swap(module, args, kwargs):
        # sees the call's positional and keyword arguments; replaces both
        seen.append((len(args), sorted(kwargs)))
        assert module is model
        return (args[0] * 2.0,), dict(kwargs, shift=kwargs["scale"])

    handle = p.register_forward_pre_hook(model, swap, with_kwargs=True)
    out, backward = p.vjp(lambda x_, s_: model(x_, scale=s_), [p.from_numpy(x), p.from_numpy(s)])
    assert seen == [(1, ["scale"])], seen
    close(p.to_numpy(out), 2 * x * s + s, "forward with replaced args and kwargs")
    (gx, gs), _ = backward([p.from_numpy(t)])
    close(p.to_numpy(gx), 2 * s * t, "gradient through a replaced positional argument")
    close(p.to_numpy(gs), (2 * x + 1) * t, "gradient through a replaced keyword argument")
    handle.remove()

    observed: list[str] = []
    handles = [p.register_forward_pre_hook(model, lambda m, args, kwargs: observed.append("none"), with_kwargs=True),
               p.register_forward_pre_hook(model, lambda m, args, kwargs: observed.append("kw") or
                                           ((args[0] * 2.0,), kwargs), with_kwargs=True),
               p.register_forward_pre_hook(model, lambda m, args: observed.append("plain") or (args[0] + 1.0,))]
    # in registration order, each seeing the previous one's result; None changes nothing
    close(p.to_numpy(model(p.from_numpy(x), scale=p.from_numpy(s))), (2 * x + 1) * s, "chained pre-hooks")
    assert observed == ["none", "kw", "plain"], observed
    for h in handles:
        h.remove()
    model(p.from_numpy(x), scale=p.from_numpy(s))
    assert observed == ["none", "kw", "plain"], "removed hooks still fired"


def test_forward_pre_hook_with_kwargs(run_on_ranks) -> None:
    run_on_ranks(check_forward_pre_hook_with_kwargs, world_size=1)


def check_set_parameter() -> None:
    p = get_platform()
    weights = mlp_weights(4, 5, 3)
    model = build_mlp(p, weights)
    doubled = {k: 2 * v for k, v in weights.items()}
    new = p.make_parameter(p.from_numpy(doubled["fc2.weight"]))
    p.set_parameter(model, "fc2.weight", new)
    assert dict(p.named_parameters(model))["fc2.weight"] is new
    x = rank_data(0, (2, 4))
    mixed = dict(weights, **{"fc2.weight": doubled["fc2.weight"]})
    close(p.to_numpy(model(p.from_numpy(x))), mlp_numpy(mixed, x), "forward after set_parameter")
    try:
        p.set_parameter(model, "fc3.weight", new)
    except KeyError as err:
        assert "fc3.weight" in str(err) and "fc2.weight" in str(err), str(err)
    else:
        raise AssertionError("set_parameter accepted a missing fqn")



def test_set_parameter(run_on_ranks) -> None:
    run_on_ranks(check_set_parameter, world_size=1)


def check_vjp_backwards_out_of_order() -> None:
    """Several live recordings whose backwards run oldest first, newest first, and
    after a newer recording was dropped unrun (a pipeline's 1F1B and an eval forward)."""
    p = get_platform()
    weights = mlp_weights(4, 5, 3)
    model = build_mlp(p, weights)
    params = [param for _, param in p.named_parameters(model)]
    p.register_forward_hook(model.fc1, lambda m, args, out: out * 1.0)  # a hooked model
    xs = [rank_data(i, (2, 4)) for i in range(5)]
    gs = [rank_data(10 + i, (2, 3)) for i in range(5)]

    def expected(i: int) -> np.ndarray:
        pre = xs[i] @ weights["fc1.weight"].T + weights["fc1.bias"]
        return gs[i].T @ np.maximum(pre, 0.0)  # fc2.weight's gradient

    recordings = {i: p.vjp(model, [p.from_numpy(xs[i])], params) for i in range(3)}
    for i in (0, 2, 1):
        _, param_grads = recordings.pop(i)[1]([p.from_numpy(gs[i])])
        close(p.to_numpy(param_grads[2]), expected(i), f"recording {i} run out of order")
    kept = p.vjp(model, [p.from_numpy(xs[3])], params)
    p.vjp(model, [p.from_numpy(xs[4])], params)  # dropped without a backward
    _, param_grads = kept[1]([p.from_numpy(gs[3])])
    close(p.to_numpy(param_grads[2]), expected(3), "recording older than a dropped one")
    out, backward = p.vjp(model, [p.from_numpy(xs[4])], params)
    _, param_grads = backward([p.from_numpy(gs[4])])
    close(p.to_numpy(param_grads[2]), expected(4), "recording after a dropped one")


def test_vjp_backwards_out_of_order(run_on_ranks) -> None:
    run_on_ranks(check_vjp_backwards_out_of_order, world_size=1)


class _Identity(CustomFunction):
    """Hands out a copy of a tensor made outside the recording, as fully_shard's gather does."""

    @staticmethod
    def forward(ctx, x, source):
        return clone(source)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def check_release_saved_tensors() -> None:
    """A weight saved for backward by a matrix product inside ``release_saved_tensors``
    is not kept: the backward reads what ``reload`` returns (here twice the forward's
    values, so a kept tensor would show)."""
    p = get_platform()
    w0, x0 = rank_data(1, (4, 3)), rank_data(2, (2, 4))
    reloads: list[int] = []

    def reload(index: int):
        reloads.append(index)
        return p.from_numpy(w0 * 2.0)

    def fn(x, leaf):
        with p.no_grad():
            source = p.from_numpy(w0)
        w = p.apply_function(_Identity, leaf, source)
        with p.release_saved_tensors([w], reload):
            out = x @ w
        return out

    x, leaf = p.from_numpy(x0), p.from_numpy(w0)
    _, backward = p.vjp(fn, [x, leaf])
    (dx, dleaf), _ = backward([p.from_numpy(np.ones((2, 3), np.float32))])
    close(p.to_numpy(dx), np.ones((2, 3), np.float32) @ (w0 * 2.0).T, "input gradient read from the reloaded weight")
    close(p.to_numpy(dleaf), x0.T @ np.ones((2, 3), np.float32), "weight gradient")
    assert reloads and set(reloads) == {0}, reloads


def test_release_saved_tensors(run_on_ranks) -> None:
    run_on_ranks(check_release_saved_tensors, world_size=1)


def check_release_saved_tensors_offload() -> None:
    """``offload=(pack, unpack)``: a saved activation goes to ``pack`` and the backward
    reads what ``unpack`` returns (here three times the values, so a kept tensor would
    show), while the weight is taken by another ``release_saved_tensors`` context (its
    ``reload``, twice the values), whether that context is entered around the offload
    context or inside it ([Note: stacked saved-tensor contexts])."""
    p = get_platform()
    w0, x0 = rank_data(1, (4, 3)), rank_data(2, (2, 4))
    for release_outside in (True, False):
        offered: list[tuple[int, ...]] = []

        def pack(tensor):
            offered.append(tuple(tensor.shape))
            return ("held", tensor)

        def fn(x, leaf):
            with p.no_grad():
                source = p.from_numpy(w0)
            w = p.apply_function(_Identity, leaf, source)
            release = p.release_saved_tensors([w], lambda index: p.from_numpy(w0 * 2.0))
            offload = p.release_saved_tensors([], lambda index: None, offload=(pack, lambda held: held[1] * 3.0))
            with release if release_outside else offload:
                with offload if release_outside else release:
                    out = x @ w
            return out

        _, backward = p.vjp(fn, [p.from_numpy(x0), p.from_numpy(w0)])
        (dx, dleaf), _ = backward([p.from_numpy(np.ones((2, 3), np.float32))])
        where = "release outside" if release_outside else "release inside"
        assert offered == [(2, 4)], (where, offered)
        close(p.to_numpy(dx), np.ones((2, 3), np.float32) @ (w0 * 2.0).T, f"{where}: input gradient, reloaded weight")
        close(p.to_numpy(dleaf), (x0 * 3.0).T @ np.ones((2, 3), np.float32), f"{where}: weight gradient, unpacked x")


def test_release_saved_tensors_offload(run_on_ranks) -> None:
    run_on_ranks(check_release_saved_tensors_offload, world_size=1)


def check_release_saved_tensors_frees_unused_branch() -> None:
    """Tensors that ops save as their own output (``exp``, ``amax``) inside
    ``release_saved_tensors``, on a branch the backward never runs (attention's detached
    row max), are freed with the branch: a pack hook that keeps the output itself, with
    its grad_fn, forms a reference cycle through the framework's graph that Python's gc
    cannot break, and fully_shard then leaked such tensors on every step."""
    p = get_platform()
    w0, x0 = rank_data(1, (4, 3)), rank_data(2, (2, 4))
    refs: list[weakref.ref] = []

    def fn(x, w):
        with p.release_saved_tensors([], lambda index: None):
            for branch in (x.exp(), x.amax(-1)):
                refs.append(weakref.ref(branch))
            out = x @ w
        return out

    for _ in range(3):
        _, backward = p.vjp(fn, [p.from_numpy(x0), p.from_numpy(w0)])
        backward([p.from_numpy(np.ones((2, 3), np.float32))])
        del backward
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} unused-branch tensors are still alive: {[tuple(t.shape) for t in alive]}"


def test_release_saved_tensors_frees_unused_branch(run_on_ranks) -> None:
    run_on_ranks(check_release_saved_tensors_frees_unused_branch, world_size=1)


def check_getitem_with_index_tensor() -> None:
    """``t[index]`` with an int64 index tensor picks rows of dim 0 (repeats allowed) and
    its gradient adds each output row's gradient into its source row (MoE dispatch)."""
    p = get_platform()
    x, g = rank_data(0, (4, 3)), rank_data(1, (5, 3))
    index = np.array([2, 0, 2, 3, 1], np.int64)
    out, backward = p.vjp(lambda t: t[p.from_numpy(index)], [p.from_numpy(x)])
    close(p.to_numpy(out), x[index], "rows picked by an index tensor")
    (gx,), _ = backward([p.from_numpy(g)])
    expected = np.zeros_like(x)
    np.add.at(expected, index, g)
    close(p.to_numpy(gx), expected, "gradient of the picked rows")


def test_getitem_with_index_tensor(run_on_ranks) -> None:
    run_on_ranks(check_getitem_with_index_tensor, world_size=1)


def check_vjp_split_backward() -> None:
    """``part="input"`` then ``part="weight"`` give the gradients of one ``part="all"``
    backward, also when a newer recording's backward ran in between (a zero-bubble
    pipeline defers W behind later microbatches); misuse raises."""
    p = get_platform()
    weights = mlp_weights(4, 5, 3)
    model = build_mlp(p, weights)
    params = [param for _, param in p.named_parameters(model)]
    xs = [rank_data(20 + i, (2, 4)) for i in range(2)]
    gs = [rank_data(30 + i, (2, 3)) for i in range(2)]
    full = []
    for i in range(2):
        (gx,), gp = p.vjp(model, [p.from_numpy(xs[i])], params)[1]([p.from_numpy(gs[i])])
        full.append((p.to_numpy(gx), [p.to_numpy(g) for g in gp]))
    older = p.vjp(model, [p.from_numpy(xs[0])], params)[1]
    newer = p.vjp(model, [p.from_numpy(xs[1])], params)[1]
    split = {}
    for i, backward in ((1, newer), (0, older)):
        (gx,), none = backward([p.from_numpy(gs[i])], part="input")
        assert none == (), "the input part returns no parameter gradients"
        split[i] = [gx]
    for i, backward in ((0, older), (1, newer)):
        none, gp = backward([p.from_numpy(gs[i])], part="weight")
        assert none == (), "the weight part returns no input gradients"
        split[i].append(gp)
    for i in range(2):
        close(p.to_numpy(split[i][0]), full[i][0], f"input gradient of recording {i}, split backward")
        for got, want in zip(split[i][1], full[i][1]):
            close(p.to_numpy(got), want, f"parameter gradient of recording {i}, split backward")
    backward = p.vjp(model, [p.from_numpy(xs[0])], params)[1]
    with pytest.raises(RuntimeError, match="part='weight' after nothing"):
        backward([p.from_numpy(gs[0])], part="weight")
    with pytest.raises(ValueError, match="part='both' must be 'all', 'input' or 'weight'"):
        backward([p.from_numpy(gs[0])], part="both")


def test_vjp_split_backward(run_on_ranks) -> None:
    run_on_ranks(check_vjp_split_backward, world_size=1)


def check_linear_modules_and_replaced_forward() -> None:
    """``named_modules(linear_only=True)`` lists the linear layers only;
    ``register_forward_hook(replace_forward=True)`` runs the hook instead of the forward
    (which it may call), inside the pre/post hooks, and ``remove`` restores it."""
    p = get_platform()
    weights = mlp_weights(4, 5, 3)
    model = build_mlp(p, weights)
    assert [name for name, _ in p.named_modules(model, linear_only=True)] == ["fc1", "fc2"]
    assert [name for name, _ in p.named_modules(model.fc1, linear_only=True)] == [""]
    x = rank_data(0, (6, 4))
    events: list[str] = []

    def twice(module, args, forward):
        assert module is model.fc2 and len(args) == 1
        events.append("replaced")
        return forward(*args) * 2.0

    pre = p.register_forward_pre_hook(model.fc2, lambda m, args: events.append("pre"))
    post = p.register_forward_hook(model.fc2, lambda m, args, out: events.append("post"))
    handle = p.register_forward_hook(model.fc2, twice, replace_forward=True)
    close(p.to_numpy(model(p.from_numpy(x))), 2.0 * mlp_numpy(weights, x), "replaced forward")
    assert events == ["pre", "replaced", "post"], events
    inner = p.register_forward_hook(model.fc2, lambda m, args, forward: forward(*args) + 1.0, replace_forward=True)
    with pytest.raises(RuntimeError, match="remove replacements in the reverse order"):
        handle.remove()
    close(p.to_numpy(model(p.from_numpy(x))), 2.0 * mlp_numpy(weights, x) + 1.0, "two replacements")
    inner.remove()
    handle.remove()
    for h in (pre, post):
        h.remove()
    events.clear()
    close(p.to_numpy(model(p.from_numpy(x))), mlp_numpy(weights, x), "forward restored")
    assert events == []


def test_linear_modules_and_replaced_forward(run_on_ranks) -> None:
    run_on_ranks(check_linear_modules_and_replaced_forward, world_size=1)


def check_recompute() -> None:
    """``recompute``: the output and every gradient equal the plain forward's bit for bit;
    the forward (with its module hooks) runs once more, recording, during the backward;
    and what the operations inside save is not handed to enclosing saved-tensor hooks
    (fully_shard's ``release_saved_tensors``): a weight read inside gets its gradient
    through the first forward's graph and ``reload`` is never asked for it."""
    p = get_platform()
    weights = mlp_weights(4, 5, 3)
    model = build_mlp(p, weights)
    params = [param for _, param in p.named_parameters(model)]
    x, g = rank_data(0, (6, 4)), rank_data(1, (6, 3))
    calls: list[bool] = []
    handle = p.register_forward_pre_hook(model.fc1, lambda m, args: calls.append(p.grad_enabled()))
    results = {}
    for checkpointed in (False, True):
        calls.clear()
        fn = (lambda x_: p.recompute(model, x_)) if checkpointed else model
        out, backward = p.vjp(fn, [p.from_numpy(x)], params)
        assert len(calls) == 1, calls
        (gx,), gp = backward([p.from_numpy(g)])
        assert calls == ([True, True] if checkpointed else [True]), f"forward calls with recompute={checkpointed}: {calls}"
        results[checkpointed] = [p.to_numpy(t) for t in (out, gx, *gp)]
    handle.remove()
    for name, plain, again in zip(["output", "input gradient", *weights], results[False], results[True]):
        np.testing.assert_array_equal(again, plain, err_msg=f"recompute changed the {name}")

    w0, x0 = rank_data(1, (4, 3)), rank_data(2, (2, 4))
    ones = np.ones((2, 3), np.float32)
    for checkpointed in (False, True):
        reloads: list[int] = []

        def reload(index: int):
            reloads.append(index)
            return p.from_numpy(w0)

        def outer(x_, leaf):
            with p.no_grad():
                source = p.from_numpy(w0)
            w = p.apply_function(_Identity, leaf, source)
            with p.release_saved_tensors([w], reload):
                inner = lambda t: (t @ w) * 2.0  # noqa: E731 - the matmul saves w and t
                return p.recompute(inner, x_) if checkpointed else inner(x_)

        _, backward = p.vjp(outer, [p.from_numpy(x0), p.from_numpy(w0)])
        (dx, dleaf), _ = backward([p.from_numpy(ones)])
        close(p.to_numpy(dx), 2.0 * ones @ w0.T, f"input gradient, recompute={checkpointed}")
        close(p.to_numpy(dleaf), 2.0 * x0.T @ ones, f"weight gradient through the first forward, recompute={checkpointed}")
        assert (reloads == []) if checkpointed else (reloads != []), \
            f"recompute={checkpointed}: the enclosing hooks reloaded {reloads}"


def test_recompute(run_on_ranks) -> None:
    run_on_ranks(check_recompute, world_size=1)


def check_recompute_keep() -> None:
    """``recompute(keep=)``: ``keep`` is asked once per operation of the forward, with the
    operation's output; a kept output is the forward's own in the backward, a recomputed
    one is computed again. Told apart by writing into ``s`` between the forward and the
    backward: ``y = (x * s) ** 2`` as ``h * h``, ``dy/dx = 2 h s`` with ``h`` the product
    (kept: the forward's ``x * s``; recomputed: ``x * s`` of the new ``s``) and ``s`` read
    again by the recomputation either way (an input the product saves)."""
    p = get_platform()
    x0, s0 = rank_data(0, (3, 4)), rank_data(1, (3, 4))
    s1 = 2.0 * s0
    for keeping in (True, False):
        asked: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

        def keep(op, args, kwargs, output):
            asked.append((tuple(output.shape), tuple(args[0].shape)))
            return keeping

        s = p.from_numpy(s0)

        def fn(x):
            h = x * s
            return h * h

        out, backward = p.vjp(lambda x: p.recompute(fn, x, keep=keep), [p.from_numpy(x0)])
        assert asked == [((3, 4), (3, 4))] * 2, asked  # the two products, in the forward only
        s[:] = p.from_numpy(s1)
        (gx,), _ = backward([p.from_numpy(np.ones((3, 4), np.float32))])
        assert len(asked) == 2, asked
        close(p.to_numpy(out), (x0 * s0) ** 2, "forward")
        h = x0 * s0 if keeping else x0 * s1
        close(p.to_numpy(gx), 2.0 * h * s1, f"input gradient, keep={keeping}")


def test_recompute_keep(run_on_ranks) -> None:
    run_on_ranks(check_recompute_keep, world_size=1)
