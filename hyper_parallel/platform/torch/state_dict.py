"""``torch.distributed.checkpoint.state_dict``'s four functions for models whose
parameters (and optimizer moments) are this project's DTensors: the same names,
arguments and ``StateDictOptions``, and the results torch gives for its own DTensor.

torch's own functions treat this DTensor class as a plain tensor (see [Note: DTensors
and torch's state-dict functions] in ``checkpoint.py``). What that means, per call:

| call | torch's function | here |
|---|---|---|
| ``get_*_state_dict`` (default options) | correct: the DTensors (global shapes; moments sharded like their parameters) | the same (delegated) |
| ``get_*_state_dict(full_state_dict=True)`` | our DTensors come back ungathered | plain full tensors (all-gathered), on rank 0 only with ``cpu_offload`` |
| ``set_model_state_dict`` (any options) | correct: DTensor values copy DTensor to DTensor, plain full values copy this rank's piece | the same (delegated) |
| ``set_optimizer_state_dict`` (default options) | correct | the same (delegated) |
| ``set_optimizer_state_dict(full_state_dict=True)`` | leaves plain full moments; the next step raises | each moment's piece copied into the optimizer's DTensor moment |

Usage (every rank calls; each function is collective where it gathers or broadcasts)::

    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from hyper_parallel.platform.torch import state_dict as hp_sd

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = hp_sd.get_model_state_dict(model, options=full)        # rank 0: {fqn: full tensor}
    optim_sd = hp_sd.get_optimizer_state_dict(model, opt, options=full)
    ...
    hp_sd.set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True,
                                                                        broadcast_from_rank0=True))
    hp_sd.set_optimizer_state_dict(model, opt, optim_sd, options=StateDictOptions(full_state_dict=True,
                                                                                 broadcast_from_rank0=True))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor as TorchDTensor

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "set_model_state_dict",
           "set_optimizer_state_dict"]

Path = tuple[Any, ...]


def _sharded(options: StateDictOptions | None) -> StateDictOptions:
    """``options`` for torch's function that returns the DTensors themselves."""
    return dataclasses.replace(options or StateDictOptions(), full_state_dict=False, cpu_offload=False,
                               broadcast_from_rank0=False)


def _is_ours(x: Any) -> bool:
    """This project's torch DTensor (``platform/torch/dtensor.py``): a tensor subclass with
    DCP's chunk protocol that is not torch's DTensor (the platform stays below core, so
    the class is known by what it implements, not imported)."""
    return isinstance(x, torch.Tensor) and hasattr(type(x), "__create_chunk_list__") \
        and hasattr(x, "full_tensor") and not isinstance(x, TorchDTensor)


def _is_distributed(x: Any) -> bool:
    return isinstance(x, TorchDTensor) or _is_ours(x)


def _map(obj: Any, fn: Callable[[Path, torch.Tensor], Any], path: Path = ()) -> Any:
    """``obj`` (nested dicts, lists and tuples, as state dicts are) with each tensor leaf
    replaced by ``fn(path, leaf)``; leaves visited in the containers' order, which is the
    same on every rank (module and optimizer order), so a collective per leaf matches."""
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_map(v, fn, path + (i,)) for i, v in enumerate(obj)]
        return tuple(out) if isinstance(obj, tuple) else out
    return obj


