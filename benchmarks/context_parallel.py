#!/usr/bin/env python3
"""Forward + backward of causal attention under context parallelism, each mode of
hyper_parallel beside torch's own ring attention, per sequence length, in one run.

4 ranks on gloo (torch-cpu), ``[batch=1, seq, heads=8, head_dim=64]`` float32, causal.
Per mode and sequence length: barrier, forward and backward (gradients of q, k, v
materialized), timed on every rank; a repetition's time is the slowest rank's and the
median over ``--iters`` repetitions after ``--warmup`` is reported. Memory is the bytes
of activations saved for backward on one rank (``torch.autograd.graph.saved_tensors_hooks``,
plus the tensors our custom autograd functions keep on ``ctx.saved``, which those hooks do
not see: ring attention keeps its q, k, v, output and log-sum-exp there; deduplicated by
storage), which is what context parallelism divides by ``cp``; process RSS
on a shared CPU host is too noisy to read. ``single device`` is the whole sequence on one
rank (``hp.scaled_dot_product_attention`` outside context parallelism: the fused kernel),
the memory reference; ``one rank's share`` is the same kernel on ``seq / cp`` positions,
the reference for peak memory per rank (the peak bytes of live tensors during one untimed
call, by torch's ``MemTracker``; RSS of a reused process is blurred by the allocator). A
second table searches the longest sequence whose training step keeps at most a budget of
tensors alive per rank, cp = 1, 2, 4: attention alone (``--budget-mib``) and a
``--layers``-layer transformer (``--model-budget-mib``), see ``longest_rank``.

torch's ring attention: ``torch.distributed.tensor.experimental`` dispatches SDPA to its
ring templates (``_templated_ring_attention`` and its backward) only for the CUDA kernels
(flash, efficient, cuDNN). The shim here calls those same templates directly, with
torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward) as the per-block op, inside a small ``autograd.Function``; it runs twice, with
rotation ``alltoall`` (a real ring: one ``permute_tensor`` per step; the reference of
every ratio) and ``allgather`` (torch's default: one all-gather, the counterpart of our
``kv_exchange="allgather"``). Load balance is torch's default (on), so its data is in the
same head-tail layout as ours with ``load_balance=True``.

    python benchmarks/context_parallel.py [--seqs 2048 4096 16384] [--iters 3] [--budget-mib 24]
        [--layers 4] [--model-budget-mib 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import host_meta, peak_tensor_bytes, write_results  # noqa: E402  (after the path insert)

HEADS, HEAD_DIM, BATCH = 8, 64, 1
#: The longest-sequence search's shape (``--budget-mib``): fewer heads, so that the
#: lengths a budget admits stay computable on a 2-core host.
SEARCH_HEADS, SEARCH_HEAD_DIM = 2, 32


# name -> (ulysses_degree (None: all ranks), kv_exchange, load_balance)
MODES = {
    "ulysses": (None, "allgather", False),
    "allgather": (1, "allgather", False),
    "allgather+lb": (1, "allgather", True),
    "ring": (1, "ring", False),
    "ring+lb": (1, "ring", True),
    "hybrid 2x2 ring": (2, "ring", False),
    "hybrid 2x2 ring+lb": (2, "ring", True),
}


def _torch_ring(group, rotate: str):
    """torch's ring templates on CPU (see the module doc): BNSD q/k/v -> out, the key/value
    blocks exchanged by ``rotate`` (``"alltoall"``: its ring; ``"allgather"``: one all-gather,
    its default). torch keeps the rotate method in a global option: it is set before each
    call. Its backward passes the dK/dV accumulators around the ring either way."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as tattn

    aten = torch.ops.aten

    def forward_op(query, key, value, *, is_causal, scale=None, **_):
        return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)

    def backward_op(*, grad_out, query, key, value, out, logsumexp, is_causal, scale=None, **_):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out,
                                                                          logsumexp, 0.0, is_causal, scale=scale)

    class Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            tattn.set_rotate_method(rotate)
            out, lse = tattn._templated_ring_attention(group, 2, forward_op, q, k, v, is_causal=True)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse = ctx.saved_tensors
            tattn.set_rotate_method(rotate)
            return tuple(tattn._templated_ring_attention_backward(group, 2, backward_op, grad.contiguous(), "grad_out",
                                                                  q, k, v, out, lse, True)[:3])

    return Ring.apply


