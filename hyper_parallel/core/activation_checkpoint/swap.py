"""Activation swap: the activations a module saves for its backward are copied to host
memory after its forward and back to the device before its backward, so device memory
holds them only while they are needed (MindSpore's ``swap_wrapper`` / ``SwapManager`` and
``CheckpointPolicy.MUST_SWAP``, which MindFormers' ``swap_config`` drives; torch's
``autograd.graph.save_on_cpu`` is the synchronous form).

[Note: activation swap]
What is swapped: every tensor that autograd saves inside the module's forward, except
the module's parameters, what fully_shard releases itself, and what ``policy_fn`` keeps
(``policy_fn(tensor) -> CheckpointPolicy``: ``MUST_SWAP`` swaps, ``MUST_SAVE`` /
``PREFER_SAVE`` keep; MindFormers keeps its uint8 attention masks). The backend hands
them over (``platform.release_saved_tensors(..., offload=)``, [Note: stacked saved-tensor
contexts] in ``platform/saved_tensor_layers``). Each forward call's swapped tensors form
one group.

When, for modules linked in forward order by ``SwapManager().set_forward_prefetch_layer``
(a chain ``L0 -> L1 -> L2``):

- forward: when ``Li`` ends its forward, the copies of its group to host are issued on a
  copy stream (after the compute stream's work so far, an event); when ``Li+1`` ends
  its forward, the compute stream waits for ``Li``'s copies and the device tensors are
  dropped, so their memory is reused by what follows. The copies overlap ``Li+1``'s
  forward. The last module of the chain is not swapped: its backward comes first.
- backward: when the backward reaches ``Li+1`` (its backward pre-hook), the copies of
  ``Li``'s group back to the device are issued on the copy stream, overlapping
  ``Li+1``'s backward; ``Li``'s first use of a swapped tensor makes the compute stream
  wait for them.

A swapped module outside any chain copies its group to host as its forward ends and
waits for that at once; its backward copies it back at its first use, and waits. A
group whose tensors are still on the device when the backward needs them (its copy to
host not waited for yet) is read there. A group the backward never reaches is freed with
the graph that holds it. Under a pipeline schedule several forwards of one module are in
flight; the prefetch then takes the group swapped last, and any other group is loaded at
its first use (MindFormers refuses swap with pipeline parallelism).

On CPU backends host memory is device memory: ``platform.to_device`` returns the tensor
itself, so the groups go through the same steps and nothing moves.

Inside a checkpointed region (``checkpoint_phase()`` is not None) a swapped module runs
as is: the recomputation keeps nothing there to swap.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable
from typing import Any

from hyper_parallel.core.activation_checkpoint.checkpoint import is_module, wrap_calls
from hyper_parallel.core.activation_checkpoint.policy import CheckpointPolicy
from hyper_parallel.core.activation_checkpoint.region import checkpoint_phase
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

#: The attribute of a swapped module (or wrapper function) that holds its ``_SwapHandle``.
SWAP_ATTR = "_swap_handle"
#: The attribute of a module that is not swapped but follows a swapped one (``_Follower``).
FOLLOW_ATTR = "_swap_follows"

_KEEP = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


@dataclasses.dataclass
class SwapStats:
    """Counts over a swapped module's forwards and backwards so far.

    Attributes:
        tensors_swapped: saved tensors handed to the swap (all forwards).
        tensors_kept: saved tensors ``policy_fn`` kept on the device.
        bytes_swapped: bytes of ``tensors_swapped``.
        offloads: groups copied to host.
        prefetches: groups whose copy back the next module's backward started ahead.
            The last module of a chain swaps nothing: all its counts stay 0.
        loads_on_use: groups copied back only when the backward first read them.
    """

    tensors_swapped: int = 0
    tensors_kept: int = 0
    bytes_swapped: int = 0
    offloads: int = 0
    prefetches: int = 0
    loads_on_use: int = 0


class _State(enum.Enum):
    DEVICE = "device"  # not offloaded (yet): device tensors are held
    OFFLOADING = "offloading"  # copies to host issued, device tensors still held
    HOST = "host"  # device tensors dropped
    LOADING = "loading"  # copies back issued
    LOADED = "loaded"  # back on the device, the compute stream waited


class _Group:
    """The tensors one forward call of a swapped module saved for its backward."""

    def __init__(self, owner: _SwapHandle) -> None:
        self.owner = owner
        self.device: list[Any] = []
        self.host: list[Any] = []
        self.state = _State.DEVICE
        self.event: Any = None

    def _copy(self, tensors: list[Any], device: str) -> list[Any]:
        p = get_platform()
        stream = self.owner.copy_stream()
        ready = p.record_event()  # the copies start after what the compute stream issued so far
        p.wait_event(ready, stream)
        with p.no_grad():
            copies = [p.to_device(t, device, pin_memory=True, stream=stream) for t in tensors]
        self.event = p.record_event(stream)
        return copies

    def launch_offload(self) -> None:
        self.host = self._copy(self.device, "cpu")
        self.state = _State.OFFLOADING
        self.owner.stats.offloads += 1

    def finish_offload(self) -> None:
        if self.state is _State.OFFLOADING:
            # After the wait, what the compute stream does next comes after the copies, so
            # the memory of the dropped device tensors may be reused.
            get_platform().wait_event(self.event)
            self.device = [None] * len(self.device)
            self.state = _State.HOST

    def launch_load(self) -> None:
        self.device = self._copy(self.host, get_platform().device_type)
        self.state = _State.LOADING

    def get(self, index: int) -> Any:
        if self.state is _State.HOST:
            self.launch_load()
            self.owner.stats.loads_on_use += 1
        if self.state is _State.LOADING:
            get_platform().wait_event(self.event)
            self.host = []
            self.state = _State.LOADED
        return self.device[index]


class _Ref:
    """What autograd stores for a swapped tensor."""

    __slots__ = ("group", "index")

    def __init__(self, group: _Group, index: int) -> None:
        self.group = group
        self.index = index


class _Follower:
    """A module's place in a ``SwapManager`` chain: what precedes it, and the backward
    pre-hook that prefetches that. A module that is not swapped but follows a swapped one
    holds only this."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.prev: _SwapHandle | None = None
        self.hooks: list[Any] = []

    def before_backward(self, module: Any, grad_output: Any) -> None:
        if self.prev is not None:
            self.prev.prefetch()


