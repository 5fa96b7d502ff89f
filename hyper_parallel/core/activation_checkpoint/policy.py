"""``CheckpointPolicy``: what to do with one saved tensor or op output, the names of
torch's selective checkpointing plus MindSpore's ``MUST_SWAP`` (activation swap, see
[Note: activation swap] in ``swap``).

[Note: what is refused in activation checkpointing]
``checkpoint_wrapper`` recomputes a whole module. Selective checkpointing (a
``policy_fn`` choosing a ``CheckpointPolicy`` per op, torch's
``create_selective_checkpoint_contexts``) is not built: ``checkpoint_wrapper(policy_fn=)``
raises ``NotImplementedError`` naming the supported path. ``swap_wrapper``'s
``policy_fn`` chooses per saved tensor, which both frameworks' saved-tensor hooks see.
"""

from __future__ import annotations

import enum


class CheckpointPolicy(enum.Enum):
    """What to do with one op's output under selective checkpointing (torch's
    ``torch.utils.checkpoint.CheckpointPolicy`` values), or with one saved tensor under
    activation swap (``MUST_SWAP``: copied to host; ``MUST_SAVE`` / ``PREFER_SAVE``:
    kept on the device)."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4
