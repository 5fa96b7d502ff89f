"""HSDPModule: what ``fully_shard`` makes of a module (FSDP2's ``FSDPModule`` class swap)
and its methods, on the model of ``_models`` (blocks are units, then the root).

- The class: ``HSDP<Class>``, an ``HSDPModule`` and an instance of its class, one class
  per original class; ``hsdp_state`` still works; copies refuse; a container's slicing
  (``type(m)(...)``) builds the original class.
- ``set_reduce_op_type``: the first backward's sharded gradients against the chunks of a
  single-process gradient of the full batch: ``"avg"`` (each rank's loss the mean over
  its rows) gives the full-batch mean's gradient; ``"sum"`` gives ``dp`` times it, which
  is the gradient of the summed per-rank losses (the one-process gradient of the summed
  loss); per unit with ``recurse=False``; on 1-D meshes of 2 and 4 ranks (on MindSpore
  the 4-rank one all-reduces the replicated ``fc1`` rows, [Note: no empty chunks on
  MindSpore]) and on the 2x2 HSDP mesh (the replicate all-reduce).
- ``set_requires_gradient_sync`` (recursive, and ``recurse=False``), the prefetch setters
  given HSDPModules, ``unshard`` / ``reshard``, ``set_reshard_after_forward``; bad values.

Tolerance: as in test_fully_shard (rtol 2e-4 / atol 2e-5): the ranks' gradient sums add
in another order than the full-batch GEMM (float32 ulps); a missing or extra division by
the data-parallel size is off by a factor of 2 or 4.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hyper_parallel import HSDPModule as TopLevelHSDPModule
from hyper_parallel.core.dtensor import init_device_mesh
from hyper_parallel.core.fully_shard import HSDPModule, MixedPrecisionPolicy, fully_shard, hsdp_state
from hyper_parallel.core.fully_shard.api import HSDPModule as ApiHSDPModule
from hyper_parallel.core.fully_shard.utils import CPUOffloadPolicy, OffloadPolicy
from hyper_parallel.platform import ReduceOp, get_platform
from tests.dtensor._reference import chunk
from tests.fully_shard._models import Trainer, build, weights

TOL = dict(rtol=2e-4, atol=2e-5)
BATCH = 8


def _data() -> np.ndarray:
    return np.random.default_rng(500).standard_normal((BATCH, 5)).astype(np.float32)


def _sharded(p, mesh_shape: tuple[int, ...]):
    """The model with each block a unit (one ``fully_shard`` call on the list), then the root."""
    mesh = init_device_mesh(p.device_type, mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    model = build(p, weights())
    fully_shard(list(model.blocks), mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=[model.gain])
    return model


def _units(p, model) -> list:
    return [hsdp_state(sub) for _, sub in p.named_modules(model) if isinstance(sub, HSDPModule)]


def _names(p, model) -> list[str]:
    return [name for name, _ in p.named_parameters(model) if name != "gain"]


def _reference_grads(p) -> dict[str, np.ndarray]:
    """Single process: the gradient of ``mean(model(x) ** 2)`` over the whole batch."""
    model = build(p, weights())
    trainer = Trainer(p, model)
    trainer.backward(_data())
    return dict(zip(_names(p, model), trainer.grad_arrays()))


def _local_rows(p) -> np.ndarray:
    """This rank's share of the batch: every rank of the mesh is a data-parallel rank."""
    n, r = p.world_size(), p.rank()
    return _data()[r * (BATCH // n):(r + 1) * (BATCH // n)]


def _take_grads(p, trainer) -> list[np.ndarray]:
    """The gradients since the last call, then cleared (no optimizer step)."""
    grads = trainer.grad_arrays()
    if p.framework == "torch":
        for param in trainer.params:
            param.grad = None
    else:
        trainer.grads = None
    return grads


def _check_grads(p, model, grads: list[np.ndarray], expected: dict[str, np.ndarray], what: str) -> None:
    """Each sharded gradient against this rank's chunk of ``expected[name]``."""
    managed = {id(hp.sharded): hp for state in _units(p, model) for hp in state.params}
    params = [param for name, param in p.named_parameters(model) if name != "gain"]
    for name, param, grad in zip(_names(p, model), params, grads):
        hp = managed[id(param)]
        start, length = chunk(hp.shape[hp.dim], hp.shard_size, hp.shard_rank)
        if hp.replicated:  # [Note: no empty chunks on MindSpore]
            start, length = 0, hp.shape[hp.dim]
        want = np.take(expected[name], range(start, start + length), axis=hp.dim)
        np.testing.assert_allclose(grad, want, **TOL, err_msg=f"{what}: gradient of {name}")


def _raises(call, error: type, *messages: str) -> None:
    try:
        call()
    except error as err:
        for message in messages:
            assert message in str(err), (message, str(err))
    else:
        raise AssertionError(f"no {error.__name__} ({messages[0]})")


# -- the class ------------------------------------------------------------------------------
def check_class() -> None:
    p = get_platform()
    assert HSDPModule is ApiHSDPModule is TopLevelHSDPModule
    assert issubclass(CPUOffloadPolicy, OffloadPolicy)  # utils: the path MindFormers imports
    model = build(p, weights())  # build() makes its model classes anew at each call
    model_cls, block_cls, linear_cls = type(model), type(model.blocks[0]), type(model.inp)
    returned = fully_shard(list(model.blocks), mesh=init_device_mesh(p.device_type, (p.world_size(),)))
    assert returned == list(model.blocks)
    assert fully_shard(model, ignored_params=[model.gain]) is model
    for module, cls in [(model, model_cls), (model.blocks[0], block_cls), (model.blocks[1], block_cls)]:
        assert isinstance(module, HSDPModule) and isinstance(module, cls), type(module).__mro__
        assert type(module).__name__ == f"HSDP{cls.__name__}", type(module).__name__
        assert type(module).__mro__[1:3] == (HSDPModule, cls), type(module).__mro__
        assert hsdp_state(module).module is module
    # One HSDP class per original class; modules not passed to fully_shard keep theirs.
    assert type(model.blocks[0]) is type(model.blocks[1])
    assert type(model.inp) is linear_cls and not isinstance(model.inp, HSDPModule)
    # The original class does not pass its HSDP class on to a subclass.
    sub_cls = type("Sub" + block_cls.__name__, (block_cls,), {})
    sub = sub_cls()
    fully_shard(sub)
    assert type(sub).__name__ == f"HSDPSub{block_cls.__name__}" and type(sub).__mro__[1:3] == (HSDPModule, sub_cls)
    # type(module)(...) (a container's slicing) builds the original class, without a unit.
    fresh = type(model.blocks[0])()
    assert type(fresh) is block_cls and not isinstance(fresh, HSDPModule)
    _raises(lambda: hsdp_state(fresh), ValueError, "was not passed to fully_shard")
    _raises(lambda: copy.deepcopy(model), TypeError, f"HSDP{model_cls.__name__} is fully sharded and cannot be copied")
    _raises(lambda: copy.copy(model.blocks[0]), TypeError, "cannot be copied")
    _raises(lambda: HSDPModule(), TypeError, "call fully_shard(module)")
    # The swapped modules train: forward, backward through the hooks.
    trainer = Trainer(p, model)
    trainer.backward(_local_rows(p))
    _check_grads(p, model, _take_grads(p, trainer), _reference_grads(p), "after the class swap")


def test_class(run_on_ranks) -> None:
    run_on_ranks(check_class, world_size=2, timeout_s=300)


# -- set_reduce_op_type ------------------------------------------------------------------------
def check_reduce_op(mesh_shapes: list[tuple[int, ...]]) -> None:
    p = get_platform()
    ref = _reference_grads(p)
    dp = p.world_size()  # every rank is a data-parallel rank (shard x replicate)
    x = _local_rows(p)
    for shape in mesh_shapes:
        model = _sharded(p, shape)
        trainer = Trainer(p, model)
        assert all(state.reduce_op is ReduceOp.AVG for state in _units(p, model)), "the default is avg"
        trainer.backward(x)
        _check_grads(p, model, _take_grads(p, trainer), ref, f"{shape} default (avg)")
        model.set_reduce_op_type("sum")  # recursive: the root and both blocks
        assert all(state.reduce_op is ReduceOp.SUM for state in _units(p, model))
        trainer.backward(x)
        _check_grads(p, model, _take_grads(p, trainer), {k: dp * v for k, v in ref.items()}, f"{shape} sum")
        model.set_reduce_op_type("avg")
        trainer.backward(x)
        _check_grads(p, model, _take_grads(p, trainer), ref, f"{shape} avg after sum")
        # recurse=False: the root's own parameters (inp, out) summed, the blocks' averaged.
        model.set_reduce_op_type(ReduceOp.SUM, recurse=False)
        trainer.backward(x)
        expected = {k: v if k.startswith("blocks.") else dp * v for k, v in ref.items()}
        _check_grads(p, model, _take_grads(p, trainer), expected, f"{shape} sum on the root only")
        model.set_reduce_op_type("MEAN")
        assert all(state.reduce_op is ReduceOp.AVG for state in _units(p, model))


@pytest.mark.parametrize("world,shapes", [(2, [(2,)]), (4, [(2, 2), (4,)])], ids=["world2", "world4"])
def test_reduce_op(run_on_ranks, world, shapes) -> None:
    run_on_ranks(check_reduce_op, shapes, world_size=world, timeout_s=600)


# -- the other methods ---------------------------------------------------------------------------
def check_methods() -> None:
    p = get_platform()
    ref = _reference_grads(p)
    x = _local_rows(p)
    model = _sharded(p, (p.world_size(),))
    trainer = Trainer(p, model)
    root, blocks = hsdp_state(model), [hsdp_state(b) for b in model.blocks]

    # Bad values raise before any unit changes.
    for bad, error in [("max", ValueError), ("average", ValueError), (ReduceOp.MAX, ValueError), (1, TypeError)]:
        _raises(lambda: model.set_reduce_op_type(bad), error, f"op={bad!r}", "'avg' or 'mean'", "'sum'")
    assert all(state.reduce_op is ReduceOp.AVG for state in _units(p, model))
    _raises(lambda: model.set_requires_gradient_sync("no"), TypeError, "requires_gradient_sync='no' must be a bool")
    _raises(lambda: model.set_reshard_after_forward(1), TypeError, "reshard_after_forward=1 must be a bool")
    assert all(state.reshard_after_forward is True for state in _units(p, model))

    # set_requires_gradient_sync: two micro-batches, the first without any collective.
    model.set_requires_gradient_sync(False, recurse=False)
    assert not root.requires_gradient_sync and all(b.requires_gradient_sync for b in blocks)
    model.set_requires_gradient_sync(False)
    assert not any(state.requires_gradient_sync for state in _units(p, model))
    first, second = np.split(x, 2)
    trainer.backward(first, 0.5)
    assert all(hp.pending_reduce is None and hp.grad_accum is not None for s in _units(p, model) for hp in s.params)
    assert all(not np.any(g) for g in trainer.grad_arrays()), "without sync the sharded gradients are zero"
    model.set_requires_gradient_sync(True)
    trainer.backward(second, 0.5)
    assert all(hp.grad_accum is None for s in _units(p, model) for hp in s.params)
    _check_grads(p, model, _take_grads(p, trainer), ref, "accumulated over two micro-batches")

    # Prefetch setters take HSDPModules; a module that is not one is refused.
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
    assert blocks[0].forward_prefetch == [blocks[1]] and blocks[1].backward_prefetch == [blocks[0]]
    _raises(lambda: model.set_modules_to_forward_prefetch([model.inp]), ValueError, "was not passed to fully_shard")
    trainer.backward(x)
    _check_grads(p, model, _take_grads(p, trainer), ref, "with explicit prefetch")

    # unshard / reshard by hand (not recursive).
    model.blocks[0].unshard(async_op=True)
    assert all(hp.pending is not None for hp in blocks[0].params)
    model.blocks[0].reshard()
    model.blocks[0].unshard()
    assert all(tuple(hp.full().shape) == hp.shape for hp in blocks[0].params)
    assert all(not hp.is_gathered for hp in blocks[1].params + root.params)
    model.blocks[0].reshard()
    assert all(not hp.is_gathered and hp.pending is None for hp in blocks[0].params)

    # set_reshard_after_forward: False keeps every unit gathered from forward to backward.
    model.set_reshard_after_forward(False)
    assert all(state.reshard_after_forward is False for state in _units(p, model))
    loss = trainer._loss(p.from_numpy(x), 1.0) if p.framework == "torch" else None
    if loss is not None:  # torch: look between the forward and the backward
        assert all(hp.is_gathered for s in _units(p, model) for hp in s.params), "not kept"
        loss.backward()
    else:
        trainer.backward(x)
    _check_grads(p, model, _take_grads(p, trainer), ref, "reshard_after_forward=False")
    model.set_reshard_after_forward(True, recurse=False)
    assert root.reshard_after_forward is True and all(b.reshard_after_forward is False for b in blocks)
    model.set_reshard_after_forward(True)
    with p.no_grad():
        model(p.from_numpy(x))
    assert all(not hp.is_gathered for s in _units(p, model) for hp in s.params), "kept after the forward"
    trainer.backward(x)
    _check_grads(p, model, _take_grads(p, trainer), ref, "reshard_after_forward=True again")


def test_methods(run_on_ranks) -> None:
    run_on_ranks(check_methods, world_size=2, timeout_s=300)


# -- replicate_params (MindFormers' argument) --------------------------------------------------
def check_replicate_params(mesh_shape: tuple[int, ...]) -> None:
    """Parameters named in ``replicate_params`` stay whole on every rank (``Replicate()``
    on the shard axis) and their gradients are the one-process gradients (all-reduced,
    averaged like the others); the rest are sharded as before. A parameter not of the
    unit is refused before any collective."""
    p = get_platform()
    ref = _reference_grads(p)
    mesh = init_device_mesh(p.device_type, mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    model = build(p, weights())
    first = dict(p.named_parameters(model.blocks[0]))
    kept = [first[name] for name in sorted(first)][:1]  # one parameter of block 0
    _raises(lambda: fully_shard(model.blocks[0], mesh=mesh, replicate_params=[model.gain]), ValueError,
            "1 of replicate_params are not parameters this call shards")
    fully_shard(list(model.blocks), mesh=mesh, replicate_params=kept)
    fully_shard(model, mesh=mesh, ignored_params=[model.gain])
    replicated = [hp for state in _units(p, model) for hp in state.params if hp.replicated]
    assert [hp.fqn for hp in replicated] == [sorted(first)[0]], [hp.fqn for hp in replicated]
    assert replicated[0].sharded.placements[-1].is_replicate()
    assert tuple(replicated[0].sharded.to_local().shape) == replicated[0].shape  # whole on this rank
    trainer = Trainer(p, model)
    trainer.backward(_local_rows(p))
    _check_grads(p, model, _take_grads(p, trainer), ref, f"{mesh_shape} replicate_params")


@pytest.mark.parametrize("world,shape", [(2, (2,)), (4, (2, 2))], ids=["world2", "hsdp2x2"])
def test_replicate_params(run_on_ranks, world, shape) -> None:
    run_on_ranks(check_replicate_params, shape, world_size=world, timeout_s=600)


# -- MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True) (MindFormers' policy) -------------
def check_main_grad() -> None:
    """Each reduced gradient is also added, in float32, onto ``param.main_grad`` (a DTensor
    laid out as the parameter): after one backward it is the gradient, after two the sum,
    until the root's ``zero_grad()`` clears it; the autograd gradient is unchanged."""
    p = get_platform()
    ref = _reference_grads(p)
    mesh = init_device_mesh(p.device_type, (p.world_size(),), mesh_dim_names=("shard",))
    model = build(p, weights())
    policy = MixedPrecisionPolicy(reduce_dtype=p.dtype("float32"), apply_grad_on_fp32_main_grad=True)
    fully_shard(list(model.blocks), mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, ignored_params=[model.gain], mp_policy=policy)
    params = [param for name, param in p.named_parameters(model) if name != "gain"]
    trainer = Trainer(p, model)
    x = _local_rows(p)
    trainer.backward(x)
    _check_grads(p, model, _take_grads(p, trainer), ref, "autograd gradient with main_grad")
    mains = [p.to_numpy(param.main_grad.to_local()) for param in params]
    assert all(param.main_grad.placements == param.placements for param in params)
    assert all(str(param.main_grad.dtype).lower().endswith("float32") for param in params)
    _check_grads(p, model, mains, ref, "main_grad after one backward")
    trainer.backward(x)
    _take_grads(p, trainer)
    _check_grads(p, model, [p.to_numpy(param.main_grad.to_local()) for param in params],
                 {k: 2 * v for k, v in ref.items()}, "main_grad after two backwards")
    # what MindFormers' trainer calls after each optimizer step: the main gradients of
    # every unit below the root go (and torch's .grad, by nn.Module.zero_grad)
    trainer.backward(x)
    model.zero_grad()
    assert all(getattr(param, "main_grad", None) is None for param in params)
    if p.framework == "torch":
        assert all(param.grad is None for param in params)
    trainer.backward(x)
    _check_grads(p, model, [p.to_numpy(param.main_grad.to_local()) for param in params], ref, "after zero_grad")


def test_main_grad(run_on_ranks) -> None:
    run_on_ranks(check_main_grad, world_size=2, timeout_s=600)