class _SwapHandle(_Follower):
    """A swapped module's policy, chain links, groups and counts."""

    def __init__(self, name: str, policy_fn: Callable[[Any], Any] | None) -> None:
        super().__init__(name)
        self.policy_fn = policy_fn
        self.next: _Follower | None = None
        self.stats = SwapStats()
        self._stream: Any = None
        self._swapped: list[weakref.ref[_Group]] = []  # the groups offloaded, while the graph holds them

    def copy_stream(self) -> Any:
        if self._stream is None:
            self._stream = get_platform().new_stream()
        return self._stream

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], params: list[Any]) -> Any:
        p = get_platform()
        if checkpoint_phase() is not None or not p.grad_enabled():
            return fn(*args)
        if self.next is None and self.prev is not None:  # the chain's last: its backward comes first
            out = fn(*args)
        else:
            sources = [t.to_local() if isinstance(t, DTensor) else t for t in params]
            group = _Group(self)
            with p.release_saved_tensors(sources, sources.__getitem__,
                                         offload=(functools.partial(self._pack, group), _unpack)):
                out = fn(*args)
            if group.device:
                group.launch_offload()
                self._swapped = [ref for ref in self._swapped if ref() is not None] + [weakref.ref(group)]
                if self.next is None:  # unlinked: nothing later to overlap the copies with
                    group.finish_offload()
        if self.prev is not None:
            self.prev.finish_offloads()
        return out

    def _pack(self, group: _Group, tensor: Any) -> Any:
        decision = CheckpointPolicy.MUST_SWAP if self.policy_fn is None else self.policy_fn(tensor)
        if decision in _KEEP:
            self.stats.tensors_kept += 1
            return tensor
        if decision is not CheckpointPolicy.MUST_SWAP:
            raise ValueError(f"swap_wrapper({self.name}): policy_fn returned {decision!r} for a saved tensor of shape "
                             f"{tuple(tensor.shape)}; return CheckpointPolicy.MUST_SWAP (copy it to host) or "
                             "CheckpointPolicy.MUST_SAVE / PREFER_SAVE (keep it on the device)")
        group.device.append(tensor)
        self.stats.tensors_swapped += 1
        self.stats.bytes_swapped += int(tensor.nbytes)
        return _Ref(group, len(group.device) - 1)

    def _groups(self) -> list[_Group]:
        return [group for group in (ref() for ref in self._swapped) if group is not None]

    def finish_offloads(self) -> None:
        """Wait for the copies to host issued so far (the groups whose copies are done
        are left as they are)."""
        for group in self._groups():
            group.finish_offload()

    def prefetch(self) -> None:
        """Issue the copy back of the group swapped last that is on host."""
        for group in reversed(self._groups()):
            if group.state is _State.HOST:
                group.launch_load()
                self.stats.prefetches += 1
                return


def _unpack(ref: _Ref) -> Any:
    return ref.group.get(ref.index)


