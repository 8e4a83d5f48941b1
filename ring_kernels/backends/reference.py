"""Plain attention written out: the block backend that is the ground truth for the others, and ``plain_attention``
on whole sequences, the one reference hfpatch's checks and the benchmarks' gate compare against.

Both materialise the (B, Hk, G, Sq, Sk) score tensor, so they are for correctness and small blocks (and the
cases no fast backend can do), not for speed. GQA is computed by grouping query heads, never by repeating
K/V: q (B, Sq, Hk*G, D) is viewed as (B, Hk, G, Sq, D) against k (B, Hk, 1, Sk, D).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..merge import safe_lse
from .base import EMPTY, FULL, BlockMask

__all__ = ["ReferenceBackend", "plain_attention"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp64 inputs stay fp64 (used by tests); everything else is computed in fp32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(B, S, H, D) -> q (B, Hk, G, Sq, D), k/v (B, Hk, 1, Sk, D) in the compute dtype."""
    b, sq, h, d = q.shape
    hk = k.shape[2]
    ct = _compute_dtype(q.dtype)
    qg = q.to(ct).permute(0, 2, 1, 3).reshape(b, hk, h // hk, sq, d)
    kg = k.to(ct).permute(0, 2, 1, 3).unsqueeze(2)
    vg = v.to(ct).permute(0, 2, 1, 3).unsqueeze(2)
    return qg, kg, vg


def _scores(qg, kg, scale: float, softcap: float, visible: Optional[torch.Tensor]):
    """Scores (B, Hk, G, Sq, Sk) after softcap and mask, plus tanh(raw/softcap) for the softcap backward."""
    s = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    tanh = None
    if softcap > 0.0:
        tanh = torch.tanh(s / softcap)
        s = softcap * tanh
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s, tanh


def _visible(mask: BlockMask, sq: int, sk: int, device) -> Optional[torch.Tensor]:
    """Dense (Sq, Sk) visibility, or None when every key is visible (no masking needed)."""
    if mask.kind(sq, sk) == FULL:
        return None
    return mask.dense(sq, sk, device)


class ReferenceBackend:
    """Explicit softmax(QK^T)V on any device and dtype, with any ``BlockMask`` and softcap."""

    name = "reference"

    def unsupported_reason(self, *, device, dtype, head_dim, mask_kind, softcap) -> Optional[str]:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return f"dtype {dtype} is not a floating type"
        return None

    def forward(self, q, k, v, *, scale: float, mask: BlockMask, softcap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
        b, sq, h, d = q.shape
        sk = k.shape[1]
        if mask.kind(sq, sk) == EMPTY:
            return q.new_zeros(q.shape), torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
        qg, kg, vg = _grouped(q, k, v)
        s, _ = _scores(qg, kg, scale, softcap, _visible(mask, sq, sk, q.device))
        lse = torch.logsumexp(s, dim=-1)                       # (B, Hk, G, Sq); -inf for rows with no key
        p = torch.exp(s - safe_lse(lse).unsqueeze(-1))         # masked scores give exp(-inf) = 0
        out = torch.matmul(p, vg)                              # (B, Hk, G, Sq, D)
        out = out.reshape(b, h, sq, d).permute(0, 2, 1, 3).to(q.dtype)
        return out, lse.reshape(b, h, sq).float()

    def backward(self, dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, softcap: float = 0.0):
        """Flash-attention style backward from the merged ``out``/``lse``: p = exp(s - lse), no renormalising."""
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        if mask.kind(sq, sk) == EMPTY:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        qg, kg, vg = _grouped(q, k, v)
        ct = qg.dtype
        g = h // hk
        s, tanh = _scores(qg, kg, scale, softcap, _visible(mask, sq, sk, q.device))
        lse_g = safe_lse(lse.to(ct)).reshape(b, hk, g, sq, 1)
        p = torch.exp(s - lse_g)                                          # (B, Hk, G, Sq, Sk)
        do = dout.to(ct).permute(0, 2, 1, 3).reshape(b, hk, g, sq, d)
        o = out.to(ct).permute(0, 2, 1, 3).reshape(b, hk, g, sq, d)
        delta = (do * o).sum(-1, keepdim=True)                            # rowsum(dO * O): (B, Hk, G, Sq, 1)
        dv = torch.matmul(p.transpose(-1, -2), do).sum(2)                 # (B, Hk, Sk, D), summed over the group
        dp = torch.matmul(do, vg.transpose(-1, -2))
        ds = p * (dp - delta)
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)                                 # d(softcap*tanh(x/softcap))/dx
        dq = torch.matmul(ds, kg) * scale                                 # (B, Hk, G, Sq, D)
        dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale        # (B, Hk, Sk, D)
        dq = dq.reshape(b, h, sq, d).permute(0, 2, 1, 3).to(q.dtype)
        return dq, dk.permute(0, 2, 1, 3).to(k.dtype), dv.permute(0, 2, 1, 3).to(v.dtype)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, cu_seqlens: Optional[torch.Tensor] = None,
                    sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(QK^T) V on whole sequences, flash-attn semantics, in fp32 (fp64 for fp64 inputs); differentiable.

    q (B, S, H, D), k/v (B, S, Hk, D) -> (B, S, H, D) in q's dtype. ``softmax_scale`` None: D ** -0.5.
    ``window_size`` (left, right), -1 = unbounded; ``softcap`` > 0: scores -> softcap * tanh(scores / softcap);
    ``cu_seqlens`` (B must be 1): the documents of a packed row, each attending only to itself. ``sink`` (H,):
    attention sinks, as HF's eager sink attention computes them: one more logit per head (neither scaled nor
    capped) in every row's softmax, whose value is 0. A row that sees no key gives 0.
    """
    b, seq, heads, dim = q.shape
    scale = dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    documents = None
    if cu_seqlens is not None:
        positions = torch.arange(seq, device=q.device)
        documents = torch.searchsorted(cu_seqlens.to(q.device, torch.int64), positions, right=True)
    mask = BlockMask(causal=causal, window=tuple(window_size), q_doc=documents, k_doc=documents)
    qg, kg, vg = _grouped(q, k, v)
    scores, _ = _scores(qg, kg, scale, softcap, _visible(mask, seq, seq, q.device))   # (B, Hk, G, S, S)
    if sink is not None:
        # the sink joins the softmax in the compute dtype, not in scores' (bf16 when an autocast region is active)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        column = sink.to(compute).reshape(1, *scores.shape[1:3], 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.to(compute), column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)            # rows with no key: 0, not NaN
    out = torch.matmul(probs, vg)                                          # (B, Hk, G, S, D)
    return out.reshape(b, heads, seq, dim).permute(0, 2, 1, 3).to(q.dtype)
