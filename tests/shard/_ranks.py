"""Rank functions of the shard_module tests (module-level: the harness pickles them by
name). Parity: the same MLP, data and output gradient on one process and sharded."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from hyper_parallel import (DFunction, DTensor, Partial, Replicate, Shard, ShardingPlan, init_device_mesh,
                            shard_module)
from hyper_parallel.platform import get_platform
from tests.dtensor._reference import expected_local
from tests.platform_contract._models import build_mlp, mlp_weights

# float32: the sharded GEMMs sum their partial products in another order than the full
# GEMM (and the rowwise output adds them with an all-reduce), so values agree to a few
# ulps of their magnitudes, not bit for bit.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _tp_axis(mesh_shape: tuple[int, ...]) -> tuple[str, ...]:
    return ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")


def mlp_plan(names: tuple[str, ...], form: str) -> ShardingPlan:
    """Megatron's pair over ``tp``: fc1 colwise (weight and bias ``Shard(0)``), fc2 rowwise
    (weight ``Shard(1)``, bias replicated), batch over ``dp`` (2-D meshes), written with
    Placements or with alias strings (the same layout both ways).

    ``placements``: the hidden activations stay sharded between the layers, the output
    is all-reduced to Replicate on tp; ``alias``: fc1's output is all-gathered
    (``fc1.output``: Replicate), so fc2 takes a replicated input and slices it locally;
    ``nested``: ``alias`` with fc1's rows sharded over ``("dp", "tp")``, dp outermost
    (2-D meshes).
    """
    if form == "placements":
        def on(tp: Any, dp: Any = Replicate()) -> tuple[Any, ...]:
            return tuple(tp if axis == "tp" else dp for axis in names)

        return ShardingPlan(
            plan={"fc1.weight": on(Shard(0)), "fc1.bias": on(Shard(0)), "fc2.weight": on(Shard(1)),
                  "fc2.bias": on(Replicate())},
            input_plan={"input": on(Replicate(), Shard(0))},
            output_plan={"output": on(Replicate(), Shard(0))},
            return_local_tensor=[""])
    batch = "dp" if "dp" in names else "None"
    fc1 = ("dp", "tp") if form == "nested" else "tp"
    return ShardingPlan(
        plan={"fc1.weight": (fc1, "None"), "fc1.bias": (fc1,), "fc2.weight": ("None", "tp"),
              "fc2.bias": ("None",)},
        input_plan={"input": (batch, "None")},
        output_plan={"fc1.output": (batch, "None"), "output": (batch, "None")},
        return_local_tensor=[""])


def _full_grad(p: Any, grad: Any, param: DTensor) -> np.ndarray:
    """The whole gradient of a DTensor parameter: torch's is a DTensor; MindSpore's
    ``vjp`` gives this rank's piece, laid out as the parameter."""
    if not isinstance(grad, DTensor):
        grad = DTensor.from_local(grad, param.device_mesh, param.placements, shape=param.shape)
    return p.to_numpy(grad.full_tensor())


