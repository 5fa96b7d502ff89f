"""Contract: the argument rules of the members, checked by every backend (and by core's
helpers over the members) before any communication is issued.

Each check raises with the argument, the value, the rule and the fix, so that every
rank fails the same way before a collective could leave its peers waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.contract.attention import AttentionMask


def normalize_dim(dim: int, ndim: int, *, argument: str = "dim") -> int:
    """``dim`` as a non-negative index into ``ndim`` dims.

    Raises:
        ValueError: ``dim`` outside ``[-ndim, ndim)``.
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
        raise ValueError(f"{argument}={dim!r} is out of range for a {ndim}-D tensor; use a dim in [{-ndim}, {ndim})")
    return dim % ndim


def check_divisible(size: int, parts: int, *, what: str, fix: str) -> int:
    """``size // parts``, or a ValueError naming ``what`` when it does not divide."""
    if size % parts:
        raise ValueError(f"{what} is {size}, not divisible by the group size {parts}; {fix}")
    return size // parts


def check_split_sizes(sizes: Sequence[int] | None, total: int | None, group_size: int, *, argument: str) -> list[int] | None:
    """Validate all-to-all split sizes: one non-negative int per rank, summing to ``total``
    when ``total`` is known. Returns them as a list (``None`` passes through)."""
    if sizes is None:
        return None
    sizes = list(sizes)
    if len(sizes) != group_size:
        raise ValueError(f"{argument}={sizes} has {len(sizes)} entries; give one per rank of the group ({group_size})")
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{argument}={sizes} holds {size!r}; split sizes are non-negative ints")
    if total is not None and sum(sizes) != total:
        raise ValueError(
            f"{argument}={sizes} sums to {sum(sizes)}, but the tensor has {total} rows on dim 0; "
            "the split sizes must add up to the size of dim 0"
        )
    return sizes


def check_peer(peer: int, group_size: int, own_rank: int, *, argument: str) -> None:
    """A point-to-point peer must be another rank of the group."""
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < group_size:
        raise ValueError(f"{argument}={peer!r} is not a rank of the group (size {group_size}); use a group rank in [0, {group_size})")
    if peer == own_rank:
        raise ValueError(f"{argument}={peer} is this rank itself; point-to-point needs another rank of the group")


def check_group_ranks(ranks: Sequence[int], world_size: int, *, argument: str = "ranks") -> tuple[int, ...]:
    """A group's global ranks: non-empty, distinct, inside the world. Returned sorted."""
    ranks = tuple(ranks)
    if not ranks:
        raise ValueError(f"{argument}=() is empty; a group needs at least one rank")
    for rank in ranks:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ValueError(f"{argument}={list(ranks)} holds {rank!r}; ranks are ints in [0, {world_size})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{argument}={list(ranks)} repeats a rank; list each rank once")
    return tuple(sorted(ranks))


def check_partition(partition: Sequence[Sequence[int]], world_size: int) -> list[tuple[int, ...]]:
    """Disjoint parts that cover ``range(world_size)``; each part sorted."""
    parts = [check_group_ranks(part, world_size, argument="partition part") for part in partition]
    seen = sorted(rank for part in parts for rank in part)
    if seen != list(range(world_size)):
        raise ValueError(
            f"partition={[list(p) for p in parts]} does not cover each of the {world_size} ranks exactly once; "
            "give disjoint parts whose union is the world"
        )
    return parts


def check_vjp_part(part: str, ran: list[str]) -> None:
    """Check a ``vjp`` backward call's ``part`` against the parts already run (``ran``,
    appended to): ``"all"`` once, or ``"input"`` then ``"weight"`` once each."""
    if part not in ("all", "input", "weight"):
        raise ValueError(f"vjp backward: part={part!r} must be 'all', 'input' or 'weight'")
    allowed = {"all": [], "input": [], "weight": ["input"]}[part]
    if ran != allowed:
        raise RuntimeError(f"vjp backward: part={part!r} after {ran or 'nothing'}; a backward runs once as 'all', "
                           "or as 'input' then 'weight'")
    ran.append(part)


