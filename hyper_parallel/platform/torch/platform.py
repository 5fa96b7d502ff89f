"""``TorchPlatform``: the contract on torch, for CPU (gloo), CUDA (NCCL) and NPU (HCCL)."""

from __future__ import annotations

import datetime
import difflib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from hyper_parallel.platform import host_memory, host_streams
from hyper_parallel.platform.autograd_collectives import DifferentiableCollectives
from hyper_parallel.platform.base import FULL, Activation, AttentionMask, Capability, CustomFunction, MemoryStats, Platform, RemovableHandle, VjpFn
from hyper_parallel.platform.contract.modules import ModuleTypes
from hyper_parallel.platform.contract.types import DTYPE_NAMES
from hyper_parallel.platform.forward_replacement import ForwardReplacement
from hyper_parallel.platform.grouped_matmul import check_grouped_matmul, looped_grouped_matmul
from hyper_parallel.platform.saved_tensor_layers import PASS, LayeredHooks, SavedTensorLayer
from hyper_parallel.platform.torch import attention as attn
from hyper_parallel.platform.torch.backward_hooks import register_output_grad_pre_hook
from hyper_parallel.platform.torch.collectives import TorchCollectives
from hyper_parallel.platform.torch.compile import EagerHooks, compile_module, eager_if_compiling
from hyper_parallel.platform.torch.dtensor import build_dtensor_type
from hyper_parallel.platform.torch.optim import TorchAdamW
from hyper_parallel.platform.torch.selective_checkpoint import selective_contexts
from hyper_parallel.platform.contract.validation import (
    refuse_dtensor,
    check_attention_backward,
    check_group_ranks,
    check_vjp_part,
    normalize_dim,
)

#: device type -> process-group backend
DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
assert set(_DTYPES) == set(DTYPE_NAMES)


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (imports CANN; fails on machines without it)
    except Exception:  # noqa: BLE001 - any failure means "no usable NPU stack"
        return False
    return bool(torch.npu.is_available())


def _resolve_device(device: str | None) -> str:
    if device is None:
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if _npu_available() else "cpu"
    if device not in DEVICE_BACKENDS:
        raise ValueError(f"TorchPlatform: device={device!r} is not one of {sorted(DEVICE_BACKENDS)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("platform torch-cuda was requested but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}); use torch-cpu or a CUDA build of torch on a GPU machine")
    if device == "npu" and not _npu_available():
        raise RuntimeError("platform torch-npu was requested but torch_npu cannot be imported or sees no NPU; "
                           "install torch_npu with Ascend CANN, or use torch-cpu")
    return device



def _meta_device() -> torch.device:
    """``torch.device("meta")``, a context manager: modules constructed inside it get meta
    parameters (``ModuleTypes.meta_device``)."""
    return torch.device("meta")

class _SavedToken:
    """What ``release_saved_tensors`` stores for a released tensor: the source index, the
    view geometry (shape, stride, storage offset) and, for a DTensor whose piece is the
    view, its type and spec to wrap the rebuilt piece in."""

    __slots__ = ("index", "view", "wrap")

    def __init__(self, index: int, view: tuple[Any, ...], wrap: tuple[type, Any] | None = None) -> None:
        self.index = index
        self.view = view
        self.wrap = wrap


def _piece(tensor: Any) -> tuple[Any, tuple[type, Any] | None]:
    """A DTensor's local piece and what rewraps it (a module computing on DTensors saves
    them: [Note: a tensor-parallel parameter in a DTensor forward]); a tensor itself."""
    piece = getattr(tensor, "_local", None) if type(tensor) is not torch.Tensor else None
    if isinstance(piece, torch.Tensor):
        return piece, (type(tensor), tensor._spec)
    return tensor, None


def _rewrap(piece: Any, wrap: tuple[type, Any] | None) -> Any:
    return piece if wrap is None else wrap[0](piece, wrap[1])