def check_mlp_parity(mesh_shape: tuple[int, ...], form: str, sizes: tuple[int, int, int, int]) -> int:
    """Forward output, input gradient and parameter gradients of the sharded MLP against
    the one-process MLP; ``sizes`` = (batch, d_in, hidden, d_out), uneven on purpose."""
    p = get_platform()
    names = _tp_axis(mesh_shape)
    mesh = init_device_mesh(p.device_type, mesh_shape, mesh_dim_names=names)
    batch, d_in, hidden, d_out = sizes
    values = mlp_weights(d_in, hidden, d_out)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    g = rng.standard_normal((batch, d_out)).astype(np.float32)

    ref = build_mlp(p, values)
    ref_params = [param for _, param in p.named_parameters(ref)]
    ref_out, ref_backward = p.vjp(ref, [p.from_numpy(x)], ref_params)
    (ref_gx,), ref_grads = ref_backward([p.from_numpy(g)])
    ref_out, ref_gx = p.to_numpy(ref_out), p.to_numpy(ref_gx)
    ref_grads = {name: p.to_numpy(grad) for (name, _), grad in zip(p.named_parameters(ref), ref_grads)}

    # every rank but mesh coordinate 0 starts from other values: shard_module broadcasts
    rank = p.rank()
    model = build_mlp(p, {name: value + rank for name, value in values.items()})
    plan = mlp_plan(names, form)
    assert shard_module(model, mesh, plan) is model
    seen: dict[str, Any] = {}

    def record(_module: Any, args: tuple[Any, ...]) -> None:
        seen["fc2"] = args[0].placements

    # registered after shard_module's hooks, so it sees fc2's input as they left it
    p.register_forward_pre_hook(model.fc2, record)
    named = list(p.named_parameters(model))
    expected_placements = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1),
                           "fc2.bias": Replicate()}
    for name, param in named:
        want = tuple(expected_placements[name] if axis == "tp" else Replicate() for axis in names)
        if form == "nested" and name.startswith("fc1"):
            want = (Shard(0), Shard(0))
        assert isinstance(param, DTensor) and tuple(param.placements) == want, (name, param)
        assert tuple(param.shape) == values[name].shape, (name, param.shape)
        np.testing.assert_array_equal(p.to_numpy(param.to_local()),
                                      expected_local(values[name], want, mesh.shape, mesh.get_coordinate()),
                                      err_msg=f"{name}: rank 0's values, this rank's piece")

    # the input arrives replicated; input_plan shards the batch over dp (a local slice)
    replicated = tuple(Replicate() for _ in names)
    batch_layout = tuple(Shard(0) if axis == "dp" else Replicate() for axis in names)
    out_local_g = expected_local(g, batch_layout, mesh.shape, mesh.get_coordinate())

    def forward(x_local: Any) -> Any:
        return model(DTensor.from_local(x_local, mesh, replicated))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, backward = p.vjp(forward, [p.from_numpy(x)], [param for _, param in named])
        (gx,), grads = backward([p.from_numpy(out_local_g)])
    # every op of the forward and backward ran under a sharding rule, none gathered all
    assert not [w for w in caught if "no sharding rule" in str(w.message)], [str(w.message) for w in caught]
    # return_local_tensor: a plain tensor, this rank's rows of the output
    assert not isinstance(out, DTensor), type(out)
    np.testing.assert_allclose(p.to_numpy(out), expected_local(ref_out, batch_layout, mesh.shape,
                                                               mesh.get_coordinate()), **TOL, err_msg="output")
    hidden_tp = Shard(1) if form == "placements" else Replicate()  # fc1.output all-gathers in the alias plan
    assert tuple(seen["fc2"]) == tuple(hidden_tp if axis == "tp" else Shard(0) for axis in names), seen
    # x entered replicated: its gradient is the whole one (the batch slice's backward
    # all-gathers over dp)
    np.testing.assert_allclose(p.to_numpy(gx), ref_gx, **TOL, err_msg="input gradient")
    for (name, param), grad in zip(named, grads):
        np.testing.assert_allclose(_full_grad(p, grad, param), ref_grads[name], **TOL, err_msg=f"gradient of {name}")
    return 1


