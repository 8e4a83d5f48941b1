"""Block backend on aten's fused CPU flash-attention kernel and its backward.

``aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=, scale=)`` takes
(B, H, S, D) tensors (strided views of our (B, S, H, D) layout are fine), supports GQA (fewer K/V heads) natively,
returns ``(out, lse)`` with lse (B, H, Sq) fp32, and its ``_backward`` accepts an externally merged out/lse.
FULL and CAUSAL blocks need no mask tensor; GENERAL blocks pass an additive mask of q's dtype (0 / -inf).

Quirk handled here: for a row whose keys are all masked the kernel returns out = 0 but lse = 0 (not -inf),
so the forward sets those rows' lse to -inf; and its backward turns lse = -inf into NaN, so the backward
receives ``safe_lse`` (0 there, where every probability is exp(-inf) = 0 anyway).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..merge import safe_lse
from .base import CAUSAL, EMPTY, FULL, BlockMask

__all__ = ["TorchCpuBackend"]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B, H, S, D) as a view (no copy)."""
    return x.transpose(1, 2)


def _mask_args(mask: BlockMask, kind: str, sq: int, sk: int, dtype, device):
    """(is_causal, additive attn_mask or None, visible-rows (Sq,) bool or None) for the aten call."""
    if kind == FULL:
        return False, None, None
    if kind == CAUSAL:
        return True, None, None
    visible = mask.dense(sq, sk, device)
    additive = torch.zeros(sq, sk, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return False, additive, visible.any(dim=-1)


class TorchCpuBackend:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward): CPU, any mask kind, no softcap."""

    name = "torch_cpu"

    def unsupported_reason(self, *, device, dtype, head_dim, mask_kind, softcap) -> Optional[str]:
        if torch.device(device).type != "cpu":
            return f"runs on CPU only, not {device}"
        if dtype not in _SUPPORTED_DTYPES:
            return f"dtype {dtype} not supported (supported: {_SUPPORTED_DTYPES})"
        if softcap > 0.0:
            return "softcap is not supported by aten's CPU flash kernel (use 'reference')"
        return None

    def forward(self, q, k, v, *, scale: float, mask: BlockMask, softcap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
        b, sq, h, _ = q.shape
        sk = k.shape[1]
        kind = mask.kind(sq, sk)
        if kind == EMPTY:
            return q.new_zeros(q.shape), torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
        is_causal, attn_mask, rows = _mask_args(mask, kind, sq, sk, q.dtype, q.device)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, is_causal, attn_mask=attn_mask, scale=scale)
        if rows is not None and not bool(rows.all()):
            lse = lse.masked_fill(~rows, float("-inf"))
        return out.transpose(1, 2), lse.float()

    def backward(self, dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, softcap: float = 0.0):
        sq, sk = q.shape[1], k.shape[1]
        kind = mask.kind(sq, sk)
        if kind == EMPTY:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        is_causal, attn_mask, _ = _mask_args(mask, kind, sq, sk, q.dtype, q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), safe_lse(lse).float(), 0.0, is_causal,
            attn_mask=attn_mask, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
