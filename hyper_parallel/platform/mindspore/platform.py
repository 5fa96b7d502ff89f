"""``MindSporePlatform``: the platform contract on MindSpore, CPU (MCCL) or Ascend (HCCL).

The members live in one mixin per contract section (``groups``, ``collectives``,
``autograd``, ``modules``, ``ops``, ``streams``); this module holds the state they share,
the types and device sections, and the capability report. MindSpore is imported when a
platform object is built, never when this package is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform import host_memory
from hyper_parallel.platform.autograd_collectives import DifferentiableCollectives
from hyper_parallel.platform.base import Capability, MemoryStats, Platform
from hyper_parallel.platform.contract.types import DTYPE_NAMES
from hyper_parallel.platform.mindspore.autograd import MindSporeAutograd
from hyper_parallel.platform.mindspore.collectives import MindSporeCollectives
from hyper_parallel.platform.mindspore.dtensor import build_dtensor_type
from hyper_parallel.platform.mindspore.groups import MindSporeGroups
from hyper_parallel.platform.mindspore.modules import MindSporeModules
from hyper_parallel.platform.mindspore.ops import MindSporeOps
from hyper_parallel.platform.mindspore.optim import MindSporeAdamW
from hyper_parallel.platform.mindspore.p2p import RecvChannels
from hyper_parallel.platform.mindspore.streams import MindSporeStreams

_DEVICES = ("cpu", "ascend")

#: DTYPE_NAMES -> attribute of the ``mindspore`` module.
_DTYPE_ATTRS = {name: ("bool_" if name == "bool" else name) for name in DTYPE_NAMES}


class MindSporePlatform(
    DifferentiableCollectives,
    MindSporeGroups,
    MindSporeCollectives,
    MindSporeAutograd,
    MindSporeModules,
    MindSporeOps,
    MindSporeStreams,
    Platform,
):
    """The MindSpore backend (PyNative mode).

    Args:
        device: ``"cpu"`` or ``"ascend"``; ``None`` takes MindSpore's
            ``device_target`` (Ascend when it is Ascend, else CPU).

    Raises:
        ValueError: unknown ``device``.
        RuntimeError: ``"ascend"`` requested where MindSpore has no Ascend device.
    """

    def __init__(self, device: str | None = None) -> None:
        import mindspore
        import mindspore.communication
        import mindspore.mint.distributed

        if device is None:
            device = "ascend" if str(mindspore.get_context("device_target")).lower() == "ascend" else "cpu"
        device = device.lower()
        if device not in _DEVICES:
            raise ValueError(f"MindSporePlatform: device={device!r} is not supported; use one of {_DEVICES}")
        if device == "ascend" and not mindspore.device_context.ascend.is_available():
            raise RuntimeError("MindSporePlatform: device 'ascend' was requested but MindSpore finds no Ascend "
                               "device (is CANN installed and the Ascend build of MindSpore in use?)")
        self._device_type: str = device
        self._ms: Any = mindspore  # the framework modules, held here so that no module imports them
        self._mint: Any = mindspore.mint
        self._ops: Any = mindspore.ops
        self._dist: Any = mindspore.mint.distributed
        self._comm: Any = mindspore.communication
        self._dtypes: dict[str, Any] = {name: getattr(mindspore, attr) for name, attr in _DTYPE_ATTRS.items()}
        self._device_id: int | None = None  # set by set_device on Ascend
        self._initialized: bool = False  # between init_process_group and destroy_process_group
        self._groups: dict[tuple[int, ...], str] = {}  # sorted global ranks -> group name
        self._group_ranks: dict[str, tuple[int, ...]] = {}  # group name -> sorted global ranks
        self._native_functions: dict[type, type] = {}  # CustomFunction subclass -> _Function subclass
        self._vjp_live: list = []  # live vjp recordings, oldest first (see MindSporeAutograd.vjp)
        self._vjp_backwards_running = 0
        self._recv_channels: RecvChannels = RecvChannels()  # CPU receives not yet posted

    # -- types ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return f"mindspore-{self._device_type}"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, self._ms.Tensor)

    def dtensor_type(self, base: type) -> type:
        """A ``mindspore.Tensor`` subclass made with ``Tensor._make_subclass`` whose
        PyNative ops reach core's rules through ``__fallback__``; see [Note: MindSpore
        DTensor dispatch] in ``platform/mindspore/dtensor.py``."""
        cache = self.__dict__.setdefault("_dtensor_types", {})
        if base not in cache:
            cache[base] = build_dtensor_type(base, self._ms)
        return cache[base]

    def dtype(self, name: str) -> Any:
        """``mindspore.<name>`` (``"bool"`` is ``mindspore.bool_``)."""
        found = self._dtypes.get(name)
        if found is None:
            raise ValueError(f"dtype: {name!r} is not a dtype name; use one of {', '.join(DTYPE_NAMES)}")
        return found

    def _dtype_name(self, dtype: Any) -> str:
        for name, candidate in self._dtypes.items():
            if dtype == candidate:
                return name
        raise ValueError(f"dtype_name: {dtype} has no name in DTYPE_NAMES ({', '.join(DTYPE_NAMES)})")

    def capabilities(self) -> frozenset[Capability]:
        """Ascend: everything. CPU: nothing. Its AlltoAll, ReduceScatter,
        AllGatherIntoTensor and batched p2p are emulated (see [Note: CPU collectives]);
        PyNative runs every operation on one queue, so an async collective delays the
        compute issued after it instead of overlapping it; streams are host no-ops; and
        attention is a tiled FlashAttention-2 in MindSpore operations (no
        FlashAttentionScore kernel on CPU), and no GroupedMatmul kernel either (one matmul per
        expert). ``mindspore.recompute``'s
        ``output_recompute`` runs everywhere. No CONCURRENT_RECORD_AND_BACKWARD anywhere:
        PyNative's recording and a backward's replay share one executor, and running them
        on two threads at once corrupts gradients (MindFormers' overlap callback says the
        same; [Note: serial tails] in core's ``hook_coordinator``)."""
        if self._device_type == "ascend":
            return frozenset({
                Capability.NATIVE_ALL_TO_ALL, Capability.NATIVE_REDUCE_SCATTER,
                Capability.NATIVE_ALL_GATHER_INTO_TENSOR, Capability.NATIVE_BATCH_P2P,
                Capability.ASYNC_COLLECTIVES, Capability.STREAMS, Capability.FUSED_ATTENTION,
                Capability.OUTPUT_RECOMPUTE, Capability.GROUPED_MATMUL,
            })
        return frozenset({Capability.OUTPUT_RECOMPUTE})

    # -- device --------------------------------------------------------------------------

    def set_device(self, local_rank: int) -> None:
        """``mindspore.set_device("Ascend", local_rank)``; no-op on CPU."""
        count = 1 if self._device_type == "cpu" else int(self._ms.device_context.ascend.device_count())
        if not isinstance(local_rank, int) or isinstance(local_rank, bool) or not 0 <= local_rank < count:
            raise ValueError(f"set_device: local_rank={local_rank!r} is not a {self._device_type} device of this "
                             f"process; use an int in [0, {count})")
        if self._device_type == "ascend":
            self._ms.set_device("Ascend", local_rank)
            self._device_id = local_rank

    def adamw(self, params: Sequence[Any], lr: float, *, betas: tuple[float, float], eps: float,
              weight_decay: float) -> MindSporeAdamW:
        """``mindspore.experimental.optim.AdamW`` ([Note: the framework's AdamW])."""
        return MindSporeAdamW(params, lr, betas, eps, weight_decay)

    def memory_stats(self) -> MemoryStats:
        """Ascend: ``mindspore.runtime.memory_allocated()`` and ``max_memory_allocated()``.
        CPU: the process RSS and its peak (MindSpore reports 0 for CPU tensors)."""
        if self._device_type == "cpu":
            return host_memory.host_memory_stats()
        runtime = self._ms.runtime
        return MemoryStats(allocated=int(runtime.memory_allocated()), peak=int(runtime.max_memory_allocated()))

    def to_device(self, tensor: Any, device: str, pin_memory: bool = False, stream: Any = None) -> Any:
        """Ascend: ``Tensor.move_to("CPU" | "Ascend")``, with ``stream`` non-blocking
        (``blocking=False``) under ``mindspore.runtime.StreamCtx(stream)``. MindSpore has
        no call that page-locks one tensor, so ``pin_memory`` is accepted and the host copy
        is MindSpore's ordinary host memory. CPU: ``tensor`` itself."""
        if device not in ("cpu", self._device_type):
            raise ValueError(f"to_device: device={device!r}; pass 'cpu' (host memory) or {self._device_type!r}")
        if self._device_type == "cpu":
            return tensor
        target = "CPU" if device == "cpu" else "Ascend"
        if stream is None:
            return tensor.move_to(target)
        with self.stream(stream):
            return tensor.move_to(target, blocking=False)