def check_callable(world: int) -> int:
    """A function sharded by wrapping: its first argument is redistributed, its result
    too, then returned local; a second spec of None leaves that argument alone."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (world,), mesh_dim_names=("tp",))
    a = np.arange(15, dtype=np.float32).reshape(5, 3)
    b = np.ones((5, 3), dtype=np.float32)

    def add(x: Any, y: Any) -> Any:
        assert tuple(x.placements) == (Replicate(),), x.placements  # input_plan all-gathered x
        return x + y

    sharded = shard_module(add, mesh, ShardingPlan(input_plan={"input": [(Replicate(),), None]},
                                                   output_plan={"output": ("tp", "None")},
                                                   return_local_tensor=[""]))
    out = sharded(DTensor.from_local(p.from_numpy(expected_local(a, (Shard(0),), mesh.shape, mesh.get_coordinate())),
                                     mesh, (Shard(0),), shape=a.shape),
                  DTensor.from_local(p.from_numpy(b), mesh, (Replicate(),)))
    assert not isinstance(out, DTensor)
    np.testing.assert_array_equal(p.to_numpy(out), expected_local(a + b, (Shard(0),), mesh.shape,
                                                                  mesh.get_coordinate()))
    return 1


def check_submodule_output(world: int) -> int:
    """``output_plan`` of a submodule turning its Partial output (the rowwise GEMM's) into
    ``Shard(1)`` (a reduce-scatter, uneven: ``2 * world + 1`` features), and
    ``return_local_tensor`` of that submodule: the root returns its local piece."""
    p = get_platform()
    mesh = init_device_mesh(p.device_type, (world,), mesh_dim_names=("tp",))
    values = mlp_weights(4, 6, 2 * world + 1)
    model, ref = build_mlp(p, values), build_mlp(p, values)
    shard_module(model, mesh, ShardingPlan(
        plan={"fc1.weight": (Shard(0),), "fc1.bias": (Shard(0),), "fc2.weight": (Shard(1),),
              "fc2.bias": (Replicate(),)},
        output_plan={"fc2.output": (Shard(1),)}, return_local_tensor=["fc2"]))
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    out = model(DTensor.from_local(p.from_numpy(x), mesh, (Replicate(),)))
    assert not isinstance(out, DTensor), type(out)
    want = expected_local(p.to_numpy(ref(p.from_numpy(x))), (Shard(1),), mesh.shape, mesh.get_coordinate())
    np.testing.assert_allclose(p.to_numpy(out), want, **TOL)
    return 1


def _raises(call: Callable[[], Any], error: type[Exception], needles: tuple[str, ...]) -> None:
    try:
        call()
    except error as err:
        text = str(err)
        missing = [needle for needle in needles if needle not in text]
        assert not missing, f"{error.__name__} without {missing}: {text}"
    else:
        raise AssertionError(f"no {error.__name__} mentioning {needles}")


def check_errors() -> int:
    """Each bad plan raises on every rank with a message naming the argument, the value
    and the fix, and leaves the module as it was: no parameter was distributed (no
    broadcast was issued) when the bad entry comes after good ones."""
    p = get_platform()
    mesh1 = init_device_mesh(p.device_type, (p.world_size(),), mesh_dim_names=("tp",))
    mesh2 = init_device_mesh(p.device_type, (2, p.world_size() // 2), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh(p.device_type, (p.world_size(),))
    values = mlp_weights(4, 6, 3)

    def shard(plan: ShardingPlan, mesh: Any = mesh1) -> Callable[[], Any]:
        model = build_mlp(p, values)

        def call() -> Any:
            try:
                return shard_module(model, mesh, plan)
            finally:
                untouched = [name for name, param in p.named_parameters(model) if not isinstance(param, DTensor)]
                assert len(untouched) == 4, f"a parameter was distributed before the error: {untouched}"
        return call

    good = {"fc1.weight": (Shard(0),)}
    cases = [
        (shard(ShardingPlan(plan={**good, "fc3.weight": (Shard(0),)})), KeyError,
         ("'fc3.weight'", "fc1.weight", "fc2.bias")),
        (shard(ShardingPlan(plan={**good, "fc2.weight": (Shard(0), Replicate())})), ValueError,
         ("plan['fc2.weight']", "2 placements", "1 axes", "one placement per mesh axis")),
        (shard(ShardingPlan(plan={**good, "fc2.weight": ("dp", "None")})), ValueError,
         ("plan['fc2.weight']", "'dp' is not a mesh axis", "('tp',)")),
        (shard(ShardingPlan(plan={"fc1.weight": ("tp", "tp")}), mesh2), ValueError, ("'tp' is used twice",)),
        (shard(ShardingPlan(plan={"fc1.weight": (("tp", "dp"), "None")}), mesh2), ValueError,
         ("out of mesh order", "('dp', 'tp')")),
        (shard(ShardingPlan(plan={**good, "fc2.weight": ("tp",)})), ValueError,
         ("1 alias entries", "2 dims")),
        (shard(ShardingPlan(plan={**good, "fc2.bias": (Shard(1),)})), ValueError, ("Shard(dim=1)", "1-D tensor")),
        (shard(ShardingPlan(plan={**good, "fc2.bias": (Partial(),)})), ValueError, ("never Partial",)),
        (shard(ShardingPlan(plan={"fc1.weight": ("tp", "None")}), unnamed), ValueError,
         ("no axis names", "mesh_dim_names")),
        (shard(ShardingPlan(plan=good, input_plan={"fc9.input": (Replicate(),)})), KeyError,
         ("'fc9.input'", "no submodule 'fc9'", "fc1", "fc2")),
        (shard(ShardingPlan(plan=good, output_plan={"fc2.output": (Replicate(), Replicate())})), ValueError,
         ("output_plan['fc2.output']", "one placement per mesh axis")),
        (shard(ShardingPlan(plan=good, return_local_tensor=["fc1", "head"])), KeyError,
         ("return_local_tensor", "'head'")),
        (shard({"fc1.weight": (Shard(0),)}), TypeError, ("not a ShardingPlan", "ShardingPlan(plan=")),
        (lambda: shard_module(build_mlp(p, values), "tp", ShardingPlan(plan=good)), TypeError, ("not a DeviceMesh",)),
    ]
    for call, error, needles in cases:
        _raises(call, error, needles)

    # sharded once, a parameter cannot be planned again
    model = shard_module(build_mlp(p, values), mesh1, ShardingPlan(plan=good))
    assert not isinstance(dict(p.named_parameters(model))["fc2.weight"], DTensor)  # not planned: as it was
    _raises(lambda: shard_module(model, mesh1, ShardingPlan(plan=good)), ValueError, ("already a DTensor",))

    # a function has no parameters and one input / output key
    def add(x: Any, y: Any) -> Any:
        return x + y

    _raises(lambda: shard_module(add, mesh1, ShardingPlan(plan=good)), ValueError, ("is a function", "fc1.weight"))
    _raises(lambda: shard_module(add, mesh1, ShardingPlan(input_plan={"x.input": (Replicate(),)})), ValueError,
            ("takes the key 'input' only",))

    # at forward time, in the hooks, before their collectives
    a = DTensor.from_local(p.from_numpy(np.ones((2, 3), np.float32)), mesh1, (Shard(0),))
    one_spec = shard_module(add, mesh1, ShardingPlan(input_plan={"input": [(Replicate(),)]}))
    _raises(lambda: one_spec(a, a), ValueError, ("positional input 1 is a DTensor", "only 1 placement specs"))
    wrong_ndim = shard_module(add, mesh1, ShardingPlan(input_plan={"input": ("tp",)}))
    _raises(lambda: wrong_ndim(a, a), ValueError, ("1 alias entries", "2 dims"))
    two_outputs = shard_module(add, mesh1, ShardingPlan(output_plan={"output": [(Replicate(),), (Replicate(),)]}))
    _raises(lambda: two_outputs(a, a), ValueError, ("2 placement specs", "one output"))
    other_mesh = shard_module(add, mesh2, ShardingPlan(input_plan={"input": ("dp", "None")}))
    _raises(lambda: other_mesh(a, a), ValueError, ("not on the mesh",))
    return 1


class ScaledMul(DFunction):
    """``x * w * scale (+ bias)``: a hand-written backward from saved tensors."""

    @staticmethod
    def forward(ctx: Any, x: Any, w: Any, scale: float, bias: Any) -> Any:
        ctx.save_for_backward(x, w)
        ctx.scale, ctx.has_bias = scale, bias is not None
        out = x * w * scale
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        return grad * w * ctx.scale, grad * x * ctx.scale, None, grad if ctx.has_bias else None


def check_dfunction() -> int:
    """``DFunction.apply`` gives the gradients of the plain op (with and without a bias,
    a non-tensor argument passed through); DTensor and keyword arguments raise."""
    p = get_platform()
    rng = np.random.default_rng(3)
    x, w, b, g = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(4))
    for bias in (None, b):
        def custom(xt: Any, wt: Any, bt: Any = None) -> Any:
            return ScaledMul.apply(xt, wt, 2.5, bt) * 1.5  # a framework op after it: a chain

        def plain(xt: Any, wt: Any, bt: Any = None) -> Any:
            out = xt * wt * 2.5
            return (out + bt if bt is not None else out) * 1.5

        inputs = [p.from_numpy(v) for v in ((x, w) if bias is None else (x, w, bias))]
        got_out, got_back = p.vjp(custom, inputs)
        got_grads, _ = got_back([p.from_numpy(g)])
        ref_out, ref_back = p.vjp(plain, inputs)
        ref_grads, _ = ref_back([p.from_numpy(g)])
        # the same float32 multiplications in the same order: equal to the last bit
        np.testing.assert_array_equal(p.to_numpy(got_out), p.to_numpy(ref_out))
        for index, (got, ref) in enumerate(zip(got_grads, ref_grads)):
            np.testing.assert_allclose(p.to_numpy(got), p.to_numpy(ref), rtol=1e-6, atol=1e-6,
                                       err_msg=f"gradient {index}, bias={bias is not None}")

    mesh = init_device_mesh(p.device_type, (p.world_size(),))
    dt = DTensor.from_local(p.from_numpy(x), mesh, (Replicate(),))
    plain_w = p.from_numpy(w)
    _raises(lambda: ScaledMul.apply(dt, plain_w, 1.0, None), TypeError,
            ("ScaledMul.apply", "argument 0 is a DTensor", "to_local()"))
    _raises(lambda: ScaledMul.apply(plain_w, [dt], 1.0, None), TypeError, ("argument 1[0] is a DTensor",))
    _raises(lambda: ScaledMul.apply(plain_w, plain_w, scale=1.0, bias=None), TypeError,
            ("keyword arguments ['bias', 'scale']", "positionally"))
    return 1