#: the dtypes ``torch.nn.functional.grouped_mm`` takes, per device type (torch 2.13: its CPU
#: kernel takes the three floats; its CUDA kernels are bfloat16 ones)
_GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def _grouped_mm_refusal(x: Any, weight: Any) -> str:
    """Why ``torch.nn.functional.grouped_mm`` cannot take ``x`` ``[rows, in]`` and
    ``weight`` ``[groups, out, in]`` ("" when it can)."""
    dtypes = _GROUPED_MM_DTYPES.get(x.device.type, ())
    if x.dtype not in dtypes or weight.dtype != x.dtype:
        return (f"torch's grouped_mm takes {', '.join(map(str, dtypes)) or 'no dtype'} on {x.device.type}, got "
                f"x {x.dtype} and weight {weight.dtype}")
    # its kernels read both operands with a leading stride in 16-byte multiples
    if (x.shape[1] * x.element_size()) % 16 or (weight.shape[1] * weight.element_size()) % 16:
        return (f"torch's grouped_mm needs in ({x.shape[1]}) and out ({weight.shape[1]}) to be multiples of "
                f"{16 // x.element_size()} {x.dtype} elements (16 bytes)")
    return ""


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``grouped_mm``'s backward
    (torch 2.13) raises on a gradient with zero strides (``out.sum().backward()``)."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # noqa: ARG004
        return grad.contiguous()


