"""``RedistributionOperatorInfer``: MindSpore's planner of the operator list that turns
one tensor map into another, which MindFormers' Muon optimizer imports. Not built: this
project plans redistributions from placements (``redistribute.py``), and
``DTensor.redistribute`` / ``full_tensor()`` run them. The class exists so that code
importing it loads; constructing one raises ``NotImplementedError`` naming that path.
"""

from __future__ import annotations

from typing import Any


class RedistributionOperatorInfer:
    """Not supported (see the module docstring).

    Raises:
        NotImplementedError: on construction.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("RedistributionOperatorInfer (MindSpore's tensor-map operator-list planner, used by "
                                  "MindFormers' Muon optimizer) is not supported; redistribute a DTensor with "
                                  "dtensor.redistribute(device_mesh, placements) or gather it with full_tensor()")
