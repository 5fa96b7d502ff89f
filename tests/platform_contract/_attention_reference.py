"""The dense float64 reference of attention for the kernel tests: which pairs an
``AttentionMask`` allows, and attention with its gradients over them (numpy, test side only)."""

from __future__ import annotations

import numpy as np

from hyper_parallel.platform import AttentionMask


def allowed_pairs(sq: int, sk: int, mask: AttentionMask) -> np.ndarray:
    """The bool ``[sq, sk]`` pairs ``mask`` allows, built densely (test side only)."""

    def block(lq: int, lk: int) -> np.ndarray:
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        if mask.causal == "top_left":
            return j <= i
        if mask.causal == "bottom_right":
            return j <= i + lk - lq
        return np.ones((lq, lk), bool)

    if mask.cu_seqlens_q is None:
        return block(sq, sk)
    out = np.zeros((sq, sk), bool)
    cq, ck = mask.cu_seqlens_q, mask.cu_seqlens_kv
    for d in range(len(cq) - 1):
        out[cq[d]:cq[d + 1], ck[d]:ck[d + 1]] = block(cq[d + 1] - cq[d], ck[d + 1] - ck[d])
    return out


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, allowed: np.ndarray,
              scale: float) -> tuple[np.ndarray, ...]:
    """Dense float64 attention and its gradients: ``(out, lse, dq, dk, dv)``; BSHD, GQA by
    ``h // group``; a query that sees no key has out 0 and lse ``-inf``."""
    q, k, v, dout = (a.astype(np.float64).transpose(0, 2, 1, 3) for a in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.where(allowed, q @ kr.transpose(0, 1, 3, 2) * scale, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    lse = np.where(total[..., 0] > 0, np.log(np.where(total > 0, total, 1.0))[..., 0] + m[..., 0], -np.inf)
    probs = e / np.where(total > 0, total, 1.0)
    out = probs @ vr
    dv = probs.transpose(0, 1, 3, 2) @ dout
    ds = probs * (dout @ vr.transpose(0, 1, 3, 2) - (dout * out).sum(-1, keepdims=True))
    dq, dk = ds @ kr * scale, ds.transpose(0, 1, 3, 2) @ q * scale

    def fold(g):
        return g.reshape(g.shape[0], -1, group, *g.shape[2:]).sum(2)

    bshd = [a.transpose(0, 2, 1, 3) for a in (out, dq, fold(dk), fold(dv))]
    return bshd[0], lse, bshd[1], bshd[2], bshd[3]
