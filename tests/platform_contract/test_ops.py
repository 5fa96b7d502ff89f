"""Conformance: tensor ops, the documented tensor methods, dtypes, streams and device
queries (attention: ``test_attention``). World size 1."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hyper_parallel.platform import Capability, get_platform
from hyper_parallel.platform.base import DTYPE_NAMES, TENSOR_METHODS
from tests.platform_contract._data import close, rank_data
from hyper_parallel.core.tensor_ops import clone, dtype_name, stack


def check_dtypes() -> None:
    p = get_platform()
    for name in DTYPE_NAMES:
        assert dtype_name(p.dtype(name)) == name
    try:
        p.dtype("complex32")
    except ValueError as err:
        assert "complex32" in str(err) and "float32" in str(err)
    else:
        raise AssertionError("unknown dtype name accepted")
    bf = p.to_dtype(p.from_numpy(np.array([1.5, -2.0], np.float32)), p.dtype("bfloat16"))
    assert dtype_name(bf.dtype) == "bfloat16"
    out = p.to_numpy(bf)
    assert out.dtype == np.float32 and out.tolist() == [1.5, -2.0]


def check_factories_and_shape_ops() -> None:
    p = get_platform()
    f32, i64 = p.dtype("float32"), p.dtype("int64")
    np.testing.assert_array_equal(p.to_numpy(p.zeros((2, 3), f32)), np.zeros((2, 3), np.float32))
    for dtype in ("float32", "bfloat16", "int64"):  # fill=False: shape and dtype only, values unspecified
        buffer = p.zeros((2, 3), p.dtype(dtype), fill=False)
        assert tuple(buffer.shape) == (2, 3) and dtype_name(buffer.dtype) == dtype, (dtype, buffer.shape)
    np.testing.assert_array_equal(p.to_numpy(p.full((2,), 7.0, f32)), [7.0, 7.0])
    np.testing.assert_array_equal(p.to_numpy(p.arange(2, 6, i64)), [2, 3, 4, 5])
    a = rank_data(0, (7, 5))
    t = p.from_numpy(a)
    assert p.is_tensor(t) and not p.is_tensor(a)
    np.testing.assert_array_equal(p.to_numpy(p.cat([t, t], 1)), np.concatenate([a, a], 1))
    np.testing.assert_array_equal(p.to_numpy(stack([t, t], 0)), np.stack([a, a]))
    np.testing.assert_array_equal(p.to_numpy(stack([t, t * 2.0], -1)), np.stack([a, a * 2.0], -1))
    try:
        stack([t, p.narrow(t, 0, 0, 3)])
    except ValueError as err:
        assert "shapes differ" in str(err), str(err)
    else:
        raise AssertionError("stack accepted tensors of different shapes")
    pieces = p.split(t, [3, 0, 4], 0)
    assert [tuple(c.shape) for c in pieces] == [(3, 5), (0, 5), (4, 5)]
    np.testing.assert_array_equal(p.to_numpy(pieces[2]), a[3:])
    np.testing.assert_array_equal(p.to_numpy(p.narrow(t, 1, 1, 3)), a[:, 1:4])
    np.testing.assert_array_equal(p.to_numpy(p.pad(t, 0, 1, 2, value=-1.0)),
                                  np.pad(a, ((1, 2), (0, 0)), constant_values=-1.0))
    np.testing.assert_array_equal(p.to_numpy(p.pad(t, 1, 0, 3)), np.pad(a, ((0, 0), (0, 3))))
    try:
        p.split(t, [3, 3], 0)
    except ValueError as err:
        assert "sum to 6" in str(err)
    else:
        raise AssertionError("split accepted sizes that do not add up")


def _adds_into_part(p, a: np.ndarray, b: np.ndarray) -> bool:
    """``x[:, 1:3] += y`` writes into ``x`` itself; the rest of ``x`` is unchanged."""
    x, y = p.from_numpy(a.copy()), p.from_numpy(b[:, :2].copy())
    same = x
    x[:, 1:3] += y
    want = a.copy()
    want[:, 1:3] += b[:, :2]
    return x is same and np.array_equal(p.to_numpy(x), want)


def _iadds(p, a: np.ndarray, b: np.ndarray) -> bool:
    x = p.from_numpy(a.copy())
    x += p.from_numpy(b)
    return np.array_equal(p.to_numpy(x), a + b)


def check_tensor_methods() -> list[str]:
    """Every method core may call directly behaves like numpy on every backend."""
    p = get_platform()
    a = rank_data(0, (2, 3, 4))
    b = rank_data(1, (2, 3, 4))
    t, u = p.from_numpy(a), p.from_numpy(b)
    checks = {
        "shape": lambda: tuple(t.shape) == a.shape,
        "dtype": lambda: dtype_name(t.dtype) == "float32",
        "ndim": lambda: t.ndim == 3,
        "dim": lambda: t.dim() == 3,
        "numel": lambda: t.numel() == 24,
        "reshape": lambda: np.array_equal(p.to_numpy(t.reshape(6, 4)), a.reshape(6, 4)),
        "view": lambda: np.array_equal(p.to_numpy(t.view(4, 6)), a.reshape(4, 6)),
        "permute": lambda: np.array_equal(p.to_numpy(t.permute(2, 0, 1)), a.transpose(2, 0, 1)),
        "transpose": lambda: np.array_equal(p.to_numpy(t.transpose(0, 2)), a.swapaxes(0, 2)),
        "contiguous": lambda: np.array_equal(p.to_numpy(t.transpose(0, 1).contiguous()), a.swapaxes(0, 1)),
        "is_contiguous": lambda: t.is_contiguous() is True,
        "unsqueeze": lambda: tuple(t.unsqueeze(1).shape) == (2, 1, 3, 4),
        "squeeze": lambda: tuple(t.unsqueeze(0).squeeze(0).shape) == (2, 3, 4),
        "flatten": lambda: np.array_equal(p.to_numpy(t.flatten()), a.reshape(-1)),
        # float32 reductions: backends and numpy add in different orders (a few ulps).
        "sum": lambda: np.allclose(p.to_numpy(t.sum(1)), a.sum(1), atol=1e-5),
        "mean": lambda: np.allclose(p.to_numpy(t.mean(2)), a.mean(2), atol=1e-6),
        "amax": lambda: np.array_equal(p.to_numpy(t.amax(0)), a.max(0)),
        # MindSpore's CPU exp is a faster approximation: up to 2.7e-6 relative (~23 ulp).
        "exp": lambda: np.allclose(p.to_numpy(t.exp()), np.exp(a), rtol=1e-5, atol=0),
        "log": lambda: np.allclose(p.to_numpy((t * t + 1.0).log()), np.log(a * a + 1), rtol=1e-6),
        "float": lambda: dtype_name(p.to_dtype(t, p.dtype("float16")).float().dtype) == "float32",
        "__getitem__": lambda: np.array_equal(p.to_numpy(t[1, :, 1:3]), a[1, :, 1:3]),
        "__setitem__": lambda: _adds_into_part(p, a, b),
        "__add__": lambda: np.allclose(p.to_numpy(t + u), a + b),
        "__iadd__": lambda: _iadds(p, a, b),
        "__sub__": lambda: np.allclose(p.to_numpy(t - u), a - b),
        "__mul__": lambda: np.allclose(p.to_numpy(t * u), a * b),
        "__truediv__": lambda: np.allclose(p.to_numpy(t / 2.0), a / 2),
        "__neg__": lambda: np.array_equal(p.to_numpy(-t), -a),
        "__matmul__": lambda: np.allclose(p.to_numpy(t @ u.transpose(1, 2)), a @ b.swapaxes(1, 2), atol=1e-5),
        # float32 transcendental functions: within a few ulps of numpy's.
        "abs": lambda: np.array_equal(p.to_numpy(t.abs()), np.abs(a)),
        "pow": lambda: (np.allclose(p.to_numpy(t.pow(2.0)), a ** 2, rtol=1e-6)
                        and np.allclose(p.to_numpy((t * t + 1.0).pow(-0.5)), (a * a + 1) ** -0.5, rtol=1e-6)),
        "sqrt": lambda: np.allclose(p.to_numpy((t * t + 1.0).sqrt()), np.sqrt(a * a + 1), rtol=1e-6),
        "rsqrt": lambda: np.allclose(p.to_numpy((t * t + 1.0).rsqrt()), 1 / np.sqrt(a * a + 1), rtol=1e-6),
        "sigmoid": lambda: np.allclose(p.to_numpy(t.sigmoid()), 1 / (1 + np.exp(-a)), rtol=1e-5, atol=1e-7),
        "tanh": lambda: np.allclose(p.to_numpy(t.tanh()), np.tanh(a), rtol=1e-5, atol=1e-7),
        "erf": lambda: np.allclose(p.to_numpy(t.erf()), np.vectorize(math.erf)(a), rtol=1e-5, atol=1e-7),
        "clamp": lambda: np.array_equal(p.to_numpy(p.arange(-2, 6, p.dtype("int64")).clamp(0, 3)),
                                        np.clip(np.arange(-2, 6), 0, 3)),
        "__gt__": lambda: np.array_equal(p.to_numpy(t > 0.25), a > 0.25),
        "__ge__": lambda: np.array_equal(p.to_numpy(p.arange(0, 4, p.dtype("int64")) >= 2), [False, False, True, True]),
        "__lt__": lambda: np.array_equal(p.to_numpy(t < 0.25), a < 0.25),
    }
    assert set(checks) == set(TENSOR_METHODS), set(TENSOR_METHODS) ^ set(checks)
    failed = [name for name, check in checks.items() if not check()]
    assert not failed, f"tensor methods that differ from numpy: {failed}"
    return sorted(checks)


def check_detach_clone() -> None:
    p = get_platform()
    a, g = rank_data(0, (3, 4)), rank_data(1, (3, 4))

    def fn(x):
        copy = clone(x)
        frozen = p.detach(x)
        np.testing.assert_array_equal(p.to_numpy(copy), a)
        np.testing.assert_array_equal(p.to_numpy(frozen), a)
        return copy * 2.0 + frozen * 5.0

    _, backward = p.vjp(fn, [p.from_numpy(a)])
    (grad,), _ = backward([p.from_numpy(g)])
    # clone passes the gradient through; detach contributes none.
    close(p.to_numpy(grad), 2 * g, "gradient through clone and detach")


def test_detach_clone(run_on_ranks) -> None:
    run_on_ranks(check_detach_clone, world_size=1)


def check_streams_device() -> dict:
    p = get_platform()
    stream = p.new_stream()
    with p.stream(stream):
        y = p.from_numpy(np.ones(3, np.float32)) * 2.0
    event = p.record_event(stream)
    p.wait_event(event)
    p.wait_event(p.record_event(), stream)
    assert p.to_numpy(y).tolist() == [2.0, 2.0, 2.0]
    assert p.device_type in ("cpu", "cuda", "npu", "ascend")
    assert p.name == f"{p.framework}-{p.device_type}", (p.name, p.framework, p.device_type)
    p.set_device(0)
    try:
        p.set_device(1 << 20)  # past any machine's device count
    except ValueError as err:
        assert "local_rank" in str(err)
    else:
        raise AssertionError("set_device accepted a device index past the visible devices")
    stats = p.memory_stats()
    used, peak = stats.allocated, stats.peak
    # On CPU both are read from Linux counters that are synced lazily per thread, so two
    # reads taken microseconds apart may disagree by a few pages (seen: 0.1%).
    assert used > 0 and peak >= 0.99 * used, (used, peak)
    # to_device: host and back keep values and dtype; an unknown device name is refused.
    x = p.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    for pin in (False, True):
        host = p.to_device(x, "cpu", pin_memory=pin)
        back = p.to_device(host, p.device_type)
        assert p.to_numpy(host).tolist() == p.to_numpy(back).tolist() == p.to_numpy(x).tolist()
        assert dtype_name(back.dtype) == "float32" and tuple(back.shape) == (2, 3)
    try:
        p.to_device(x, "tpu")
    except ValueError as err:
        assert "device='tpu'" in str(err) and "'cpu'" in str(err), str(err)
    else:
        raise AssertionError("to_device accepted an unknown device name")
    return {"caps": sorted(c.name for c in p.capabilities()), "name": p.name}


def test_streams_device(run_on_ranks) -> None:
    (result,) = run_on_ranks(check_streams_device, world_size=1)
    assert set(result["caps"]) <= {c.name for c in Capability}


def test_dtypes(run_on_ranks) -> None:
    run_on_ranks(check_dtypes, world_size=1)


def test_factories_and_shape_ops(run_on_ranks) -> None:
    run_on_ranks(check_factories_and_shape_ops, world_size=1)


def test_tensor_methods(run_on_ranks) -> None:
    (checked,) = run_on_ranks(check_tensor_methods, world_size=1)
    assert checked == sorted(TENSOR_METHODS)


def check_local_ops() -> list[str]:
    """``softmax`` (both forms) and core's local ops composed from the contract
    (``core/tensor_ops.py``) against numpy (float64 data: the backends' transcendental
    functions agree with numpy to ~1e-7 relative; MindSpore's CPU exp is the loosest),
    and the gradients of the ones with a non-elementwise backward."""
    from hyper_parallel.core import tensor_ops

    p = get_platform()
    rng = np.random.default_rng(11)
    a = rng.standard_normal((3, 5))
    a[0, 0] = 0.0  # relu at 0: value 0, gradient 0
    ids = np.array([[0, 2, 3], [3, 3, 1]], np.int64)
    weight = rng.standard_normal((4, 5))
    target = np.array([1, 0, 4], np.int64)
    x, w = p.from_numpy(a), p.from_numpy(weight)
    shifted = np.exp(a - a.max(1, keepdims=True))
    softmax = shifted / shifted.sum(1, keepdims=True)
    log_softmax = np.log(softmax)
    nll = -log_softmax[np.arange(3), target]
    erf = np.vectorize(math.erf)
    expected = {
        "softmax": (lambda: p.softmax(x, 1), softmax),
        "log_softmax": (lambda: p.softmax(x, -1, log=True), log_softmax),
        "embedding": (lambda: tensor_ops.embedding(p.from_numpy(ids), w), weight[ids]),
        "cross_entropy": (lambda: p.cross_entropy(x, p.from_numpy(target), "none"), nll),
        "silu": (lambda: tensor_ops.silu(x), a / (1 + np.exp(-a))),
        "gelu": (lambda: tensor_ops.gelu(x), 0.5 * a * (1 + erf(a / math.sqrt(2)))),
        "relu": (lambda: tensor_ops.relu(x), np.maximum(a, 0)),
        # rows 1..2 of weight: ids 1 and 2 look up, 0 and 3 give zeros
        "masked_embedding": (lambda: tensor_ops.masked_embedding(p.from_numpy(ids), p.from_numpy(weight[1:3].copy()), 1),
                             np.where(((ids >= 1) & (ids < 3))[..., None], weight[np.clip(ids, 1, 2)], 0.0)),
        "masked_embedding, no rows": (lambda: tensor_ops.masked_embedding(p.from_numpy(ids), w[0:0], 1),
                                      np.zeros((2, 3, 5))),
    }
    for name, (call, want) in expected.items():
        np.testing.assert_allclose(p.to_numpy(call()), want, rtol=1e-5, atol=1e-7, err_msg=name)
    for reduction, want in (("sum", nll.sum()), ("mean", nll.mean())):
        got = p.to_numpy(p.cross_entropy(x, p.from_numpy(target), reduction))
        assert got.shape == () and np.allclose(got, want, rtol=1e-6), (reduction, got, want)

    def fn(logits, table):
        loss = p.cross_entropy(logits, p.from_numpy(target), "sum")
        return loss + (tensor_ops.embedding(p.from_numpy(ids), table) * 3.0).sum()

    _, backward = p.vjp(fn, [x, w])
    (grad_x, grad_w), _ = backward([p.full((), 1.0, x.dtype)])
    onehot = np.eye(5)[target]
    np.testing.assert_allclose(p.to_numpy(grad_x), softmax - onehot, rtol=1e-5, atol=1e-7, err_msg="cross_entropy grad")
    counts = np.bincount(ids.reshape(-1), minlength=4)[:, None] * 3.0
    np.testing.assert_allclose(p.to_numpy(grad_w), np.broadcast_to(counts, (4, 5)), err_msg="embedding grad")

    def activations(t):
        return (tensor_ops.relu(t) + tensor_ops.silu(t) * 2.0 + tensor_ops.gelu(t) * 3.0).sum()

    _, backward = p.vjp(activations, [x])
    (grad,), _ = backward([p.full((), 1.0, x.dtype)])
    sig = 1 / (1 + np.exp(-a))
    want = (a > 0) + 2.0 * (sig * (1 + a * (1 - sig))) \
        + 3.0 * (0.5 * (1 + erf(a / math.sqrt(2))) + a * np.exp(-a * a / 2) / math.sqrt(2 * math.pi))
    np.testing.assert_allclose(p.to_numpy(grad), want, rtol=1e-5, atol=1e-7, err_msg="activation grads")
    return sorted(expected)


def test_local_ops(run_on_ranks) -> None:
    assert run_on_ranks(check_local_ops, world_size=1) == [sorted([
        "softmax", "log_softmax", "embedding", "cross_entropy", "silu", "gelu", "relu", "masked_embedding",
        "masked_embedding, no rows"])]


def check_grouped_matmul() -> dict[str, object]:
    """``grouped_matmul`` against numpy, forward and gradients (float32: each row is one
    dot product per output in both, but the kernels sum in their own order; ``sum()``
    backward, whose zero-stride gradient torch's grouped_mm backward cannot take by
    itself), with an empty group, an empty input, odd dims (torch's 16-byte rule sends
    them to the per-group loop) and bad sizes."""
    import warnings

    p = get_platform()
    rng = np.random.default_rng(5)
    ran: dict[str, object] = {}
    for rows_in, out_dim, sizes in (((10, 8), 4, [3, 0, 7]), ((9, 7), 5, [4, 5, 0]), ((0, 8), 4, [0, 0, 0])):
        a = rng.standard_normal(rows_in).astype(np.float32)
        w = rng.standard_normal((3, out_dim, rows_in[1])).astype(np.float32)
        bounds = np.cumsum([0] + sizes)
        want = np.concatenate([a[bounds[g]:bounds[g + 1]] @ w[g].T for g in range(3)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, backward = p.vjp(lambda x, weight: p.grouped_matmul(x, weight, sizes).sum(),
                                  [p.from_numpy(a), p.from_numpy(w)])
            got = p.to_numpy(p.grouped_matmul(p.from_numpy(a), p.from_numpy(w), sizes))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(sizes))
        np.testing.assert_allclose(p.to_numpy(out), want.sum(), rtol=1e-4, atol=1e-4)
        (grad_a, grad_w), _ = backward([p.full((), 1.0, p.dtype("float32"))])
        np.testing.assert_allclose(p.to_numpy(grad_a), np.concatenate(
            [np.broadcast_to(w[g].sum(0), (sizes[g], rows_in[1])) for g in range(3)]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(p.to_numpy(grad_w), np.stack(
            [np.broadcast_to(a[bounds[g]:bounds[g + 1]].sum(0), (out_dim, rows_in[1])) for g in range(3)]),
            rtol=1e-5, atol=1e-5)
        ran[f"{rows_in}x{out_dim}"] = any("one matmul per expert" in str(c.message) for c in caught)
    x, w = p.from_numpy(np.zeros((4, 8), np.float32)), p.from_numpy(np.zeros((2, 3, 8), np.float32))
    for bad in ([4], [2, 3], [5, -1]):
        with pytest.raises(ValueError, match=r"group_sizes=.*one size >= 0 per group \(2\) summing to x's 4 rows"):
            p.grouped_matmul(x, w, bad)
    with pytest.raises(ValueError, match="weight is in Linear's"):
        p.grouped_matmul(x, p.from_numpy(np.zeros((2, 8, 3), np.float32)), [2, 2])
    ran["caps"] = Capability.GROUPED_MATMUL in p.capabilities()
    return ran


def test_grouped_matmul(run_on_ranks) -> None:
    (ran,) = run_on_ranks(check_grouped_matmul, world_size=1)
    # the per-group loop runs (and warns) exactly where no kernel takes the call: always
    # without the capability; with it, only for the odd dims torch's kernel refuses
    assert ran["(9, 7)x5"] is True, ran
    assert ran["(10, 8)x4"] is (not ran["caps"]), ran