def bench_rank(seqs: list[int], iters: int, warmup: int) -> list[dict]:
    """Runs on every rank: times every mode; returns this rank's seconds and saved bytes."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import hyper_parallel as hp

    p = hp.get_platform()
    n, r = p.world_size(), p.rank()
    mesh = hp.init_device_mesh(p.device_type, (n,))
    torch_ring = _torch_ring(dist.group.WORLD, "alltoall")
    torch_allgather = _torch_ring(dist.group.WORLD, "allgather")
    rows = []
    for seq in seqs:
        rng = np.random.default_rng(seq)
        full = [torch.from_numpy(rng.standard_normal((BATCH, seq, HEADS, HEAD_DIM)).astype(np.float32))
                for _ in range(4)]

        def local(lb: bool) -> list:
            return [t.contiguous() for t in hp.context_parallel_shard(full, [1] * 4, mesh, load_balance=lb)]

        attend = _module()
        share = [t[:, :seq // n].contiguous() for t in full]
        runs = {"single device": (attend, full), "one rank's share": (attend, share)}
        for name, (ud, exchange, lb) in MODES.items():
            module = _module()
            hp.ContextParallel(ulysses_degree=ud, kv_exchange=exchange, load_balance=lb).apply(module, mesh)
            runs[name] = (module, local(lb))
        bnsd = [t.transpose(1, 2).contiguous() for t in local(True)]
        runs["torch ring (lb)"] = (torch_ring, bnsd)
        runs["torch all-gather (lb)"] = (torch_allgather, bnsd)

        with torch.no_grad():  # both rings compute the same thing: a wrong shim would show here
            ours = runs["ring+lb"][0](*runs["ring+lb"][1][:3])
            theirs = [fn(*bnsd[:3]).transpose(1, 2) for fn in (torch_ring, torch_allgather)]
        max_diff = max(float((ours - t).abs().max()) for t in theirs)
        for name, (fn, (q0, k0, v0, dout)) in runs.items():
            times, saved = [], 0

            def once() -> None:
                q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
                fn(q, k, v).backward(dout)

            dist.barrier()
            peak = peak_tensor_bytes(once)  # an untimed call under the tracker
            for i in range(warmup + iters):
                q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
                storages: dict[int, int] = {}

                def pack(t):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    return t

                dist.barrier()
                start = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = fn(q, k, v)
                for t in _ctx_saved(out):
                    pack(t)
                out.backward(dout)
                float(q.grad.reshape(-1)[0] + k.grad.reshape(-1)[0] + v.grad.reshape(-1)[0])
                elapsed = time.perf_counter() - start
                if i >= warmup:
                    times.append(elapsed)
                saved = sum(storages.values())
            rows.append({"mode": name, "seq": seq, "seconds": times, "saved_bytes": saved, "peak_bytes": peak,
                         "rank": r, "max_diff_ours_vs_torch_ring": max_diff})
    return rows


def _ctx_saved(out) -> list:
    """Tensors kept as ``ctx.saved`` by the custom autograd functions in ``out``'s graph (on
    torch a custom function's graph node is its ``ctx``)."""
    import torch

    found, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found += [t for t in getattr(node, "saved", ()) if isinstance(t, torch.Tensor)]
        todo += [next_fn for next_fn, _ in node.next_functions]
    return found


def _module():
    import torch

    import hyper_parallel as hp

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return hp.scaled_dot_product_attention(q, k, v, is_causal=True)

    return Attn()


#: The torch run each mode is also compared with: the same key/value exchange (torch has
#: no Ulysses; its ring is the reference there).
_TORCH_SAME = {name: "torch all-gather (lb)" if exchange == "allgather" and ud == 1 else "torch ring (lb)"
               for name, (ud, exchange, _) in MODES.items()}


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """Slowest rank per repetition, median over repetitions; saved bytes of the largest rank."""
    results = []
    for i, row in enumerate(per_rank[0]):
        slowest = [max(rank_rows[i]["seconds"][j] for rank_rows in per_rank) for j in range(len(row["seconds"]))]
        results.append({"mode": row["mode"], "seq": row["seq"], "ms": statistics.median(slowest) * 1e3,
                        "saved_mib": max(rank_rows[i]["saved_bytes"] for rank_rows in per_rank) / 2**20,
                        "peak_mib": max(rank_rows[i]["peak_bytes"] for rank_rows in per_rank) / 2**20,
                        "max_diff_ours_vs_torch_ring": max(rank_rows[i]["max_diff_ours_vs_torch_ring"]
                                                           for rank_rows in per_rank)})
    for entry in results:
        single = next(e for e in results if e["seq"] == entry["seq"] and e["mode"] == "single device")
        entry["memory_vs_single"] = entry["saved_mib"] / single["saved_mib"]
    for entry in results:
        # Every context-parallel mode against torch's load-balanced ring at the same length,
        # and its peak memory per rank against one process running the kernel on its share.
        share = next(e for e in results if e["seq"] == entry["seq"] and e["mode"] == "one rank's share")
        entry["peak_vs_share"] = entry["peak_mib"] / max(share["peak_mib"], 1e-9)
        if entry["mode"] in MODES:
            for key, torch_mode in (("ratio", "torch ring (lb)"), ("ratio_same_exchange", _TORCH_SAME[entry["mode"]])):
                ref = next((e for e in results if e["seq"] == entry["seq"] and e["mode"] == torch_mode), None)
                if ref is not None:
                    entry[key] = entry["ms"] / ref["ms"]
    return results