class TorchPlatform(TorchCollectives, DifferentiableCollectives, Platform):
    """torch backend. ``device``: ``"cpu"``, ``"cuda"``, ``"npu"``, or ``None`` for CUDA
    if available, else NPU if torch_npu imports, else CPU.

    Raises:
        ValueError: unknown device. RuntimeError: the device is not available.
    """

    def __init__(self, device: str | None = None) -> None:
        self._device_type: str = _resolve_device(device)
        self._device: torch.device = torch.device(self._device_type)
        self._groups: dict[tuple[int, ...], Any] = {}  # sorted global ranks -> ProcessGroup
        self._functions: dict[type, type] = {}  # CustomFunction subclass -> torch Function
        self._eager_hooks = EagerHooks()  # [Note: hooks stay eager under torch.compile]

    # -- types -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"torch-{self._device_type}"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def dtensor_type(self, base: type) -> type:
        """A ``torch.Tensor`` wrapper subclass with ``__torch_dispatch__``; see
        [Note: torch DTensor dispatch] in ``platform/torch/dtensor.py``."""
        cache = self.__dict__.setdefault("_dtensor_types", {})
        if base not in cache:
            cache[base] = build_dtensor_type(base)
        return cache[base]

    def dtype(self, name: str) -> Any:
        if name not in _DTYPES:
            raise ValueError(f"dtype name {name!r} is unknown; use one of {', '.join(DTYPE_NAMES)}")
        return _DTYPES[name]

    def capabilities(self) -> frozenset[Capability]:
        caps = {Capability.NATIVE_ALL_TO_ALL, Capability.NATIVE_REDUCE_SCATTER,
                Capability.NATIVE_ALL_GATHER_INTO_TENSOR, Capability.NATIVE_BATCH_P2P,
                Capability.ASYNC_COLLECTIVES, Capability.FUSED_ATTENTION, Capability.COMPILE_AROUND_HOOKS,
                Capability.CONCURRENT_RECORD_AND_BACKWARD}
        if self._device_type in _GROUPED_MM_DTYPES:  # torch_npu: not wired (its kernel has no autograd)
            caps |= {Capability.GROUPED_MATMUL}
        if self._device_type != "cpu":
            caps |= {Capability.STREAMS}
        return frozenset(caps)

    # -- process groups ----------------------------------------------------------------
    def init_process_group(self, *, timeout_s: float = 300.0) -> None:
        if dist.is_initialized():
            raise RuntimeError("init_process_group: torch.distributed is already initialised in this process")
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ]
        if missing:
            raise RuntimeError(f"init_process_group: environment variables {missing} are not set; "
                               "launch with torchrun or hyper_parallel.testing")
        if self._device_type != "cpu":
            self.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(DEVICE_BACKENDS[self._device_type],
                                timeout=datetime.timedelta(seconds=timeout_s))

    def destroy_process_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._groups.clear()

    def rank(self, group: Any = None) -> int:
        return dist.get_rank(group)

    def world_size(self, group: Any = None) -> int:
        return dist.get_world_size(group)

    def create_group(self, ranks: Sequence[int]) -> Any:
        key = check_group_ranks(ranks, dist.get_world_size())
        if key == tuple(range(dist.get_world_size())):
            return dist.group.WORLD
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key))
        return self._groups[key]

    def group_ranks(self, group: Any = None) -> list[int]:
        if group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(group))

    # -- autograd ----------------------------------------------------------------------
    def apply_function(self, function: type[CustomFunction], *args: Any) -> Any:
        native = self._functions.get(function)
        if native is None:
            native = type(f"Torch{function.__name__}", (torch.autograd.Function,), {
                "forward": staticmethod(function.forward),
                "backward": staticmethod(function.backward),
            })
            self._functions[function] = native
        return native.apply(*args)

    def no_grad(self) -> AbstractContextManager[None]:
        return torch.no_grad()

    def grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def recompute(self, fn: Callable[..., Any], *args: Any,
                  keep: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], bool] | None = None,
                  output_recompute: bool = False) -> Any:
        # Non-reentrant: saved-tensor hooks, gradients through the first forward's graph;
        # the RNG state is kept and restored (preserve_rng_state defaults to True).
        if output_recompute:
            raise NotImplementedError("recompute: output_recompute=True is MindSpore's merging of adjacent "
                                      "recomputed regions (mindspore.recompute(output_recompute=True)); "
                                      "torch.utils.checkpoint has no counterpart and it is not built on torch: "
                                      "use output_recompute=False")
        contexts = {} if keep is None else {"context_fn": lambda: selective_contexts(keep)}
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **contexts)

    def release_saved_tensors(self, sources: Sequence[Any], reload: Callable[[int], Any], *,
                              offload: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
                              ) -> AbstractContextManager[None]:
        # A saved tensor is matched to a source by its storage (views share it); the
        # token keeps the view's geometry, so ``as_strided`` rebuilds the same view.
        keys = {src.untyped_storage().data_ptr(): i for i, src in enumerate(sources) if src.numel() > 0}

        def take(tensor: Any) -> Any:
            piece, wrap = _piece(tensor)
            index = keys.get(piece.untyped_storage().data_ptr()) if piece.numel() > 0 else None
            if index is None:
                return PASS
            return _SavedToken(index, (tuple(piece.shape), tuple(piece.stride()), piece.storage_offset()), wrap)

        def give(token: _SavedToken) -> Any:
            return _rewrap(reload(token.index).as_strided(*token.view), token.wrap)

        catch_all = None
        if offload is not None:
            pack, unpack = offload

            def take_any(tensor: Any) -> Any:
                piece, wrap = _piece(tensor)
                if piece.numel() == 0:
                    return PASS
                stored = pack(piece.detach())
                return PASS if isinstance(stored, torch.Tensor) else (stored, wrap)

            catch_all = (take_any, lambda stored: _rewrap(unpack(stored[0]), stored[1]))
        # Not taken: an op that saves its own output (exp, amax, softmax) would then hold
        # its grad_fn through the packed object, a C++ reference cycle that gc cannot
        # break; a graph branch backward never runs (attention's detached row max) then
        # leaks each step. ``detach`` shares storage and version.
        # The layered pack/unpack themselves excluded from tracing, not only the takers they
        # call: a traced pack breaks its graph at the context-variable lookup and recompiles
        # per saved tensor until dynamo's limit ([Note: hooks stay eager under torch.compile]).
        def native(pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> Any:
            eager = self._eager_hooks
            return torch.autograd.graph.saved_tensors_hooks(eager_if_compiling(eager, pack),
                                                            eager_if_compiling(eager, unpack))

        return LayeredHooks(SavedTensorLayer((take, give), catch_all), native, lambda tensor: tensor.detach())

    def vjp(self, fn: Callable[..., Any], inputs: Sequence[Any], params: Sequence[Any] = ()) -> tuple[Any, VjpFn]:
        leaves = [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                  for x in inputs]
        with torch.enable_grad():
            outputs = fn(*leaves)
        params = list(params)

        ran: list[str] = []  # parts run so far: "all", or "input" then "weight"

        def backward(grad_outputs: Sequence[Any], part: str = "all") -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            check_vjp_part(part, ran)
            outs = outputs if isinstance(outputs, tuple) else (outputs,)
            if len(grad_outputs) != len(outs):
                raise ValueError(f"vjp backward: got {len(grad_outputs)} output gradients for {len(outs)} outputs")
            pairs = [(o, g) for o, g in zip(outs, grad_outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
            inputs_ = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
            if part == "input":  # input gradients only; the graph is kept for the weight part
                found = torch.autograd.grad([o for o, _ in pairs], inputs_, [g for _, g in pairs], retain_graph=True,
                                            allow_unused=True) if pairs and inputs_ else ()
                by_id = {id(x): g for x, g in zip(inputs_, found)}
                return tuple((by_id.get(id(x)) if by_id.get(id(x)) is not None else torch.zeros_like(x))
                             if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves), ()
            targets = [] if part == "weight" else inputs_
            targets += [p for p in params if p.requires_grad]
            # Accumulate into .grad the torch way, but report this backward's share:
            # earlier gradients are set aside and added back afterwards.
            saved = [p.grad for p in params]
            for p in params:
                p.grad = None
            if pairs and targets:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=targets)
            input_grads = tuple(
                (x.grad if x.grad is not None else torch.zeros_like(x))
                if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves)
            param_grads = []
            for p, old in zip(params, saved):
                new = p.grad if p.grad is not None else torch.zeros_like(p)
                param_grads.append(new)
                p.grad = new.clone() if old is None else old + new
            return (() if part == "weight" else input_grads), tuple(param_grads)

        return outputs, backward

    # -- module hooks and tree ---------------------------------------------------------
    def module_types(self) -> ModuleTypes:
        """``nn.Module``, ``nn.Linear``, ``nn.ModuleList``, ``nn.ModuleDict``; the meta scope
        ``torch.device("meta")``."""
        nn = torch.nn
        return ModuleTypes(Module=nn.Module, Linear=nn.Linear, ModuleList=nn.ModuleList, ModuleDict=nn.ModuleDict,
                           meta_device=_meta_device)

    def register_forward_pre_hook(self, module: Any, hook: Callable[..., Any], *,
                                  with_kwargs: bool = False) -> RemovableHandle:
        # eager: [Note: hooks stay eager under torch.compile]
        return module.register_forward_pre_hook(self._eager_hooks.wrap(module, hook), with_kwargs=with_kwargs)

    def register_forward_hook(self, module: Any, hook: Callable[..., Any], *,
                              replace_forward: bool = False) -> RemovableHandle:
        if replace_forward:
            return ForwardReplacement(module, "forward", hook)
        return module.register_forward_hook(self._eager_hooks.wrap(module, hook))

    def compile_module(self, module: Any) -> RemovableHandle:
        return compile_module(module, self._device_type, self._eager_hooks)

    def register_full_backward_pre_hook(self, module: Any, hook: Callable[..., Any]) -> RemovableHandle:
        """On the output tensors' gradients, as FSDP2 hooks them (see [Note: backward
        pre-hooks on output tensors] in ``platform/torch/backward_hooks.py``): no
        warnings for outputs that are dataclasses or dicts, nor for inputs without
        gradients (token ids)."""
        return register_output_grad_pre_hook(module, hook)

    def named_modules(self, module: Any, *, linear_only: bool = False) -> Iterator[tuple[str, Any]]:
        if not linear_only:
            return module.named_modules()
        return ((name, sub) for name, sub in module.named_modules()
                if isinstance(sub, torch.nn.Linear) and type(sub).forward is torch.nn.Linear.forward
                and not isinstance(sub.weight, torch.nn.parameter.UninitializedParameter))

    def named_parameters(self, module: Any) -> Iterator[tuple[str, Any]]:
        return module.named_parameters()

    def make_parameter(self, tensor: Any, requires_grad: bool = True) -> Any:
        return torch.nn.Parameter(tensor.detach(), requires_grad=requires_grad)

    def set_parameter(self, module: Any, fqn: str, param: Any) -> None:
        names = [name for name, _ in module.named_parameters()]
        if fqn not in names:
            near = difflib.get_close_matches(fqn, names, n=3)
            raise KeyError(f"set_parameter: no parameter {fqn!r} in {type(module).__name__}; nearest: {near}")
        owner_path, _, leaf = fqn.rpartition(".")
        setattr(module.get_submodule(owner_path), leaf, param)

    # -- tensor ops --------------------------------------------------------------------
    def _factory_device(self) -> torch.device:
        """This platform's device, or the meta device inside ``module_types().meta_device()``
        (``torch.device("meta")`` as a context): the factories then make meta tensors as
        torch's own do, so a module built there holds no storage (a norm's or an
        embedding's weight made with ``full`` / ``zeros`` included). The mode-stack length
        is checked first: ``get_default_device`` costs more than a small ``zeros``."""
        if torch._C._len_torch_function_stack() and torch.get_default_device().type == "meta":
            return torch.device("meta")
        return self._device

    def zeros(self, shape: Sequence[int], dtype: Any, *, fill: bool = True) -> Any:
        return (torch.zeros if fill else torch.empty)(tuple(shape), dtype=dtype, device=self._factory_device())

    def full(self, shape: Sequence[int], value: float, dtype: Any) -> Any:
        return torch.full(tuple(shape), value, dtype=dtype, device=self._factory_device())

    def arange(self, start: int, end: int, dtype: Any) -> Any:
        return torch.arange(start, end, dtype=dtype, device=self._device)

    def from_numpy(self, array: np.ndarray) -> Any:
        # clone(): a torch-owned storage, not a view of the caller's numpy buffer.
        return torch.from_numpy(np.ascontiguousarray(array)).clone().to(self._device)

    def to_numpy(self, tensor: Any) -> np.ndarray:
        refuse_dtensor(tensor, "to_numpy")
        host = tensor.detach().cpu()
        if host.dtype == torch.bfloat16:
            host = host.float()
        return host.numpy().copy()

    def cat(self, tensors: Sequence[Any], dim: int = 0) -> Any:
        return torch.cat(list(tensors), dim=dim)

    def split(self, tensor: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
        dim = normalize_dim(dim, tensor.ndim)
        if sum(sizes) != tensor.shape[dim]:
            raise ValueError(f"split: sizes={list(sizes)} sum to {sum(sizes)}, but tensor.shape[{dim}] is "
                             f"{tensor.shape[dim]}; the sizes must add up to it")
        return list(torch.split(tensor, list(sizes), dim=dim))

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        return tensor.narrow(dim, start, length)

    def pad(self, tensor: Any, dim: int, before: int, after: int, value: float = 0.0) -> Any:
        dim = normalize_dim(dim, tensor.ndim)
        return torch.nn.functional.pad(tensor, [0, 0] * (tensor.ndim - 1 - dim) + [before, after], value=value)

    def to_dtype(self, tensor: Any, dtype: Any) -> Any:
        # torch returns the tensor itself for its own dtype; the check skips a dispatch.
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    def detach(self, tensor: Any) -> Any:
        return tensor.detach()

    def check_attention(self, q: Any, k: Any, v: Any, mask: AttentionMask = FULL) -> None:
        attn.check_inputs(self.name, q, k, v, mask)

    def attention(self, q: Any, k: Any, v: Any, *, scale: float | None = None,
                  mask: AttentionMask = FULL) -> tuple[Any, Any]:
        """The device's fused kernel (``platform/torch/attention.py`` lists which)."""
        attn.check_inputs(self.name, q, k, v, mask)
        return attn.forward(self, q, k, v, q.shape[-1] ** -0.5 if scale is None else float(scale), mask)

    def attention_backward(self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *,
                           scale: float | None = None, mask: AttentionMask = FULL) -> tuple[Any, Any, Any]:
        """The device's fused backward kernel (``platform/torch/attention.py``)."""
        attn.check_inputs(self.name, q, k, v, mask)
        check_attention_backward(dout, q, out, lse)
        return attn.backward(self, dout, q, k, v, out, lse, q.shape[-1] ** -0.5 if scale is None else float(scale),
                             mask)

    def local_attention(self, q: Any, k: Any, v: Any, *, is_causal: bool = False, scale: float | None = None) -> Any:
        """torch's own ``scaled_dot_product_attention`` where it runs a fused kernel (the
        same one ``attention`` runs, with torch's C++ autograd); else the derived function
        (``attention.local``)."""
        attn.check_inputs(self.name, q, k, v, AttentionMask("top_left") if is_causal else FULL)
        out = attn.local(self, q, k, v, is_causal, scale)
        return super().local_attention(q, k, v, is_causal=is_causal, scale=scale) if out is None else out

    def softmax(self, x: Any, dim: int, *, log: bool = False) -> Any:
        F = torch.nn.functional
        return F.log_softmax(x, dim=dim) if log else F.softmax(x, dim=dim)

    def activation(self, x: Any, kind: Activation) -> Any:
        return getattr(torch.nn.functional, kind.value)(x)

    def grouped_matmul(self, x: Any, weight: Any, group_sizes: Sequence[int]) -> Any:
        """``torch.nn.functional.grouped_mm`` where it takes the device and dtype (CPU:
        float32 / bfloat16 / float16; CUDA: bfloat16, as its kernels require; rows of
        16-byte multiples), else one matmul per group (``platform/grouped_matmul.py``)."""
        sizes = check_grouped_matmul(x, weight, group_sizes)
        why = _grouped_mm_refusal(x, weight)
        if why or not x.shape[0]:  # no rows: its backward cannot take their gradient's zero strides
            return looped_grouped_matmul(self, x, weight, sizes, why)
        offsets = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=x.device)
        out = torch.nn.functional.grouped_mm(x.contiguous(), weight.contiguous().transpose(-2, -1), offs=offsets)
        return _ContiguousGrad.apply(out)

    def cross_entropy(self, logits: Any, target: Any, reduction: str) -> Any:
        return torch.nn.functional.cross_entropy(logits, target, reduction=reduction)

    # -- streams and events ------------------------------------------------------------
    def _device_module(self) -> Any:
        return torch.get_device_module(self._device_type)

    def current_stream(self) -> Any:
        if self._device_type == "cpu":
            return host_streams.HostStream()
        return self._device_module().current_stream()

    def new_stream(self) -> Any:
        if self._device_type == "cpu":
            return host_streams.HostStream()
        return self._device_module().Stream()

    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        if self._device_type == "cpu":
            return host_streams.host_stream_context(stream)
        return self._device_module().stream(stream)

    def record_event(self, stream: Any = None) -> Any:
        event = host_streams.HostEvent() if self._device_type == "cpu" else self._device_module().Event()
        event.record(stream if stream is not None else self.current_stream())
        return event

    def wait_event(self, event: Any, stream: Any = None) -> None:
        (stream if stream is not None else self.current_stream()).wait_event(event)

    # -- device ------------------------------------------------------------------------
    def set_device(self, local_rank: int) -> None:
        count = 1 if self._device_type == "cpu" else int(self._device_module().device_count())
        if not 0 <= local_rank < count:
            raise ValueError(f"set_device: local_rank={local_rank} but {count} {self._device_type} device(s) are visible")
        if self._device_type != "cpu":
            self._device_module().set_device(local_rank)
            self._device = torch.device(self._device_type, local_rank)

    def adamw(self, params: Sequence[Any], lr: float, *, betas: tuple[float, float], eps: float,
              weight_decay: float) -> TorchAdamW:
        """``torch.optim.AdamW(foreach=False)`` ([Note: the framework's AdamW])."""
        return TorchAdamW(params, lr, betas, eps, weight_decay)

    def memory_stats(self) -> MemoryStats:
        if self._device_type == "cpu":
            return host_memory.host_memory_stats()
        module = self._device_module()
        return MemoryStats(allocated=int(module.memory_allocated()), peak=int(module.max_memory_allocated()))

    def to_device(self, tensor: Any, device: str, pin_memory: bool = False, stream: Any = None) -> Any:
        if device not in ("cpu", self._device_type):
            raise ValueError(f"to_device: device={device!r}; pass 'cpu' (host memory) or {self._device_type!r}")
        if self._device_type == "cpu":
            return tensor
        if stream is not None:
            # The destination is allocated on the current stream (device memory freed later
            # by the compute stream must belong to it), the copy issued on ``stream``.
            target = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu" if device == "cpu" else self._device,
                                 pin_memory=device == "cpu")
            with self.stream(stream):
                target.copy_(tensor.detach(), non_blocking=True)
            return target
        if device == "cpu":
            host = tensor.detach().to("cpu")
            return host.pin_memory() if pin_memory else host
        # From pinned memory the copy is asynchronous on the current stream.
        return tensor.to(self._device, non_blocking=True)
