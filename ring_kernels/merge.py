"""Merging blocks of attention through their log-sum-exp, in fp32, in place.

A ring computes the attention of this rank's queries against one key/value block at a time. Each block
gives a partial output ``o_b`` (normalised over the block's keys only) and its log-sum-exp ``lse_b``.
Two partial results over disjoint key sets combine exactly:

    lse = log(exp(lse_1) + exp(lse_2))
    o   = o_1 * exp(lse_1 - lse) + o_2 * exp(lse_2 - lse)

Shapes (batch layout; varlen uses B = 1):
    out_acc: (B, S, H, D) float32        lse_acc: (B, H, S) float32
    block_out: (B, S, H, D) any dtype    block_lse: (B, H, S) float32

A row that has seen no key yet has ``lse = -inf`` and ``out = 0``; merging two such rows keeps them so,
without NaN (``exp(-inf - -inf)`` is what a naive merge would compute).
"""
from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["new_accumulators", "set_block_", "merge_block_", "finalize", "safe_lse"]


def new_accumulators(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Empty fp32 accumulators for queries ``q`` (B, S, H, D): ``out_acc`` zeros, ``lse_acc`` (B, H, S) = -inf."""
    b, s, h, d = q.shape
    out_acc = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    return out_acc, lse_acc


def set_block_(out_acc: torch.Tensor, lse_acc: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """First block of a row set: copy instead of merging (cheaper; same result as merging into empty)."""
    out_acc.copy_(block_out)
    lse_acc.copy_(block_lse)


def _row_weight(lse: torch.Tensor, new_lse_safe: torch.Tensor) -> torch.Tensor:
    """exp(lse - new_lse) as (B, S, H, 1), ready to broadcast over an output (B, S, H, D)."""
    return torch.exp(lse - new_lse_safe).transpose(1, 2).unsqueeze(-1)


def merge_block_(out_acc: torch.Tensor, lse_acc: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block into the accumulators, in place (both may be views, e.g. half of the rows).

    ``out_acc`` (B, S, H, D) fp32 and ``lse_acc`` (B, H, S) fp32 are updated; ``block_out`` (B, S, H, D) may be
    bf16/fp16 (it is promoted inside the fused multiply-add, never materialised in fp32).
    """
    new_lse = torch.logaddexp(lse_acc, block_lse)
    # Rows that still see no key: new_lse = -inf. Subtract 0 there instead, so both weights are exp(-inf) = 0.
    new_safe = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    out_acc.mul_(_row_weight(lse_acc, new_safe))
    out_acc.addcmul_(block_out, _row_weight(block_lse, new_safe))
    lse_acc.copy_(new_lse)


def finalize(out_acc: torch.Tensor, lse_acc: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cast the accumulated output once to ``dtype``; the LSE stays fp32 (it is saved for the backward)."""
    return out_acc.to(dtype), lse_acc


def safe_lse(lse: torch.Tensor) -> torch.Tensor:
    """The LSE with -inf (rows that see no key at all) replaced by 0, for backward kernels.

    A backward computes ``p = exp(score - lse)``; for a row with no visible key every score is masked
    (-inf), so ``exp(-inf - 0) = 0`` is the right probability, whereas ``-inf - -inf`` would be NaN.
    """
    return lse.masked_fill(lse == float("-inf"), 0.0)