def _full(state_dict: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    """torch's ``_maybe_full_or_cpu_state_dict`` for both DTensor classes: with
    ``full_state_dict`` every DTensor is all-gathered (``full_tensor()``, on every rank),
    and with ``cpu_offload`` too only rank 0 keeps the result (on the host), the others
    get ``{}``; with ``cpu_offload`` alone every tensor moves to the host."""
    if not options.full_state_dict:
        if not options.cpu_offload:
            return state_dict
        return _map(state_dict, lambda _, t: t.cpu())
    keep = not options.cpu_offload or not dist.is_initialized() or dist.get_rank() == 0

    def gather(_: Path, t: torch.Tensor) -> torch.Tensor:
        if not _is_distributed(t):
            return t.cpu() if options.cpu_offload else t
        # collective: every rank, in the same order. Contiguous: a gather along dim > 0
        # may leave a strided view, whose raw memory torch's broadcast_from_rank0 would
        # send as if contiguous (and safetensors refuses)
        full = t.full_tensor().contiguous()
        return full.cpu() if options.cpu_offload else full

    with torch.no_grad():
        out = _map(state_dict, gather)
    return out if keep else {}


def get_model_state_dict(model: torch.nn.Module, *, submodules: set[torch.nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict as torch's ``get_model_state_dict`` gives it for torch's DTensor.

    Default options: ``{fqn: DTensor parameter}`` (global shapes, this rank's piece
    inside; no communication), for ``torch.distributed.checkpoint.save``.
    ``full_state_dict=True``: ``{fqn: torch.Tensor}`` of the global shapes on every rank;
    with ``cpu_offload=True`` too, on the host on rank 0 and ``{}`` on the others.

    Collective: with ``full_state_dict``, one all-gather per sharded mesh axis of each
    DTensor (``full_tensor``), on every rank, in the state dict's order.

    Raises:
        whatever torch's function raises for ``model`` and ``options``.
    """
    options = options or StateDictOptions()
    sd = dsd.get_model_state_dict(model, submodules=submodules, options=_sharded(options))
    return _full(sd, options)


def get_optimizer_state_dict(model: torch.nn.Module, optimizers: torch.optim.Optimizer | Any, *,
                             submodules: set[torch.nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' state dict keyed by parameter fqns, as torch's
    ``get_optimizer_state_dict`` gives it for torch's DTensor.

    Default options: ``{"state": {fqn: {"step": tensor, "exp_avg": DTensor, ...}},
    "param_groups": [...]}``, each moment a DTensor with its parameter's spec (no
    communication). ``full_state_dict=True``: the moments as full ``torch.Tensor`` s of
    the parameters' global shapes; with ``cpu_offload=True`` on rank 0 only (others
    ``{}``). ``flatten_optimizer_state_dict`` is honoured (torch flattens).

    Collective: as ``get_model_state_dict``, one gather per DTensor moment.

    Raises:
        whatever torch's function raises.
    """
    options = options or StateDictOptions()
    osd = dsd.get_optimizer_state_dict(model, optimizers, submodules=submodules, options=_sharded(options))
    return _full(osd, options)


def set_model_state_dict(model: torch.nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> Any:
    """torch's ``set_model_state_dict``, which is correct for this DTensor class: a
    DTensor value (from ``torch.distributed.checkpoint.load``) is copied DTensor to
    DTensor; a plain full tensor (``full_state_dict=True``, each rank's, or rank 0's
    broadcast by torch with ``broadcast_from_rank0=True``) copies this rank's piece (see
    [Note: DTensors and torch's state-dict functions]). Returns torch's
    ``_IncompatibleKeys``.

    Raises:
        RuntimeError: a plain value of another shape than the parameter's global shape,
            and whatever torch's function raises (missing keys with ``strict``).
    """
    return dsd.set_model_state_dict(model, model_state_dict, options=options or StateDictOptions())


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    """A tensor leaf of rank 0's full state dict, as the other ranks learn it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _leaves(obj: Any, path: Path = ()) -> dict[Path, Any]:
    if isinstance(obj, dict):
        return {p: v for k, value in obj.items() for p, v in _leaves(value, path + (k,)).items()}
    if isinstance(obj, (list, tuple)) and not (obj and all(isinstance(v, (int, float, str)) for v in obj)):
        return {p: v for i, value in enumerate(obj) for p, v in _leaves(value, path + (i,)).items()}
    return {path: obj}


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def set_optimizer_state_dict(model: torch.nn.Module, optimizers: torch.optim.Optimizer | Any,
                             optim_state_dict: dict[str, Any], *, options: StateDictOptions | None = None) -> None:
    """Load an optimizer state dict keyed by fqns (``get_optimizer_state_dict``'s form).

    Default options: torch's function (DTensor moments, e.g. after
    ``torch.distributed.checkpoint.load``, are loaded as they are). ``full_state_dict=True``:
    ``optim_state_dict`` holds full moments (the parameters' global shapes) on every
    rank, or with ``broadcast_from_rank0=True`` on rank 0 only (others may pass ``{}``);
    each rank copies its piece into the optimizer's own DTensor moment (made, as torch
    does, by a step with zero gradients and learning rate 0 when the optimizer has no
    state yet), then torch's function loads the result.

    Collective: with ``broadcast_from_rank0``, one ``broadcast_object_list`` of rank 0's
    dict without its tensors, then one broadcast per tensor from rank 0.

    Raises:
        ValueError: with ``full_state_dict``, a moment of a DTensor parameter missing from
            the (rank 0's) dict or of another shape than its parameter's global shape
            (with ``broadcast_from_rank0`` every rank raises, before any tensor is sent);
            ``broadcast_from_rank0`` without ``full_state_dict``.
        whatever torch's function raises (e.g. a missing parameter with ``strict``).
    """
    options = options or StateDictOptions()
    if not options.full_state_dict:
        if options.broadcast_from_rank0:
            raise ValueError("set_optimizer_state_dict: broadcast_from_rank0=True needs full_state_dict=True "
                             "(as torch's); a sharded state dict is loaded by every rank")
        dsd.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
        return
    local = dsd.get_optimizer_state_dict(model, optimizers, options=_sharded(options))
    # this project's DTensor moments: each takes its piece of the full moment (torch's own
    # DTensor class is not mixed into hyper_parallel's models)
    targets = {path: leaf for path, leaf in _leaves(local).items() if _is_ours(leaf)}
    device = next((leaf.device for leaf in targets.values()), torch.device("cpu"))
    broadcast = options.broadcast_from_rank0 and dist.is_initialized() and dist.get_world_size() > 1
    source = dist.get_rank() == 0 if broadcast else True
    given = _leaves(optim_state_dict) if source else {}
    bad = sorted((str(path), tuple(leaf.shape)) for path, leaf in targets.items()
                 if not isinstance(given.get(path), torch.Tensor) or tuple(given[path].shape) != tuple(leaf.shape)) \
        if source else []
    if broadcast:
        skeleton = _map(optim_state_dict, lambda _, t: _TensorInfo(tuple(t.shape), t.dtype)) if source else None
        box = [skeleton, bad]
        dist.broadcast_object_list(box, src=0)
        skeleton, bad = box
        given = _leaves(skeleton)
    if bad:
        where = "rank 0's optim_state_dict" if broadcast else "optim_state_dict"
        raise ValueError(f"set_optimizer_state_dict(full_state_dict=True): {where} lacks {len(bad)} moments of "
                       f"DTensor parameters or has them in another shape (first: {bad[:3]}); pass "
                       "get_optimizer_state_dict(model, optimizers, options=StateDictOptions(full_state_dict=True))'s "
                       "form, each moment of its parameter's global shape")

    def load(path: Path, value: Any) -> Any:
        if broadcast:
            # one tensor at a time, as torch broadcasts (peak memory: one full moment), on
            # the moments' device (the process group's)
            full = (_get(optim_state_dict, path).detach().to(device).contiguous() if dist.get_rank() == 0
                    else torch.empty(value.shape, dtype=value.dtype, device=device))
            dist.broadcast(full, src=0)
        else:
            full = value
        if path not in targets:
            # a plain state (a moment of a plain parameter; the step, kept on the host as
            # torch's _distribute_state_dict keeps 0-dim values): torch loads it. A copy: the
            # caller's dict may hold the live tensors of another optimizer (state dicts are
            # references), whose steps must not move these ones.
            return full.detach().cpu().clone() if full.dim() == 0 else full.detach().clone()
        with torch.no_grad():
            return targets[path].copy_(full.detach())  # this rank's piece, into the optimizer's moment

    tree = skeleton if broadcast else optim_state_dict
    loaded = _map_infos(tree, load) if broadcast else _map(tree, load)
    dsd.set_optimizer_state_dict(model, optimizers, loaded, options=_sharded(options))


def _map_infos(obj: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """``_map`` over a skeleton whose tensor leaves are ``_TensorInfo``."""
    if isinstance(obj, _TensorInfo):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map_infos(v, fn, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_map_infos(v, fn, path + (i,)) for i, v in enumerate(obj)]
        return tuple(out) if isinstance(obj, tuple) else out
    return obj
