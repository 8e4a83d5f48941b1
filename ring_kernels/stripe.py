"""Stripe attention: token t lives on rank t mod N (the ``"stripe"`` layout), balancing causal work.

Rank r holds global positions r, r+N, r+2N, ...: local index i is position i*N + r. Against the K/V of rank j
(local index m at position m*N + j), query i sees key m when m*N + j <= i*N + r:

- j <= r: m <= i, an aligned CAUSAL block;
- j > r:  m <= i - 1, i.e. query rows 1.. against key rows ..S-2 form an aligned CAUSAL block (row 0 sees none).
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from .backends.base import BlockMask
from .engine import ALL, Block, positional_steps, run_batch
from .validation import LayoutCode, require_causal

__all__ = ["stripe_attn_func", "stripe_positions", "stripe_steps"]


def stripe_positions(rank: int, world: int, seqlen_local: int) -> torch.Tensor:
    """Global positions (seqlen_local,) of the tokens rank ``rank`` holds in the stripe layout."""
    return torch.arange(seqlen_local) * world + rank


def stripe_steps(rank: int, world: int, seqlen: int, causal: bool, window: Tuple[int, int]) -> List[List[Block]]:
    if window != (-1, -1):
        return positional_steps(lambda j: stripe_positions(j, world, seqlen), rank, world, causal, window)
    steps = []
    for step in range(world):
        src = (rank - step) % world
        if src <= rank:
            steps.append([Block(ALL, ALL, BlockMask(causal=True))])
        elif seqlen > 1:
            steps.append([Block(slice(1, seqlen), slice(0, seqlen - 1), BlockMask(causal=True))])
        else:
            steps.append([])
    return steps


def stripe_attn_func(q, k, v, *, group=None, causal=True, softmax_scale=None, backend="auto",
                     window_size=(-1, -1), softcap=0.0, dropout_p=0.0, sink=None):
    """Causal ring attention on the ``"stripe"`` layout (see the module docstring).

    q: (B, S_local, H, D), k, v: (B, S_local, Hk, D). Returns out like q. ``causal=False`` raises
    (use ``ring_attn_func``). ``window_size``, ``softcap``: as flash-attn.
    ``sink``: None, or attention-sink logits (H,) -- any float dtype, on q's device, may require grad: every
    query's softmax gets one extra key per head with this logit and value 0 (gpt-oss's ``s_aux``). Its
    gradient on each rank is the partial sum over that rank's queries; the sum over the group is the whole
    gradient (what the usual gradient all-reduce computes). Every rank passes a sink or none does.
    """
    fn = "stripe_attn_func"
    require_causal(fn, causal)
    return run_batch(fn, q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, backend=backend,
                     window_size=window_size, softcap=softcap, dropout_p=dropout_p, sink=sink,
                     layout_code=LayoutCode.STRIPE, make_steps=stripe_steps)
