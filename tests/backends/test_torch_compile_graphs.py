"""torch.compile and the torch backend's own code: what a compiled block calls traces into
one graph, and what must stay eager (saved-tensor hooks) is not traced at all
([Note: hooks stay eager under torch.compile] in ``platform/torch/compile.py``).
In process, world size 1, ``aot_eager`` (traced graphs, no C++ build): the checks are on
what dynamo traces, not on kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hyper_parallel.platform import get_platform  # noqa: E402  (after the skip)
from hyper_parallel.platform.saved_tensor_layers import LayeredHooks  # noqa: E402


def _torch_platform():
    p = get_platform()
    if not p.name.startswith("torch"):
        pytest.skip(f"torch.compile is torch's; the platform is {p.name}")
    return p


@pytest.mark.parametrize("entry", ["platform", "core"])
def test_attention_traces_into_one_graph(entry: str) -> None:
    """The attention a compiled block calls (core's ``scaled_dot_product_attention``
    outside context parallelism, the platform's ``local_attention`` under it) traces into
    one graph: SDPA's kernel choice (an int) and the context-parallel frame lookup (a
    ContextVar) broke it at every attention. fullgraph=True raises at any break."""
    import hyper_parallel as hp

    p = _torch_platform()
    attend = (lambda q, k, v: p.local_attention(q, k, v, is_causal=True)) if entry == "platform" else \
        (lambda q, k, v: hp.scaled_dot_product_attention(q, k, v, is_causal=True))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, h, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    out = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v)
    ref = p.local_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    # one kernel's arithmetic on both sides (SDPA's flash kernel for CPU float32)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_saved_tensor_hooks_are_not_traced_once_compiling() -> None:
    """fully_shard's saved-tensor context (``release_saved_tensors``) around a compiled
    module: its pack runs eagerly when the compiled graph saves for backward. Traced, it
    broke its graph at the context-variable lookup and recompiled per saved tensor
    (dp-shard 2 compiled: 1.25x the eager step, 1.06x without)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    p = _torch_platform()
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    # a hook of the platform inside: the graph breaks there, as at fully_shard's hooks on
    # the modules that hold a unit's parameters, and the code around it runs under dynamo
    inner = p.register_forward_hook(model[1], lambda module, args, out: None)
    handle = p.compile_module(model)
    try:
        source = torch.randn(8, 8, generator=gen).tanh()  # made by an operation: the contract's rule
        reloads = []

        def reload(index: int):
            reloads.append(index)
            return source

        x = torch.randn(4, 8, generator=gen, requires_grad=True)
        for _ in range(2):
            with p.release_saved_tensors([source], reload):
                out = model(x) @ source  # saves source: taken by the context, reloaded in backward
            out.sum().backward()
        assert reloads, "the saved source was not handed back through reload"
        assert not _debug_get_cache_entry_list(LayeredHooks._pack.__code__), "dynamo traced the pack hook"
    finally:
        handle.remove()
        inner.remove()
        torch._dynamo.reset()


def check_fully_shard_block_compiles_whole() -> None:
    """A fully_shard'ed block, compiled: no graph break inside it (the unit hooks the
    modules holding its parameters only once it will be recomputed: [Note: recomputation
    and gathered parameters] in core/fully_shard/hsdp_state), and the compiled step's
    gradients equal the eager ones."""
    from torch._dynamo.utils import counters

    import hyper_parallel as hp

    p = get_platform()
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        hp.fully_shard(block, mesh=hp.init_device_mesh("cpu", (p.world_size(),)))
        return block

    x = torch.randn(4, 8, generator=gen)
    eager, compiled = build(), build()
    handle = p.compile_module(compiled)
    try:
        for _ in range(2):
            grads = []
            for block in (eager, compiled):
                block(x).square().sum().backward()
                grads.append([param.grad.to_local() for param in block.parameters()])
                block.zero_grad()
            for a, b in zip(*grads):
                # inductor may fuse and sum in another order than the eager kernels: float32 rounding
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    finally:
        handle.remove()
        torch._dynamo.reset()


def test_fully_shard_block_compiles_whole(run_on_ranks) -> None:
    _torch_platform()
    run_on_ranks(check_fully_shard_block_compiles_whole, world_size=2, timeout_s=300)
