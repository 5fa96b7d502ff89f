"""``AsyncContextParallel``: the Ulysses all-to-all overlapped with the q/k/v projections.

[Note: async all-to-all slots]
Forward: a forward hook on each projection (``q_proj``, ``k_proj``, ``v_proj``, output
``[batch, seq/n, heads * head_dim]``, or q/k/v in the attention's own layout) launches
the sequence -> heads all-to-all of its
output at once (``all_to_all_single(async_op=True)``), so the transfer of q overlaps the
GEMMs of k and v. The attention module's pre-hook waits for each, inside autograd
(``platform.differentiable_async_a2a_wait``), and hands the head-sharded tensors to the
module in place of the q/k/v it was called with.
Backward: the wait's backward launches the reverse all-to-all of the gradient
asynchronously, appends its handle to the projection's slot list (the handle box) and
returns a zero gradient. The wait's autograd input is the tensor the attention was called
with (rearranged to the projection's output layout), so that zero gradient flows back to
the projection's output as the module returned it; the projection's backward pre-hook,
which runs just before its own backward GEMM, waits for the handle and adds its result to
that gradient. (torch runs a module's forward hooks before it wraps the output for its
backward hooks, so the output the forward hook launched from is not the one the backward
pre-hook watches: the gradient must come through the attention's argument, which was
derived from the wrapped output.) Every handle is consumed in the step that produced it:
forward slots by the attention pre-hook, backward slots by the projection's backward
pre-hook, so nothing carries over to the next iteration (a projection that runs twice
before the attention raises).
"""

from __future__ import annotations

import warnings
from typing import Any

from hyper_parallel.core.context_parallel.context import Frame, Plan, module_call_site, push_frame
from hyper_parallel.core.context_parallel.sharded_qkv import refuse_dtensor_qkv, wrap_qkv
from hyper_parallel.core.context_parallel.context_parallel import ContextParallel
from hyper_parallel.core.context_parallel.ulysses import replicate_heads, seq_to_heads
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.platform import Work, get_platform
from hyper_parallel.platform.contract.layout import split_leading

PROJECTIONS = ("q", "k", "v")


class _Slots:
    """The handles in flight for one hooked attention; see [Note: async all-to-all slots]."""

    def __init__(self) -> None:
        self.launched: dict[str, tuple[Any, Work]] = {}  # projection -> (its output, the a2a Work)
        self.boxes: dict[str, list[tuple[Work, Any]]] = {name: [] for name in PROJECTIONS}  # backward handles


