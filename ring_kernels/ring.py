"""Ring attention over contiguous shards (layout ``"contiguous"``), on the ring engine (``engine``).

Rank r of N holds a contiguous slice of the sequence: q, k, v of shape (B, S, H|Hk, D), global positions
[r*S, (r+1)*S). Causally, the K/V of earlier ranks are FULL blocks, our own is one aligned CAUSAL block, and
later ranks' K/V are out of every query's reach (a step with no block: the K/V only pass through). Causal
work is therefore unbalanced across ranks; ``zigzag`` and ``stripe`` balance it.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from .backends.base import BlockMask
from .engine import ALL, Block, positional_steps, run_batch
from .validation import LayoutCode

__all__ = ["ring_attn_func", "ring_steps"]


def ring_steps(rank: int, world: int, seqlen: int, causal: bool, window: Tuple[int, int]) -> List[List[Block]]:
    """Contiguous shards: rank j holds positions [j*S, (j+1)*S). Causal: earlier ranks FULL, own CAUSAL, later none."""
    if window != (-1, -1):
        return positional_steps(lambda j: torch.arange(seqlen) + j * seqlen, rank, world, causal, window)
    steps = []
    for step in range(world):
        src = (rank - step) % world
        if not causal:
            steps.append([Block(ALL, ALL, BlockMask())])
        elif src == rank:
            steps.append([Block(ALL, ALL, BlockMask(causal=True))])
        elif src < rank:
            steps.append([Block(ALL, ALL, BlockMask())])
        else:
            steps.append([])                      # keys after every query: nothing to compute, only to pass on
    return steps


def ring_attn_func(q, k, v, *, group=None, causal=False, softmax_scale=None, backend="auto",
                   window_size=(-1, -1), softcap=0.0, dropout_p=0.0, sink=None):
    """Attention over a sequence sharded contiguously across ``group`` (layout ``"contiguous"``).

    q: (B, S_local, H, D); k, v: (B, S_local, Hk, D) with H % Hk == 0; rank r holds global tokens
    [r*S_local, (r+1)*S_local). Returns out (B, S_local, H, D) in q's dtype; differentiable in q, k, v.
    ``window_size`` (left, right) and ``softcap`` follow flash-attn; ``dropout_p`` must be 0.
    Causal work is unbalanced across ranks with this layout; prefer ``zigzag_ring_attn_func`` for causal.
    ``sink``: None, or attention-sink logits (H,) -- any float dtype, on q's device, may require grad: every
    query's softmax gets one extra key per head with this logit and value 0 (gpt-oss's ``s_aux``). Its
    gradient on each rank is the partial sum over that rank's queries; the sum over the group is the whole
    gradient (what the usual gradient all-reduce computes). Every rank passes a sink or none does.
    """
    return run_batch("ring_attn_func", q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                     backend=backend, window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                     sink=sink, layout_code=LayoutCode.RING, make_steps=ring_steps)
