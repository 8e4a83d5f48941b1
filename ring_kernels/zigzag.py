"""Zigzag ring attention: causal work balanced across ranks.

The global sequence of length 2*N*c is cut into 2N chunks of c tokens; rank r holds chunks r and 2N-1-r
(local tensors (B, 2c, H, D): chunk r then chunk 2N-1-r). Every rank then has the same causal work per step:

- own K/V (step 0): aligned CAUSAL over the local 2c tokens (positions increase within the local tensor);
- K/V of an earlier rank j < r: all 2c queries see the first chunk (j) in FULL, nothing of chunk 2N-1-j;
- K/V of a later rank j > r: only the second query chunk (2N-1-r) sees anything, and it sees all 2c keys.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from .backends.base import BlockMask
from .engine import ALL, Block, positional_steps, run_batch
from .validation import LayoutCode, RingInputError, require_causal

__all__ = ["zigzag_ring_attn_func", "zigzag_positions", "zigzag_steps"]


def zigzag_positions(rank: int, world: int, seqlen_local: int) -> torch.Tensor:
    """Global positions (seqlen_local,) of the tokens rank ``rank`` holds in the zigzag layout."""
    c = seqlen_local // 2
    return torch.cat([torch.arange(c) + rank * c, torch.arange(c) + (2 * world - 1 - rank) * c])


def zigzag_steps(rank: int, world: int, seqlen: int, causal: bool, window: Tuple[int, int]) -> List[List[Block]]:
    if window != (-1, -1):
        return positional_steps(lambda j: zigzag_positions(j, world, seqlen), rank, world, causal, window)
    half = seqlen // 2
    steps = []
    for step in range(world):
        src = (rank - step) % world
        if src == rank:
            steps.append([Block(ALL, ALL, BlockMask(causal=True))])
        elif src < rank:
            steps.append([Block(ALL, slice(0, half), BlockMask())])
        else:
            steps.append([Block(slice(half, seqlen), ALL, BlockMask())])
    return steps


def zigzag_ring_attn_func(q, k, v, *, group=None, causal=True, softmax_scale=None, backend="auto",
                          window_size=(-1, -1), softcap=0.0, dropout_p=0.0, sink=None):
    """Causal ring attention on the ``"zigzag"`` layout (see the module docstring).

    q: (B, S_local, H, D), k, v: (B, S_local, Hk, D); S_local = 2c must be even. Returns out like q.
    ``causal=False`` raises (use ``ring_attn_func``). ``window_size``, ``softcap``: as flash-attn.
    ``sink``: None, or attention-sink logits (H,) -- any float dtype, on q's device, may require grad: every
    query's softmax gets one extra key per head with this logit and value 0 (gpt-oss's ``s_aux``). Its
    gradient on each rank is the partial sum over that rank's queries; the sum over the group is the whole
    gradient (what the usual gradient all-reduce computes). Every rank passes a sink or none does.
    """
    fn = "zigzag_ring_attn_func"
    require_causal(fn, causal)
    seqlen = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    if seqlen is not None and (seqlen % 2 != 0 or seqlen == 0):
        raise RingInputError(
            f"{fn}: q has seqlen_local={seqlen}; the zigzag layout needs an even, non-zero local length "
            f"(two chunks per rank): make the global length a multiple of 2 * world_size (pad it)",
            argument="q", value=tuple(q.shape))
    return run_batch(fn, q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, backend=backend,
                     window_size=window_size, softcap=softcap, dropout_p=dropout_p, sink=sink,
                     layout_code=LayoutCode.ZIGZAG, make_steps=zigzag_steps)