class AsyncContextParallel(ContextParallel):
    """``ContextParallel`` whose Ulysses all-to-all of q, k, v is launched right after each
    projection and waited just before attention (backward: launched by autograd, waited
    just before each projection's GEMM). Same arguments, same results as
    ``ContextParallel``; see [Note: async all-to-all slots].

    Projections return ``[batch, seq, heads * head_dim]`` (heads major in the last dim, as
    ``reshape(batch, seq, heads, head_dim)`` reads it), and q, k, v must reach the
    attention as that reshape (for BNSD, and a transpose) of them; or they return q, k, v
    themselves in the attention's layout (4-D, or sequence-first, ``seq_dim=0``: TND
    ``[tokens, heads, head_dim]`` or SBND ``[seq, batch, heads, head_dim]``, MindFormers'
    ``q_handoff`` / ``k_handoff`` / ``v_handoff`` identities), fed as they are. What is
    exchanged is the projection's output, so anything applied in between (RoPE, a norm)
    would be lost; do it inside the projection module or use ``ContextParallel``. Falls back to synchronous
    ``ContextParallel`` (with a warning) when a projection is not given or the mode has no
    all-to-all (``ulysses_degree == 1``); k/v with fewer heads than the Ulysses degree
    (GQA replication) take the synchronous path for k and v.
    """

    def apply(self, module: Any, device_mesh: DeviceMesh, q_proj: Any = None, k_proj: Any = None,
              v_proj: Any = None) -> Any:
        """Hook ``module`` (the core attention) and the three projections; returns ``module``."""
        plan = self.resolve(device_mesh)
        projections = dict(zip(PROJECTIONS, (q_proj, k_proj, v_proj)))
        if plan.ulysses_size == 1 or any(proj is None for proj in projections.values()):
            missing = [name for name, proj in projections.items() if proj is None]
            warnings.warn("AsyncContextParallel: " + (f"no {'/'.join(missing)} projection given" if missing else
                          "ulysses_degree == 1 has no all-to-all to overlap") + "; using synchronous ContextParallel",
                          stacklevel=2)
            return ContextParallel.apply(self, module, device_mesh)
        p = get_platform()
        slots = _Slots()
        name = type(module).__name__
        for proj_name, proj in projections.items():
            p.register_forward_hook(proj, lambda m, args, out, pn=proj_name: self._launch(plan, slots, pn, out))
            p.register_full_backward_pre_hook(proj, lambda m, grad_out, box=slots.boxes[proj_name]:
                                              self._finish_grad(box, grad_out))
        p.register_forward_pre_hook(module, lambda m, args, kwargs: self._pre_hook_async(plan, slots, name, m, args,
                                                                                          kwargs), with_kwargs=True)
        p.register_forward_hook(module, lambda m, args, out: self._post_hook(plan, name, out))
        return module

    def _launch(self, plan: Plan, slots: _Slots, proj_name: str, out: Any) -> None:
        if proj_name in slots.launched:
            raise RuntimeError(f"AsyncContextParallel: the {proj_name} projection ran twice before the attention "
                               "consumed its all-to-all; each projection must feed the hooked attention once per step")
        p, n = get_platform(), plan.ulysses_size
        split = self.head_dim if self._in_qkv_layout(out.ndim) else out.ndim - 1
        if out.shape[split] % n:
            raise ValueError(f"AsyncContextParallel: the {proj_name} projection's output {tuple(out.shape)} has "
                             f"{out.shape[split]} heads or features along dim {split}, not divisible by the Ulysses "
                             f"degree {n}; use ContextParallel")
        send = split_leading(out, split, n)  # [n, ..., heads or features / n, ...]
        slots.launched[proj_name] = (out, p.all_to_all_single(send, group=plan.ulysses_group, async_op=True))

    def _in_qkv_layout(self, ndim: int) -> bool:
        """Whether a projection output of ``ndim`` dims is q/k/v itself, in the attention's
        layout (4-D, or sequence-first: TND / SBND, MindFormers' q/k/v handoffs), rather than
        ``[batch, seq, heads * head_dim]``."""
        return ndim == 4 or self.seq_dim == 0

    @staticmethod
    def _finish_grad(box: list[tuple[Work, Any]], grad_output: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The projection's backward pre-hook: its output gradient plus the reverse
        all-to-all autograd launched for it, if any (none on the synchronous k/v path)."""
        if not box:
            return None
        work, _send = box.pop()
        return (grad_output[0] + work.wait(),) + tuple(grad_output[1:])

    def _pre_hook_async(self, plan: Plan, slots: _Slots, name: str, module: Any,
                        args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        p, n, s, h = get_platform(), plan.ulysses_size, self.seq_dim, self.head_dim
        q, k, v = self._qkv(name, args, kwargs)
        missing = [pn for pn in PROJECTIONS if pn not in slots.launched]
        if missing:
            raise RuntimeError(f"AsyncContextParallel on {name}: no all-to-all was launched by the {'/'.join(missing)} "
                               "projection(s) this step; the attention's q, k, v must come from the hooked projections")
        seq_len = self.check(plan, name, q, k, v, kwargs)
        if plan.mesh is not None:
            refuse_dtensor_qkv(name, (q, k, v))
        sync_kv = int(k.shape[h]) % n != 0  # GQA replication: see the class doc
        out = []
        for proj_name, t in zip(PROJECTIONS, (q, k, v)):
            x, work = slots.launched.pop(proj_name)
            if proj_name != "q" and sync_kv:
                work.wait()  # consumed, unused: these heads are replicated first
                out.append(seq_to_heads(p, replicate_heads(p, t, h, n), s, h, plan.ulysses_group))
                continue
            grad_box = slots.boxes[proj_name] if p.grad_enabled() else None
            # The wait's autograd input is the tensor the attention was called with, in the
            # projection's output layout: its gradient reaches the projection's output as
            # the module returned it, which its backward pre-hook watches.
            if self._in_qkv_layout(x.ndim):
                if tuple(x.shape) != tuple(t.shape):
                    raise ValueError(f"AsyncContextParallel on {name}: the {proj_name} projection returned "
                                     f"{tuple(x.shape)} but the attention got {proj_name} {tuple(t.shape)}; a "
                                     "projection that returns q/k/v in the attention's layout must feed it as is")
                out.append(p.differentiable_async_a2a_wait(t, work, None, plan.ulysses_group, n, s, h, grad_box))
                continue
            flat = (t if (s, h) == (1, 2) else t.transpose(1, 2)).reshape(*(int(d) for d in x.shape))
            y = p.differentiable_async_a2a_wait(flat, work, None, plan.ulysses_group, n, x.ndim - 2, x.ndim - 1,
                                                grad_box)  # [batch, seq, features / n]
            bshd = y.reshape(y.shape[0], y.shape[1], int(t.shape[h]) // n, int(t.shape[3]))
            out.append(bshd if (s, h) == (1, 2) else bshd.transpose(1, 2))
        if plan.mesh is not None:  # hybrid: [Note: q/k/v as DTensors]
            out = wrap_qkv(plan, seq_len, out, s, h)
        push_frame(Frame(name, plan, seq_len, module_call_site(module), module=module))
        return self._replace(args, kwargs, out)