def swap_wrapper(module: Any, policy_fn: Callable[[Any], Any] | None = None) -> Any:
    """Swap ``module``'s saved activations to host memory (see [Note: activation swap]).

    A module (torch ``nn.Module``, MindSpore ``Cell``) is swapped in place, its forward
    replaced on the instance as ``checkpoint_wrapper`` does, and returned; link swapped
    modules in forward order with ``SwapManager().set_forward_prefetch_layer`` so the
    copies overlap compute. Any other callable (an operator held by a layer) is
    returned wrapped: its calls are swapped, with no prefetch.

    Args:
        module: a module, or a callable taking and returning tensors.
        policy_fn: ``policy_fn(tensor) -> CheckpointPolicy`` for each saved tensor
            (``[...]`` any shape and dtype; under a DTensor forward this rank's piece):
            ``MUST_SWAP`` swaps it, ``MUST_SAVE`` / ``PREFER_SAVE`` keep it on the device.
            ``None``: every saved activation is swapped.

    Returns:
        ``module`` (a module) or the wrapped callable.

    Raises:
        ValueError: ``module`` is swapped, or linked as a follower, already; from a
            forward, ``policy_fn`` returned another value.
        TypeError: ``module`` is not callable, or holds no attributes (a builtin).
    """
    p = get_platform()
    if not callable(module):
        raise TypeError(f"swap_wrapper: module={module!r} is not callable; pass a module or an operator")
    if not hasattr(module, "__dict__"):
        raise TypeError(f"swap_wrapper: module={module!r} takes no attributes; wrap it in a function first")
    if SWAP_ATTR in vars(module):
        raise ValueError(f"swap_wrapper: {type(module).__name__} is already swapped")
    if FOLLOW_ATTR in vars(module):
        raise ValueError(f"swap_wrapper: {type(module).__name__} is linked by SwapManager already; swap the "
                         "modules first, then link them")
    handle = _SwapHandle(type(module).__name__, policy_fn)
    wrapped, hook = wrap_calls(module, lambda fn, args, owner: handle.run(
        fn, args, [] if owner is None else [param for _, param in p.named_parameters(owner)]))
    if hook is not None:
        handle.hooks.append(hook)
    vars(wrapped)[SWAP_ATTR] = handle
    return wrapped


def swap_stats(module: Any) -> SwapStats:
    """A copy of the counts of a module (or wrapped callable) ``swap_wrapper`` swapped.

    Raises:
        ValueError: ``module`` is not swapped.
    """
    return dataclasses.replace(_handle(module, "swap_stats").stats)


def _handle(module: Any, caller: str) -> _SwapHandle:
    handle = vars(module).get(SWAP_ATTR) if hasattr(module, "__dict__") else None
    if handle is None:
        raise ValueError(f"{caller}: {type(module).__name__} is not swapped; call swap_wrapper(module) first")
    return handle


class SwapManager:
    """The forward order of swapped modules, which decides when their copies run (see
    [Note: activation swap]). It holds no state of its own: the order lives on the
    modules, so ``SwapManager()`` may be made anew for each call (as MindFormers does)."""

    def set_forward_prefetch_layer(self, first_layer: Any, second_layer: Any) -> None:
        """``second_layer`` runs its forward after ``first_layer``: ``first_layer``'s
        copies to host are waited for when ``second_layer``'s forward ends, and its
        copies back are issued when the backward reaches ``second_layer``. Calling it
        again with the same pair does nothing.

        Args:
            first_layer: a module ``swap_wrapper`` swapped.
            second_layer: a module, swapped or not (MindFormers links the last swapped
                layer to the next layer); not a wrapped callable: the prefetch runs in a
                module's backward pre-hook.

        Raises:
            ValueError: ``first_layer`` is not a swapped module, either is a wrapped
                callable, they are the same, or either is linked to another module
                already on that side.
        """
        for name, layer in (("first_layer", first_layer), ("second_layer", second_layer)):
            if not is_module(layer):
                raise ValueError(f"SwapManager.set_forward_prefetch_layer: {name} is a wrapped callable; link "
                                 "modules (the prefetch runs in a module's backward pre-hook)")
        if first_layer is second_layer:
            raise ValueError("SwapManager.set_forward_prefetch_layer: first_layer and second_layer are the same "
                             "module; link a module to the one whose forward runs after it")
        first = _handle(first_layer, "SwapManager.set_forward_prefetch_layer(first_layer)")
        swapped = SWAP_ATTR in vars(second_layer)
        second = vars(second_layer).get(SWAP_ATTR if swapped else FOLLOW_ATTR) or _Follower(type(second_layer).__name__)
        if first.next is second and second.prev is first:
            return
        if first.next is not None or second.prev is not None:
            raise ValueError(f"SwapManager.set_forward_prefetch_layer: {first.name} is followed by "
                             f"{first.next.name if first.next else None} and {second.name} preceded by "
                             f"{second.prev.name if second.prev else None} already; each module has one "
                             "neighbour on each side")
        p = get_platform()
        first.next, second.prev = second, first
        if not swapped:  # a swapped module waits for its predecessor's copies in its own forward
            vars(second_layer)[FOLLOW_ATTR] = second
            second.hooks.append(p.register_forward_hook(second_layer, lambda *_: first.finish_offloads()))
        second.hooks.append(p.register_full_backward_pre_hook(second_layer, second.before_backward))