def check_gather_out(out: Any, tensor: Any, group_size: int, *, member: str) -> None:
    """Validate the ``out=`` buffer of an all-gather along dim 0: shape
    ``[group_size * d0, *rest]``, ``tensor``'s dtype, contiguous.

    Raises:
        ValueError: naming the expected and the given shape/dtype, or the layout.
    """
    want = (group_size * int(tensor.shape[0]), *(int(d) for d in tensor.shape[1:]))
    got = tuple(int(d) for d in out.shape)
    if got != want:
        raise ValueError(f"{member}: out has shape {got}; an all-gather of {tuple(tensor.shape)} over "
                         f"{group_size} ranks needs {want}; allocate out with that shape")
    if out.dtype != tensor.dtype:
        raise ValueError(f"{member}: out has dtype {out.dtype} but tensor has {tensor.dtype}; "
                         "allocate out with the input's dtype")
    if not out.is_contiguous():
        raise ValueError(f"{member}: out is not contiguous; pass a contiguous buffer (the collective writes it whole)")


def _dims(x: Any) -> tuple[int, ...]:
    return tuple(map(int, x.shape))


def check_attention_inputs(q: Any, k: Any, v: Any, mask: AttentionMask, dtypes: Sequence[str],
                           supported: Sequence[str], *, backend: str, kernel: str) -> None:
    """Raise unless ``q``/``k``/``v``/``mask`` fit ``Platform.attention`` and the kernel
    that ``backend`` runs: BSHD shapes, grouped-query head counts, one dtype (``dtypes``:
    the names of q's, k's and v's) among ``supported``, document lists ending at the lengths.

    Raises:
        TypeError: ``mask`` is not an ``AttentionMask`` (a dense mask).
        ValueError: the rule broken, with the values and the fix.
    """
    if not isinstance(mask, AttentionMask):
        raise TypeError(f"attention: mask={mask!r} must be an AttentionMask (hyper_parallel.platform.AttentionMask); "
                        "dense masks are not taken")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention: q, k, v must be 4-D [batch, seq, heads, head_dim], got shapes {_dims(q)}, "
                         f"{_dims(k)}, {_dims(v)}; reshape to BSHD")
    q_dims, k_dims = _dims(q), _dims(k)
    if k_dims != _dims(v) or q_dims[0] != k_dims[0] or q_dims[3] != k_dims[3]:
        raise ValueError(f"attention: q {_dims(q)} and k/v {_dims(k)}/{_dims(v)} do not fit; k and v need the same "
                         "shape [batch, kv_seq, kv_heads, head_dim], with q's batch and head_dim")
    heads, kv_heads = q_dims[2], k_dims[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"attention: q has {heads} heads, not a multiple of k/v's {kv_heads} heads; "
                         "grouped-query attention needs heads divisible by kv_heads")
    if len(set(dtypes)) != 1:
        raise ValueError(f"attention: q, k, v have dtypes {list(dtypes)}; give them one dtype (cast k and v to q's)")
    if dtypes[0] not in supported:
        raise ValueError(f"attention on {backend}: dtype {dtypes[0]} is not taken by {kernel}; use one of "
                         f"{', '.join(supported)}")
    mask.check(q_dims[1], k_dims[1])


def check_attention_backward(dout: Any, q: Any, out: Any, lse: Any) -> None:
    """Raise ValueError unless ``dout``/``out`` are shaped like ``q`` and ``lse`` is
    ``[batch, heads, q_seq]`` (``Platform.attention_backward``)."""
    q_dims = _dims(q)
    for name, x in (("dout", dout), ("out", out)):
        if _dims(x) != q_dims:
            raise ValueError(f"attention_backward: {name} has shape {_dims(x)}, but q has {q_dims}; {name} is "
                             "[batch, q_seq, heads, head_dim] like q")
    b, sq, h, _ = q_dims
    if _dims(lse) != (b, h, sq):
        raise ValueError(f"attention_backward: lse has shape {_dims(lse)}; it must be [batch, heads, q_seq] = "
                         f"{[b, h, sq]} (attention's second output)")


def refuse_dtensor(tensor: Any, member: str) -> None:
    """Raise where a platform member that reads a tensor's values is handed a DTensor:
    its values are a piece of a global tensor, and which one the caller means (this
    rank's piece, the whole tensor) must be said, not guessed.

    Raises:
        TypeError: ``tensor`` is a DTensor (it has a spec and ``to_local``).
    """
    if hasattr(tensor, "_spec") and hasattr(tensor, "to_local"):
        raise TypeError(f"{member}: got a DTensor of global shape {tuple(tensor.shape)}; pass tensor.to_local() "
                        "for this rank's piece or tensor.full_tensor() for the whole tensor (a collective)")


def local_piece(tensor: Any) -> Any:
    """A DTensor's local piece (its ``_local``, the attribute of core's ``DTensor`` a
    backend's class is built on, ``Platform.dtensor_type``), a plain tensor itself."""
    return getattr(tensor, "_local", tensor)
