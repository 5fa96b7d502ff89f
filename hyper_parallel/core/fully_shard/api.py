"""``fully_shard``: FSDP2-style per-parameter sharding, HSDP on a 2-D mesh.

Apply bottom-up (each block, then the root), then build the optimizer (and on
MindSpore the ``value_and_grad`` function) from the module's parameters: fully_shard
replaces each managed parameter by a new framework parameter made from a DTensor (this
rank's chunk as its local tensor), and both torch optimizers and MindSpore's ``value_and_grad`` bind parameter
objects when they are built.

[Note: the HSDPModule class swap]
As FSDP2 (``FSDPModule``), ``fully_shard`` changes the module's class to
``HSDP<Class>``, made by ``type()`` with bases ``(HSDPModule, Class)``: the module
stays an instance of its own class (its ``forward`` / ``construct`` and attributes
unchanged) and gains ``HSDPModule``'s methods, which delegate to its ``HSDPState``.
Both torch ``Module`` and MindSpore ``Cell`` accept the ``__class__`` assignment (a
``Cell``'s ``__setattr__`` passes a plain attribute to ``object.__setattr__``).
The class made for ``Class`` is kept on ``Class`` itself (``vars(Class)["_hsdp_class"]``,
read with ``vars`` so a subclass never inherits its parent's), so every module of one
class gets the same ``HSDP<Class>``: a class per call would make ``type(a) is type(b)``
false for two sharded layers of one kind, and torch.compile guards on the module's
type, so it would compile each layer again (measured with torch 2.13: ten sharded
layers, eight graphs, then the recompile limit). No table of classes is kept anywhere
else. ``HSDPModule.__new__`` builds the original class, so a container's slicing
(``Sequential[1:]``, ``CellList[1:]``, which call ``type(self)(...)``) gives a plain
module, not one that claims to be sharded without a state. Deep and shallow copies
refuse (``TypeError``): the state holds process groups, hooks and gathered buffers; copy
the module before ``fully_shard``, or move values through a state dict. Pickling fails
because ``HSDP<Class>`` is not importable by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hyper_parallel.core.activation_checkpoint.checkpoint import is_checkpointed
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.fully_shard.hsdp_param import HSDPParam
from hyper_parallel.core.fully_shard.hsdp_state import (STATE_ATTR, HSDPContext, HSDPState, parse_reduce_op_type,
                                                     units_in)
from hyper_parallel.core.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.core.tensor_parallel.style import SEQUENCE_PARALLEL_ATTR
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import ReduceOp

#: The attribute of an original class that holds its ``HSDP<Class>`` (in the class's own
#: ``__dict__``); see [Note: the HSDPModule class swap].
_HSDP_CLASS_ATTR = "_hsdp_class"
#: The attribute of an ``HSDP<Class>`` that names ``Class``.
_ORIGINAL_CLASS_ATTR = "_hsdp_original_class"


def hsdp_state(module: Any) -> HSDPState:
    """The fully_shard state of ``module``: ``unshard()``, ``reshard()``,
    ``set_requires_gradient_sync(bool)``, ``forward_prefetch``/``backward_prefetch``.

    Raises:
        ValueError: ``module`` was not passed to ``fully_shard``.
    """
    state = vars(module).get(STATE_ATTR)
    if state is None:
        raise ValueError(f"hsdp_state: {type(module).__name__} was not passed to fully_shard; call fully_shard on it")
    return state


class HSDPModule:
    """What a module passed to ``fully_shard`` becomes (PyTorch FSDP2's ``FSDPModule``):
    ``fully_shard`` changes its class to ``HSDP<Class>``, a subclass of this mixin and
    of its own class (see [Note: the HSDPModule class swap]), so
    ``isinstance(module, HSDPModule)`` tells a fully sharded module and these methods
    act on its unit (``hsdp_state(module)``). Not meant to be subclassed or built
    directly.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Builds the original class (a container's slicing calls type(self)(...)): the
        # new module has no unit, so it must not be an HSDPModule.
        original = vars(cls).get(_ORIGINAL_CLASS_ATTR)
        if original is None:
            raise TypeError(f"{cls.__name__}: HSDPModule is not instantiated or subclassed directly; call "
                            "fully_shard(module), which makes the module an HSDPModule")
        module = original.__new__(original, *args, **kwargs)
        module.__init__(*args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(f"{type(self).__name__} is fully sharded and cannot be copied: its state holds process "
                        "groups, hooks and gathered buffers. Copy the module before fully_shard, or load its "
                        "values into another sharded module (full_state_dict / load_full_state_dict)")

    def __copy__(self) -> Any:
        return self.__deepcopy__({})

    def unshard(self, async_op: bool = False) -> None:
        """All-gather this unit's parameters over the shard axis (not recursive); with
        ``async_op`` the all-gathers are only issued and the unit's next use waits for
        them (returns ``None``, no handle). See ``HSDPState.unshard``."""
        hsdp_state(self).unshard(async_op)

    def reshard(self) -> None:
        """Drop this unit's gathered parameters (not recursive). See ``HSDPState.reshard``."""
        hsdp_state(self).reshard()

    def set_modules_to_forward_prefetch(self, modules: Sequence[Any]) -> None:
        """When this unit's forward starts, issue the all-gathers of ``modules`` (fully
        sharded modules, e.g. the next layers) asynchronously.

        Raises:
            ValueError: a module that was not passed to fully_shard.
        """
        hsdp_state(self).set_modules_to_forward_prefetch(list(modules))

    def set_modules_to_backward_prefetch(self, modules: Sequence[Any]) -> None:
        """When this unit's backward starts, issue the all-gathers of ``modules`` (fully
        sharded modules, e.g. the previous layers); replaces the implicit prefetch of the
        unit the backward reaches next.

        Raises:
            ValueError: a module that was not passed to fully_shard.
        """
        hsdp_state(self).set_modules_to_backward_prefetch(list(modules))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backwards accumulate full gradients locally, with no collective,
        and hand the optimizer zero sharded gradients; the next backward with ``True``
        reduces the sum once (gradient accumulation; on HSDP both the reduce-scatter and
        the replicate all-reduce are skipped). ``recurse``: this module's unit and every
        fully sharded module inside it (``False``: this unit only).

        Raises:
            TypeError: ``requires_gradient_sync`` is not a bool.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync: requires_gradient_sync={requires_gradient_sync!r} must "
                            "be a bool")
        for state in _units(self, recurse):
            state.set_requires_gradient_sync(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` to ``True`` / ``False`` from each unit's next
        forward on (``False`` for evaluation, ``True`` again for training). ``recurse``:
        this unit and every fully sharded module inside it. An int ``k`` is only taken
        by ``fully_shard``. See ``HSDPState.set_reshard_after_forward``.

        Raises:
            TypeError: ``reshard_after_forward`` is not a bool.
        """
        for state in _units(self, recurse):  # the first unit's check raises before any change
            state.set_reshard_after_forward(reshard_after_forward)

    def set_reduce_op_type(self, op: str | ReduceOp, *, recurse: bool = True) -> None:
        """How gradients are reduced over the data-parallel ranks (``N`` shard ranks,
        times ``R`` replicate ranks on HSDP): ``"avg"`` or ``"mean"`` (the default)
        divides the sum by ``N * R``, the gradient of the global-batch mean when each
        rank's loss is the mean over its equal share; ``"sum"`` leaves the sum over the
        ranks (a loss whose scaling already divides: MindFormers). ``ReduceOp.AVG`` /
        ``ReduceOp.SUM`` are accepted too; names are case-insensitive. ``recurse``: this
        unit and every fully sharded module inside it (``False``: this unit only). Set
        it between steps.

        Raises:
            TypeError: ``op`` is not a str or a ReduceOp.
            ValueError: ``op`` is another value; the message lists the accepted ones.
        """
        reduce_op = parse_reduce_op_type(op)  # before any unit changes
        for state in _units(self, recurse):
            state.set_reduce_op_type(reduce_op)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter of this module and below it, as
        ``torch.nn.Module.zero_grad`` does, and the float32 ``param.main_grad`` that
        ``MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)`` adds each reduced
        gradient onto (set to ``None``; the next backward makes it anew): without this
        the main gradients of one step would carry into the next. MindFormers' trainer
        calls it after every optimizer step. ``param.grad``: the framework module's own
        ``zero_grad(set_to_none)`` where it has one (torch), else set to ``None``
        (MindSpore's ``Cell`` has none)."""
        params = [param for _, param in get_platform().named_parameters(self)]
        for param in params:
            if getattr(param, "main_grad", None) is not None:
                param.main_grad = None
        original = super()
        if hasattr(original, "zero_grad"):
            original.zero_grad(set_to_none)
            return
        for param in params:
            param.grad = None


def _units(module: Any, recurse: bool) -> list[HSDPState]:
    """The unit of ``module``, and with ``recurse`` those of every fully sharded module
    inside it (module order, ``module`` first)."""
    if not recurse:
        return [hsdp_state(module)]
    p = get_platform()
    return [hsdp_state(sub) for _, sub in p.named_modules(module) if isinstance(sub, HSDPModule)]


def _hsdp_class(cls: type) -> type:
    """``HSDP<cls>``, made once per class and kept on ``cls`` (see [Note: the HSDPModule
    class swap])."""
    made = vars(cls).get(_HSDP_CLASS_ATTR)
    if made is None:
        made = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {_ORIGINAL_CLASS_ATTR: cls})
        setattr(cls, _HSDP_CLASS_ATTR, made)
    return made


def _direct_params(module: Any) -> list[tuple[str, Any]]:
    p = get_platform()
    return [(name, param) for name, param in p.named_parameters(module) if "." not in name]


def _check_options(reshard_after_forward: Any, mp_policy: Any, offload_policy: Any) -> None:
    if not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(f"fully_shard: reshard_after_forward must be a bool or an int, got {reshard_after_forward!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy (or CPUOffloadPolicy(pin_memory=...)), "
                        f"got {type(offload_policy).__name__}")


def _check_mesh(mesh: Any, reshard_after_forward: bool | int) -> None:
    p = get_platform()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard: mesh has {mesh.ndim} axes {mesh.shape}; pass a 1-D (shard) mesh or a 2-D "
                         "(replicate, shard) mesh for HSDP")
    # A submesh is allowed (composition with tensor parallelism: fully_shard over
    # mesh2d["dp"] after parallelize_module over mesh2d["tp"]); this rank must be in it.
    # Its ranks are world ranks: every DeviceMesh descends from one over the world.
    if mesh.get_coordinate() is None:
        raise ValueError(f"fully_shard: rank {p.rank()} is not in mesh {mesh.mesh.tolist()}; pass the (sub)mesh "
                         "that holds this rank (e.g. mesh2d['dp'] taken on every rank)")
    shard_size = mesh.shape[-1]
    if not isinstance(reshard_after_forward, bool) and (
            reshard_after_forward < 1 or shard_size % reshard_after_forward):
        raise ValueError(f"fully_shard: reshard_after_forward={reshard_after_forward} must divide the shard axis "
                         f"size {shard_size} (it is the size of the smaller group parameters are resharded to "
                         "after the forward); pass a divisor, True or False")


def _managed_params(module: Any, ignored: set[int]) -> list[tuple[str, Any]]:
    p = get_platform()
    managed = []
    for fqn, param in p.named_parameters(module):
        if id(param) in ignored:
            continue
        if len(tuple(param.shape)) == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1-D tensor with "
                             "numel equal to 1, or pass it in ignored_params")
        managed.append((fqn, param))
    return managed


def fully_shard(module: Any | Sequence[Any], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int = True,
                shard_placement_fn: Callable[[Any], Shard | None] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: Iterable[Any] | None = None,
                replicate_params: Iterable[Any] | None = None) -> Any:
    """Shard ``module``'s parameters over ``mesh`` and gather them around its forward
    and backward (PyTorch FSDP2 semantics; SimpleFSDP's differentiable gather, arXiv
    2411.00284).

    Each parameter of ``module`` not managed by an earlier fully_shard call on a
    submodule (apply bottom-up) and not in ``ignored_params`` is replaced by a
    framework parameter made from a DTensor: placements ``[Shard(0)]`` (or what
    ``shard_placement_fn(param)`` returns; ``[Replicate(), Shard(d)]`` on HSDP), the
    global shape, this rank's unpadded chunk of ``ceil(size / N)`` rows as its local
    tensor; after tensor parallelism, on the joint ``(tp, dp...)`` mesh (see
    ``hsdp_param``). The module must hold the same values on every rank.

    Per step: forward pre-hook **all-gathers** the unit's parameters over the shard
    axis; forward post-hook drops them (``reshard_after_forward=True``), keeps them
    until their gradients are done (``False``), or keeps a ``k / N`` block (int ``k``); backward all-gathers again where
    needed (prefetching the previous unit), then **reduce-scatters** each full
    gradient to its shard and, on a 2-D mesh ``(replicate, shard)`` (HSDP),
    **all-reduces** it over the replicate axis; gradients are divided by the
    data-parallel size (the mean over the global batch when each rank's loss is a
    mean over its equal share), or summed with ``module.set_reduce_op_type("sum")``.

    Args:
        module: a torch ``nn.Module`` / MindSpore ``Cell``, or a list of them (one unit each).
        mesh: default: a 1-D mesh over the world. A submesh (``mesh2d["dp"]``) shards
            over its ranks only: after ``parallelize_module(module, mesh2d["tp"], plan)``
            each parameter is this rank's tensor-parallel shard, and fully_shard shards
            that local tensor further (see ``docs/fully_shard.md``, composition with TP);
            a ``SequenceParallel`` module's parameters get their tp all-reduce on the
            gathered parameter's gradient, before the reduce-scatter over dp.
        reshard_after_forward: ``True``; ``False``; or an int ``k`` dividing the shard
            axis size: after the forward each rank keeps the ``k`` shards of its block
            of ``k`` consecutive shard ranks (``k / N`` of each parameter) and the
            backward all-gathers over the ``N / k`` ranks of its block position.
        shard_placement_fn: ``param -> Shard(dim) | None`` (``None``: ``Shard(0)``).
        mp_policy: ``MixedPrecisionPolicy``.
        offload_policy: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy(pin_memory)``: the
            shards, their gradients and so the optimizer step in host memory; each
            all-gather copies the shard to the device first, each reduced gradient is
            copied back (no copy on CPU backends).
        ignored_params: parameters left as they are (not sharded, not reduced).
        replicate_params: parameters of the unit kept whole on every rank of the mesh
            (``Replicate()`` on the shard axis: no all-gather, the gradient
            **all-reduced** over the shard axis and divided like the others, see [Note:
            no empty chunks on MindSpore] in ``hsdp_param``); MindFormers' argument.

    Returns:
        ``module``, its class changed to ``HSDP<Class>``: an ``HSDPModule`` (``unshard``,
        ``reshard``, ``set_modules_to_forward_prefetch``, ``set_requires_gradient_sync``,
        ``set_reduce_op_type``, ...) and still an instance of its class (see [Note: the
        HSDPModule class swap]); its state is ``hsdp_state(module)``. A list: the list.

    Raises:
        TypeError / ValueError: a mesh that is not a DeviceMesh, not 1-D/2-D, or not
            holding this rank; a scalar parameter; a bad policy; a placement that is
            not ``Shard``. All are raised on every rank before any collective.
    """
    if isinstance(module, (list, tuple)):
        # each module's call takes the replicate_params among its own parameters
        wanted = list(replicate_params or ())
        owned = [{id(x) for _, x in get_platform().named_parameters(m)} for m in module]
        stray = [x for x in wanted if not any(id(x) in own for own in owned)]
        if stray:
            raise ValueError(f"fully_shard: {len(stray)} of replicate_params are parameters of none of the "
                             f"{len(module)} modules; pass only their own parameters")
        for m, own in zip(module, owned):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=shard_placement_fn, mp_policy=mp_policy, offload_policy=offload_policy,
                        ignored_params=ignored_params, replicate_params=[x for x in wanted if id(x) in own])
        return module
    p = get_platform()
    if STATE_ATTR in vars(module):
        raise ValueError(f"fully_shard: {type(module).__name__} is already fully sharded")
    _check_options(reshard_after_forward, mp_policy, offload_policy)
    ignored = {id(param) for param in (ignored_params or ())}
    replicate = {id(param) for param in (replicate_params or ())}
    # Parameters already managed by units below, and the submodules those units own.
    children = units_in(module)
    in_children = {id(hp.sharded) for child in children for hp in child.params}
    replaced = {hp.source_id for child in children for hp in child.params}
    managed = _managed_params(module, ignored | in_children)
    stray = replicate - {id(param) for _, param in managed}
    if stray:
        raise ValueError(f"fully_shard: {len(stray)} of replicate_params are not parameters this call shards on "
                         f"{type(module).__name__} (another unit's, ignored, or not the module's); pass only the "
                         "unit's own parameters")
    inside_children = {id(sub) for child in children for _, sub in p.named_modules(child.module)}
    for name, sub in p.named_modules(module):
        if id(sub) in inside_children:
            continue
        for attr, param in _direct_params(sub):
            if id(param) in in_children or id(param) in replaced:
                raise ValueError(f"fully_shard: {name + '.' if name else ''}{attr} is a parameter of an inner "
                                 "fully_shard unit but is also read outside it (a weight tied across units); "
                                 "apply fully_shard to a module that holds every use (e.g. the root only)")
        if is_checkpointed(sub) and _direct_params(sub):
            # [Note: recomputation and gathered parameters] (hsdp_state): the module's own
            # hooks run outside its recomputation, so nothing could hand it the gathered tensors.
            raise ValueError(f"fully_shard: {name or type(module).__name__} is checkpointed and holds parameters "
                             f"directly ({', '.join(attr for attr, _ in _direct_params(sub))}); checkpoint a module "
                             "whose parameters live in its submodules (a decoder block), or one around it")
    if mesh is None:  # after the checks: building a mesh creates groups (a collective)
        mesh = init_device_mesh(p.device_type, (p.world_size(),))
    _check_mesh(mesh, reshard_after_forward)
    placements = []
    for fqn, param in managed:
        placement = shard_placement_fn(param) if shard_placement_fn is not None else None
        placement = Shard(0) if placement is None else placement
        if not isinstance(placement, Shard):
            raise ValueError(f"fully_shard: shard_placement_fn returned {placement!r} for {fqn}; return Shard(dim)")
        if not -len(param.shape) <= placement.dim < len(param.shape):
            raise ValueError(f"fully_shard: {placement!r} for {fqn} of shape {tuple(param.shape)} is out of range")
        placements.append(placement)
    # Every (module, attribute) that holds a managed parameter: tied weights have several.
    uses: dict[int, list[tuple[Any, str]]] = {id(param): [] for _, param in managed}
    for _, sub in p.named_modules(module):
        if id(sub) in inside_children:
            continue
        for name, param in _direct_params(sub):
            if id(param) in uses:
                uses[id(param)].append((sub, name))
    params = []
    for (fqn, param), placement in zip(managed, placements):
        offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
        hp = HSDPParam(fqn, param, uses[id(param)], mesh, placement, offload, replicate=id(param) in replicate)
        # SequenceParallel all-reduces its parameters' gradients over tp with a hook on
        # the parameter object, which is replaced here: the unit does that all-reduce
        # on the gathered parameter's gradient, before the reduce-scatter over dp.
        hp.sequence_parallel_group = next((vars(owner)[SEQUENCE_PARALLEL_ATTR] for owner, _ in hp.uses
                                           if vars(owner).get(SEQUENCE_PARALLEL_ATTR) is not None), None)
        for owner, name in hp.uses:
            p.set_parameter(owner, name, hp.sharded)
        params.append(hp)
    state = HSDPState(module, params, reshard_after_forward, mp_policy, mesh)
    context = HSDPContext()
    context.units = [*children, state]
    for child in children:
        child.is_root = False
        child.context = context
    state.context = context
    vars(module)[STATE_ATTR] = state
    if not isinstance(module, HSDPModule):
        module.__class__ = _hsdp_class(type(module))  # [Note: the HSDPModule class swap]
    return module
