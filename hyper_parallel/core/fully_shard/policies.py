"""fully_shard configuration: mixed precision and offload (FSDP2's ``MixedPrecisionPolicy``,
``OffloadPolicy`` and ``CPUOffloadPolicy``)."""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.core.tensor_ops import dtype_name

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of a fully_shard unit (PyTorch FSDP2 semantics), given as dtype names or as
    the framework's dtypes (``torch.bfloat16``, ``mindspore.float32``; stored as names).

    Attributes:
        param_dtype: dtype of the gathered (unsharded) parameters the forward and
            backward compute with; the sharded parameters and the optimizer stay in
            their own dtype. ``None``: the parameters' dtype.
        reduce_dtype: dtype of the gradient reduce-scatter / all-reduce. ``None``:
            ``param_dtype`` (or the parameters' dtype).
        output_dtype: floating outputs of the unit's forward are cast to it. ``None``: no cast.
        cast_forward_inputs: cast floating positional inputs to ``param_dtype``.
        apply_grad_on_fp32_main_grad: also add each reduced gradient, in float32, onto
            ``param.main_grad`` (a DTensor laid out as the parameter, made on first use,
            summed over backwards until the caller resets it to ``None``): Megatron-LM's
            main gradient, which MindFormers' optimizer step reads. The gradient autograd
            returns (``param.grad``, ``value_and_grad``'s) is unchanged.

    Raises:
        ValueError: a dtype name outside ``float16``, ``bfloat16``, ``float32``, ``float64``.
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = False

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                # a framework dtype (torch.bfloat16, mindspore.float32), as FSDP2 and
                # MindFormers pass them: kept as its name, the form every backend reads
                try:
                    name = dtype_name(value)
                except ValueError as err:
                    raise ValueError(f"MixedPrecisionPolicy: {field}={value!r} is not a floating dtype; use one of "
                                     f"{_FLOAT_DTYPES}, the framework's dtype of one, or None") from err
                object.__setattr__(self, field, name)
                value = name
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(f"MixedPrecisionPolicy: {field}={value!r} is not a floating dtype name; "
                                 f"use one of {_FLOAT_DTYPES} or None")


@dataclass(frozen=True)
class OffloadPolicy:
    """Where a fully_shard unit keeps its sharded parameters (PyTorch FSDP2's
    ``OffloadPolicy``): this base policy offloads nothing; the shards live on the
    compute device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep the sharded parameters, their gradients and hence the optimizer step in
    host memory (PyTorch FSDP2's ``CPUOffloadPolicy``). Before each all-gather the
    shard is copied to the device (``platform.to_device``); the reduced gradient shard
    is copied back to the host. On a CPU backend host and device are the same memory
    and no copy is made.

    Attributes:
        pin_memory: page-lock the host shards and gradients, so the copies to and from
            the device can run asynchronously (torch; MindSpore has no per-tensor pinning).

    Raises:
        TypeError: ``pin_memory`` is not a bool.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy: pin_memory={self.pin_memory!r} must be a bool")
