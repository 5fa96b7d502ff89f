"""The ``Platform`` ABC: the whole contract between core and a backend.

Each section lives in its own module under ``hyper_parallel.platform.contract``; this
module composes them. A backend subclasses ``Platform`` and implements every member;
``DifferentiableCollectives`` supplies the differentiable section once for all backends.
"""

from __future__ import annotations

from hyper_parallel.platform.contract.autograd import AutogradSection, VjpFn
from hyper_parallel.platform.contract.collectives import CollectivesSection
from hyper_parallel.platform.contract.common import (
    Capability,
    CompletedWork,
    CustomFunction,
    HandleWork,
    P2POp,
    ReduceOp,
    RemovableHandle,
    Work,
)
from hyper_parallel.platform.contract.device import DeviceSection
from hyper_parallel.platform.contract.differentiable import DifferentiableSection
from hyper_parallel.platform.contract.groups import GroupsSection
from hyper_parallel.platform.contract.modules import ModulesSection
from hyper_parallel.platform.contract.ops import LOCAL_OPS, TENSOR_METHODS, OpsSection
from hyper_parallel.platform.contract.streams import StreamsSection
from hyper_parallel.platform.contract.types import DTYPE_NAMES, TypesSection

__all__ = [
    "DTYPE_NAMES", "LOCAL_OPS", "TENSOR_METHODS", "Capability", "CompletedWork", "CustomFunction", "HandleWork",
    "P2POp", "Platform", "ReduceOp", "RemovableHandle", "VjpFn", "Work", "contract_members",
]


class Platform(
    TypesSection,
    GroupsSection,
    CollectivesSection,
    DifferentiableSection,
    AutogradSection,
    ModulesSection,
    OpsSection,
    StreamsSection,
    DeviceSection,
):
    """Everything core may ask of a framework/device pair.

    Instances are created by ``hyper_parallel.platform.get_platform()``; a subclass that
    leaves any member abstract raises ``TypeError`` when constructed.
    """

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def contract_members() -> dict[str, str]:
    """Every member of the contract mapped to the section that declares it."""
    members: dict[str, str] = {}
    for section in Platform.__mro__[1:]:
        if section.__module__.startswith("hyper_parallel.platform.contract."):
            for name in getattr(section, "__abstractmethods__", ()):
                members[name] = section.__name__
    return dict(sorted(members.items()))