def markdown(results: list[dict], world: int) -> str:
    lines = [
        f"# Context parallelism: forward + backward of causal attention ({world} ranks, gloo, CPU)",
        "",
        f"`[batch={BATCH}, seq, heads={HEADS}, head_dim={HEAD_DIM}]` float32. ms: median of the slowest rank; "
        "saved MiB: activations saved for backward on the largest rank; memory ratio: saved / single device "
        f"(1/cp = {1 / world:.2f} is the ideal); time ratio: each mode / torch's load-balanced ring "
        "at that length (below 1: faster); same exchange: each mode / torch with the same key/value exchange "
        "(all-gather modes / torch's all-gather rotation, the others / its ring). Largest |ours ring+lb - torch| "
        "over the outputs (both rotations): "
        f"{max(e['max_diff_ours_vs_torch_ring'] for e in results):.1e}.",
        "",
        "peak MiB: peak bytes of live tensors during the call on the largest rank (torch's MemTracker, inputs "
        "included); peak ratio: that / one process running the kernel on its share (`[1, seq/cp, ...]`) "
        "(target: within 2x).",
        "",
        "| mode | seq | ms | saved MiB | memory ratio | peak MiB | peak ratio vs share | time ratio vs torch ring "
        "| same exchange |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in results:
        ratio, same = (f"{e[key]:.2f}" if key in e else "" for key in ("ratio", "ratio_same_exchange"))
        lines.append(f"| {e['mode']} | {e['seq']} | {e['ms']:.1f} | {e['saved_mib']:.1f} | "
                     f"{e['memory_vs_single']:.2f} | {e['peak_mib']:.1f} | {e['peak_vs_share']:.2f} | {ratio} | "
                     f"{same} |")
    return "\n".join(lines) + "\n"


def _model(layers: int, hidden: int):
    """``layers`` pre-norm transformer blocks (attention through
    ``hp.scaled_dot_product_attention``, causal; a 4x GELU MLP), ``[1, seq, hidden]`` in
    and out; the attention submodules are ``model.attns``."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
            self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
            self.attn = _module()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                           torch.nn.Linear(4 * hidden, hidden))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, SEARCH_HEADS, -1).unbind(2)
            x = x + self.proj(self.attn(q, k, v).reshape(b, s, hidden))
            return x + self.mlp(self.norm2(x))

    model = torch.nn.Sequential(*[Block() for _ in range(layers)])
    model.attns = [block.attn for block in model]
    return model


def longest_rank(budget_mib: float, start: int, limit: int, layers: int) -> list[dict]:
    """Runs on every rank: the longest sequence (a multiple of ``256 * cp``: growing by
    1.5x from ``start`` until over the budget, then bisected) whose training step keeps
    at most ``budget_mib`` of tensors alive per rank (peak, torch's ``MemTracker``; the
    largest rank's). ``layers == 0``: the step is attention alone, q/k/v
    ``[1, seq, SEARCH_HEADS, SEARCH_HEAD_DIM]`` and a given output gradient; otherwise
    ``_model(layers)`` on ``[1, seq, SEARCH_HEADS * SEARCH_HEAD_DIM]`` with the loss
    ``sum(out ** 2)``. Ring attention with load balance for cp > 1, the sequence sharded
    as ``context_parallel_shard`` lays it out."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import hyper_parallel as hp

    p = hp.get_platform()
    n = p.world_size()
    torch.manual_seed(0)
    hidden = SEARCH_HEADS * SEARCH_HEAD_DIM
    model = _model(layers, hidden) if layers else None
    attns = model.attns if layers else [_module()]
    if n > 1:
        mesh = hp.init_device_mesh(p.device_type, (n,))
        for attn in attns:
            hp.ContextParallel(ulysses_degree=1, kv_exchange="ring", load_balance=True).apply(attn, mesh)
    grain = 256 * n

    def peak_at(seq: int) -> float:
        rng = np.random.default_rng(seq)
        local = seq // n
        if layers:
            x0 = torch.from_numpy(rng.standard_normal((1, local, hidden)).astype(np.float32))

            def once() -> None:
                (model(x0.clone().requires_grad_(True)) ** 2).sum().backward()
        else:
            data = [torch.from_numpy(rng.standard_normal((1, local, SEARCH_HEADS, SEARCH_HEAD_DIM))
                                     .astype(np.float32)) for _ in range(4)]

            def once() -> None:
                q, k, v = (t.clone().requires_grad_(True) for t in data[:3])
                attns[0](q, k, v).backward(data[3])

        dist.barrier()
        peak = torch.tensor([float(peak_tensor_bytes(once))])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if model is not None:
            model.zero_grad(set_to_none=True)
        rows.append({"cp": n, "seq": seq, "peak_mib": float(peak) / 2**20})
        return float(peak) / 2**20

    rows: list[dict] = []
    fit, seq = 0, start // grain * grain
    while seq <= limit and peak_at(seq) <= budget_mib:
        fit, seq = seq, int(seq * 1.5) // grain * grain
    over = seq
    while over - fit > grain:
        mid = (fit + over) // 2 // grain * grain
        if mid in (fit, over):
            break
        if peak_at(mid) <= budget_mib:
            fit = mid
        else:
            over = mid
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 16384])
    parser.add_argument("--budget-mib", type=float, default=24.0,
                        help="per-rank peak tensor memory budget of the longest-sequence search (0: skip it)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the longest-sequence search's model")
    parser.add_argument("--model-budget-mib", type=float, default=256.0,
                        help="per-rank peak tensor memory budget of the model's longest-sequence search")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "context_parallel")
    args = parser.parse_args()

    from hyper_parallel.testing import run_on_ranks

    # The ranks import the rank function by name, which __main__ cannot give them.
    from benchmarks.context_parallel import bench_rank as rank_fn

    from benchmarks.context_parallel import longest_rank

    per_rank = run_on_ranks(rank_fn, args.world_size, args.seqs, args.iters, args.warmup, platform="torch-cpu",
                            timeout_s=3600)
    results = summarize(per_rank)
    longest = []
    if args.budget_mib > 0:
        for layers, budget in ((0, args.budget_mib), (args.layers, args.model_budget_mib)):
            for cp in (1, 2, 4):
                rows = run_on_ranks(longest_rank, cp, budget, 4096, 1 << 20, layers, platform="torch-cpu",
                                    timeout_s=3600)[0]
                fits = [r["seq"] for r in rows if r["peak_mib"] <= budget]
                longest.append({"layers": layers, "budget_mib": budget, "cp": cp,
                                "longest_seq": max(fits, default=0), "tried": rows})
    meta = {"world_size": args.world_size, "backend": "torch-cpu (gloo)", "iters": args.iters,
            "warmup": args.warmup, "shape": [BATCH, "seq", HEADS, HEAD_DIM], "causal": True,
            "budget_mib": args.budget_mib, "model_budget_mib": args.model_budget_mib,
            "model_layers": args.layers, "search_shape": [1, "seq", SEARCH_HEADS, SEARCH_HEAD_DIM], **host_meta()}
    table = markdown(results, args.world_size)
    if longest:
        table += ("\n## Longest sequence that trains within a per-rank memory budget\n\n"
                  "Peak bytes of live tensors per rank (torch's MemTracker, the largest rank's) of one training "
                  "step; ring attention with load balance for cp > 1; the longest multiple of 256 * cp under the "
                  "budget (grown by 1.5x, then bisected). Target: proportional to cp.\n\n"
                  f"- *attention alone*: `[1, seq, {SEARCH_HEADS}, {SEARCH_HEAD_DIM}]` float32 q/k/v, causal, "
                  "forward + backward. Its ring keeps two blocks in flight each way (the current and the next "
                  "K/V pair, the dK/dV accumulator sent and the one received) beside the kernel's own tensors: "
                  "about twice a local call's memory per token, so this row stays below proportional.\n"
                  f"- *{args.layers}-layer model*: pre-norm transformer blocks (hidden "
                  f"{SEARCH_HEADS * SEARCH_HEAD_DIM}, {SEARCH_HEADS} heads, 4x GELU MLP), float32, loss "
                  "`sum(out ** 2)`, forward + backward: the activations every layer keeps for backward scale "
                  "with seq / cp, the ring's blocks in flight are one layer's at a time.\n\n"
                  "| step | budget MiB | cp | longest seq | vs cp = 1 |\n|---|---:|---:|---:|---:|\n")
        for row in longest:
            base = next(r for r in longest if r["layers"] == row["layers"] and r["cp"] == 1)["longest_seq"]
            step = "attention alone" if row["layers"] == 0 else f"{row['layers']}-layer model"
            table += (f"| {step} | {row['budget_mib']:.0f} | {row['cp']} | {row['longest_seq']} | "
                      f"{row['longest_seq'] / max(base, 1):.2f} |\n")
    write_results(args.out, meta, results, table, longest=longest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
