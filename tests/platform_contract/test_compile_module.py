"""Conformance: ``Platform.compile_module`` (the framework's compiler on one module's forward).
World size 1: nothing here communicates. Compiling costs seconds (torch's inductor builds C++
kernels), so one small MLP is compiled once."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.platform import Capability, get_platform
from tests.platform_contract._data import close, rank_data
from tests.platform_contract._models import build_mlp, mlp_numpy, mlp_weights

#: the instance attribute ``compile_module`` sets (torch's ``forward``, MindSpore's ``construct``)
FORWARD_ATTRIBUTES = {"forward", "construct"}


def check_compile_module() -> None:
    p = get_platform()
    weights = mlp_weights(4, 5, 3)
    model = build_mlp(p, weights)
    params = list(p.named_parameters(model))
    events: list[str] = []
    outer = p.register_forward_pre_hook(model, lambda m, args: events.append("own"))
    inner = p.register_forward_hook(model.fc2, lambda m, args, out: events.append("fc2"))
    if Capability.COMPILE_AROUND_HOOKS not in p.capabilities():
        inner.remove()  # MindSpore traces a submodule's hook: the contract says not to compile one
    handle = p.compile_module(model)
    assert FORWARD_ATTRIBUTES & set(vars(model)), "compile_module left the forward as it was"
    x, g = rank_data(0, (6, 4)), rank_data(1, (6, 3))
    pre = x @ weights["fc1.weight"].T + weights["fc1.bias"]
    h = np.maximum(pre, 0.0)
    gh = (g @ weights["fc2.weight"]) * (pre > 0)
    expected = {"fc1.weight": gh.T @ x, "fc1.bias": gh.sum(0), "fc2.weight": g.T @ h, "fc2.bias": g.sum(0)}
    for call in range(2):  # the second call reuses the compiled code: the hooks must still run
        out, backward = p.vjp(model, [p.from_numpy(x)], [param for _, param in params])
        close(p.to_numpy(out), mlp_numpy(weights, x), f"compiled forward, call {call}")
        (gx,), grads = backward([p.from_numpy(g)])
        close(p.to_numpy(gx), gh @ weights["fc1.weight"], f"compiled input gradient, call {call}")
        for (name, _), grad in zip(params, grads):
            close(p.to_numpy(grad), expected[name], f"compiled gradient of {name}, call {call}")
    if Capability.COMPILE_AROUND_HOOKS in p.capabilities():
        # the submodule's hook ran eagerly at each call, not once while tracing
        assert events == ["own", "fc2", "own", "fc2"], events
    else:
        assert events == ["own", "own"], events
    handle.remove()
    assert not FORWARD_ATTRIBUTES & set(vars(model)), "remove() left the compiled forward in place"
    close(p.to_numpy(model(p.from_numpy(x))), mlp_numpy(weights, x), "forward after remove()")
    outer.remove()
    with pytest.raises(TypeError, match="compile_module"):
        p.compile_module(object())


def test_compile_module(run_on_ranks) -> None:
    run_on_ranks(check_compile_module, world_size=1, timeout_s=300)
