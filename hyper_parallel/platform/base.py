"""The ``Platform`` ABC: the whole contract between core and a backend.

Each section lives in its own module under ``hyper_parallel.platform.contract``; this
module composes them. A backend subclasses ``Platform`` and implements every member;
``DifferentiableCollectives`` supplies the differentiable section once for all backends.
``Platform`` itself adds a few concrete members derived from the abstract ones
(``framework``, ``device_type``, ``split_group``, ``stack``, ``check_attention``,
``local_attention``, ``differentiable_all_to_all_single_async``),
written once here so no backend repeats them; a backend may still override one with a
native implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.contract.attention import FULL, AttentionMask, AttentionSection
from hyper_parallel.platform.contract.autograd import AutogradSection, VjpFn
from hyper_parallel.platform.contract.collectives import CollectivesSection
from hyper_parallel.platform.contract.common import (
    Activation,
    Capability,
    CompletedWork,
    CustomFunction,
    HandleWork,
    MemoryStats,
    P2POp,
    ReduceOp,
    RemovableHandle,
    Work,
)
from hyper_parallel.platform.contract.device import DeviceSection
from hyper_parallel.platform.contract.differentiable import DifferentiableSection
from hyper_parallel.platform.contract.groups import GroupsSection
from hyper_parallel.platform.contract.modules import ModulesSection, ModuleTypes
from hyper_parallel.platform.contract.ops import TENSOR_METHODS, OpsSection
from hyper_parallel.platform.contract.optim import Optimizer, OptimSection
from hyper_parallel.platform.contract.streams import StreamsSection
from hyper_parallel.platform.contract.types import DTYPE_NAMES, TypesSection
from hyper_parallel.platform.local_attention import LocalAttention

__all__ = [
    "BACKENDS", "DTYPE_NAMES", "FULL", "TENSOR_METHODS", "Activation", "AttentionMask", "Capability", "CompletedWork", "CustomFunction",
    "HandleWork", "MemoryStats", "ModuleTypes", "Optimizer", "P2POp", "Platform", "ReduceOp", "RemovableHandle", "VjpFn", "Work",
    "contract_members", "derived_members", "mesh_device_types",
]

#: backend name (``Platform.name``; the folders of the repository's ``platform/``) ->
#: (framework, device type)
BACKENDS: dict[str, tuple[str, str]] = {
    "torch-cpu": ("torch", "cpu"),
    "torch-cuda": ("torch", "cuda"),
    "torch-npu": ("torch", "npu"),
    "mindspore-cpu": ("mindspore", "cpu"),
    "mindspore-ascend": ("mindspore", "ascend"),
}


def mesh_device_types(backend: str) -> tuple[str, ...]:
    """The ``device_type`` names a ``DeviceMesh`` accepts on ``backend`` (a ``BACKENDS``
    name, ``Platform.name``): its device type, and on MindSpore also ``"npu"`` (the name
    MindFormers and the MindSpore ecosystem give Ascend; MindSpore places tensors by its
    context, not by a mesh's device type, so the mesh takes it as this backend's device).
    A function of the ``BACKENDS`` table, not a member of the contract."""
    framework, device_type = BACKENDS[backend]
    if framework == "mindspore" and device_type != "npu":
        return (device_type, "npu")
    return (device_type,)


class Platform(
    TypesSection,
    GroupsSection,
    CollectivesSection,
    DifferentiableSection,
    AutogradSection,
    ModulesSection,
    OpsSection,
    AttentionSection,
    StreamsSection,
    DeviceSection,
    OptimSection,
):
    """Everything core may ask of a framework/device pair.

    Instances are created by ``hyper_parallel.platform.get_platform()``; a subclass that
    leaves any member abstract raises ``TypeError`` when constructed.
    """

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # -- derived from the abstract members, for every backend ---------------------------
    @property
    def framework(self) -> str:
        """``"torch"`` or ``"mindspore"``: the framework half of ``name`` (see ``BACKENDS``)."""
        return BACKENDS[self.name][0]

    @property
    def device_type(self) -> str:
        """``"cpu"``, ``"cuda"``, ``"npu"`` or ``"ascend"``: the device half of ``name``
        (see ``BACKENDS``)."""
        return BACKENDS[self.name][1]

    def check_attention(self, q: Any, k: Any, v: Any, mask: AttentionMask = FULL) -> None:
        """Raise what ``attention`` would raise for these inputs: core calls it before the
        collectives of context parallelism, so that bad input (a dtype or head_dim the
        backend's kernel does not take) fails on every rank before any communication.

        Derived: checks ``mask`` against the lengths and runs the kernel on the first
        position of ``q`` and ``k`` (one query, one key). A backend overrides it with a
        check that computes nothing.

        Raises:
            ValueError: as ``attention``.
        """
        mask.check(int(q.shape[1]), int(k.shape[1]))
        if q.ndim == 4 and k.ndim == 4 and v.ndim == 4 and q.shape[1] and k.shape[1]:
            q, k, v = self.narrow(q, 1, 0, 1), self.narrow(k, 1, 0, 1), self.narrow(v, 1, 0, 1)
        self.attention(q, k, v)

    def local_attention(self, q: Any, k: Any, v: Any, *, is_causal: bool = False, scale: float | None = None) -> Any:
        """Attention of ``q`` over ``k``/``v`` as they are, differentiable in all three:
        what ``scaled_dot_product_attention`` computes outside context parallelism.

        Args:
            q: ``[batch, q_seq, heads, head_dim]`` (BSHD); k, v: ``[batch, kv_seq,
                kv_heads, head_dim]``, ``heads`` divisible by ``kv_heads``.
            is_causal: query ``i`` sees keys ``j <= i`` (top-left, as torch's).
            scale: multiplies ``q k^T``; default ``head_dim ** -0.5``.

        Returns:
            ``[batch, q_seq, heads, head_dim]`` in ``q``'s dtype.

        Derived: one ``attention`` forward and one ``attention_backward`` in an autograd
        function (``platform/local_attention.py``). torch overrides it with its own
        ``scaled_dot_product_attention`` where that runs a fused kernel: the same kernel
        ``attention`` would run, with torch's C++ autograd instead of a Python one.

        Raises:
            ValueError: as ``attention``.
        """
        mask = AttentionMask("top_left") if is_causal else FULL
        return self.apply_function(LocalAttention, self, q, k, v, scale, mask)

    def differentiable_all_to_all_single_async(self, tensor: Any, input_split_sizes: Sequence[int],
                                               output_split_sizes: Sequence[int], group: Any = None) -> Any:
        """Expert-parallel token dispatch/combine (upstream hyper-parallel's name, which
        MindFormers' ``OverlapExpertParallel`` calls): the uneven all-to-all of dim 0 of
        ``tensor`` ``[rows, *rest]``, ``input_split_sizes[s]`` rows to group rank ``s`` and
        ``output_split_sizes[s]`` rows from it, as ``differentiable_all_to_all(tensor, 0, 0,
        group, input_split_sizes, output_split_sizes)``; backward: the reverse all-to-all.

        Derived: issued and waited for here (on an accelerator the wait orders the
        compute stream after the collective). The torch backend returns torch's
        ``AsyncCollectiveTensor`` instead, whose wait runs at the result's first use, so a
        thread that issues it goes on to its next sync hook at once (comm/compute overlap).

        Raises:
            ValueError: as ``differentiable_all_to_all`` (sizes that do not add up to
                ``tensor.shape[0]``, or lists not one entry per rank).
        """
        return self.differentiable_all_to_all(tensor, 0, 0, group, input_split_sizes=list(input_split_sizes),
                                              output_split_sizes=list(output_split_sizes))


def contract_members() -> dict[str, str]:
    """Every member of the contract mapped to the section that declares it."""
    members: dict[str, str] = {}
    for section in Platform.__mro__[1:]:
        if section.__module__.startswith("hyper_parallel.platform.contract."):
            for name in getattr(section, "__abstractmethods__", ()):
                members[name] = section.__name__
    return dict(sorted(members.items()))


def derived_members() -> list[str]:
    """The concrete members ``Platform`` derives from the abstract ones (they count
    toward the contract's size as much as the abstract ones)."""
    return sorted(name for name in vars(Platform) if not name.startswith("_"))
