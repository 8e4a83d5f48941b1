"""Move varlen tokens between two ways of splitting a packed sequence over the CP group (differentiable).

ring-flash-attn's ``ring_flash_attn_varlen_func`` expects *every document* split evenly over the ranks (rank r
holds the r-th of N equal pieces of each document, documents in order; local ``cu_seqlens`` = global // N).
``ring_kernels.ring_attn_varlen_func`` splits the packed token stream contiguously instead (rank r holds
tokens [r*T/N, (r+1)*T/N)). ``relayout`` converts one into the other: one all-gather forward, one
reduce-scatter backward (the adjoint), so the drop-in function computes exactly the same attention.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

__all__: list = []


def per_document_positions(cu_global: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Global packed positions rank ``rank`` holds in ring-flash-attn's per-document split: LongTensor (T/N,).

    ``cu_global``: CPU int64 (num_docs + 1,), every document length divisible by ``world`` (checked by the caller).
    """
    pieces: List[torch.Tensor] = []
    for d in range(cu_global.numel() - 1):
        start, length = int(cu_global[d]), int(cu_global[d + 1] - cu_global[d])
        share = length // world
        pieces.append(torch.arange(start + rank * share, start + (rank + 1) * share))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def contiguous_positions(total: int, rank: int, world: int) -> torch.Tensor:
    """Global packed positions rank ``rank`` holds in the contiguous split: LongTensor (total / world,)."""
    local = total // world
    return torch.arange(rank * local, (rank + 1) * local)


class _Relayout(torch.autograd.Function):
    """Gather every rank's rows (rank-major), keep the rows this rank needs; backward scatters and sums back."""

    @staticmethod
    def forward(ctx, x, rows, group, world):
        ctx.rows, ctx.group, ctx.world, ctx.local = rows, group, world, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0).index_select(0, rows.to(x.device))

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros((ctx.local * ctx.world,) + tuple(grad.shape[1:]))
        full.index_add_(0, ctx.rows.to(grad.device), grad)
        chunks = [c.contiguous() for c in full.chunk(ctx.world, dim=0)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=ctx.group)
        return out, None, None, None


def relayout(x: torch.Tensor, source: List[torch.Tensor], target: torch.Tensor, group, world: int) -> torch.Tensor:
    """This rank's rows of the global packed tensor in the ``target`` split, from ``x`` in the ``source`` split.

    x: (T_local, ...) this rank's rows in the source split; ``source[r]``: global positions rank r holds there
    (LongTensor (T_local,) each); ``target``: global positions this rank must hold. Returns (T_local, ...).
    """
    total = x.shape[0] * world
    row_of = torch.empty(total, dtype=torch.long)
    row_of[torch.cat(source)] = torch.arange(total)  # global position -> row of the rank-major gather
    return _Relayout.apply(x, row_of[target], group, world)
