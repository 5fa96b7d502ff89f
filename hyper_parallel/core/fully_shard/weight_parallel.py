"""Weight-parallel mode for sequence-parallel training (the ISP idea of InternEvo:
Chen et al., *InternEvo*, arXiv 2401.09149, "intelligent sequence parallelism").

Each rank computes whole layers on its slice of the sequence (activations stay
sequence-sharded: the token-wise layers need nothing from other ranks); only the
weights are distributed. Every weight-holding leaf module (a linear) of every block
is its own fully_shard unit with ``reshard_after_forward=True``: its weight is
**all-gathered** before use and released right after, its gradient
**reduce-scattered** to the shards. A block's weights are all-gathered
``prefetch_blocks`` blocks ahead (asynchronously, so the collectives overlap the
compute of the blocks in between), and in the backward the same distance behind.

Blocks are found from the module structure, never from names: the longest run of
two or more sibling modules of one type that themselves have submodules (a
``ModuleList``/``CellList`` of transformer layers).
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.fully_shard.api import fully_shard, hsdp_state
from hyper_parallel.core.fully_shard.buffer_pool import GatherBufferPool
from hyper_parallel.core.fully_shard.policies import MixedPrecisionPolicy
from hyper_parallel.platform import get_platform


def find_blocks(module: Any) -> list[Any]:
    """The repeated blocks of ``module``: among the direct children of each submodule,
    the largest group of two or more of one type that have submodules of their own
    (ties: the first in module order).

    Raises:
        ValueError: no such group (the model has no repeated blocks).
    """
    p = get_platform()
    best: list[Any] = []
    for _, sub in p.named_modules(module):
        children = [m for name, m in p.named_modules(sub) if name and "." not in name]
        groups: dict[type, list[Any]] = {}
        for child in children:
            if any(name for name, _ in p.named_modules(child) if name):  # has submodules
                groups.setdefault(type(child), []).append(child)
        for group in groups.values():
            if len(group) >= 2 and len(group) > len(best):
                best = group
    if not best:
        raise ValueError(f"weight_parallel: {type(module).__name__} has no repeated blocks (two or more sibling "
                         "modules of one type with submodules); pass blocks= explicitly")
    return best


def _weight_leaves(block: Any) -> list[Any]:
    """The leaf modules of ``block`` that hold a parameter of two or more dims."""
    p = get_platform()
    out = []
    for _, sub in p.named_modules(block):
        is_leaf = not any(n for n, _ in p.named_modules(sub) if n)
        if is_leaf and any(len(tuple(param.shape)) >= 2 for _, param in p.named_parameters(sub)):
            out.append(sub)
    return out


def weight_parallel(module: Any, mesh: DeviceMesh, *, prefetch_blocks: int = 1,
                    blocks: list[Any] | None = None, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                    ignored_params: Any = None, buffer_pool: bool = False) -> Any:
    """Apply the weight-parallel mode to ``module`` over the 1-D ``mesh`` of the
    sequence-parallel ranks, then fully_shard the root (the remaining parameters).

    Feed each rank its slice of the sequence (``[batch, seq / N, ...]``); the loss of a
    rank is the mean over its tokens, so the averaged gradients are those of the
    global mean (equal slices).

    Args:
        module: the model; ``blocks`` default: ``find_blocks(module)``.
        mesh: 1-D mesh over the world.
        prefetch_blocks: how many blocks ahead (forward) / behind (backward) a block's
            weights are all-gathered; 0: each weight when its module starts.
        buffer_pool: gather the blocks' weights into reusable buffers (one
            ``GatherBufferPool`` for the model, keyed by shape and dtype): about
            ``prefetch_blocks + 2`` blocks' worth of buffers serve every block and step
            instead of an allocation per gather. The pool is ``hsdp_state(leaf).params[i].pool``;
            see [Note: when a pooled buffer may be overwritten] (``buffer_pool``).

    Returns:
        ``module``.

    Raises:
        ValueError: ``prefetch_blocks`` negative or not an int; no blocks found; the
            errors of ``fully_shard``.
    """
    if not isinstance(prefetch_blocks, int) or isinstance(prefetch_blocks, bool) or prefetch_blocks < 0:
        raise ValueError(f"weight_parallel: prefetch_blocks={prefetch_blocks!r} must be an int >= 0")
    blocks = find_blocks(module) if blocks is None else list(blocks)
    units: list[list[Any]] = []
    for block in blocks:
        leaves = _weight_leaves(block)
        for leaf in leaves:
            fully_shard(leaf, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy,
                        ignored_params=ignored_params)
        units.append(leaves)
    fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy, ignored_params=ignored_params)
    if buffer_pool:
        pool = GatherBufferPool()
        for leaves in units:
            for leaf in leaves:
                for hp in hsdp_state(leaf).params:
                    hp.pool = pool
    k = prefetch_blocks
    for i, leaves in enumerate(units):
        if not leaves or k == 0:
            continue
        # Forward: block i's first unit gathers block i + k (block 0 also gathers 1..k).
        ahead = range(1, k + 1) if i == 0 else [i + k]
        targets = [leaf for j in ahead if j < len(units) for leaf in units[j]]
        hsdp_state(leaves[0]).set_modules_to_forward_prefetch(targets)
        # Backward (reverse): block i's last unit, whose backward runs first, gathers
        # block i - k (the last block also gathers the k before it).
        behind = range(i - 1, i - k - 1, -1) if i == len(units) - 1 else [i - k]
        targets = [leaf for j in behind if j >= 0 for leaf in units[j]]
        hsdp_state(leaves[-1]).set_modules_to_backward_prefetch(targets)
    return module
