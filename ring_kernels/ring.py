"""Ring attention over contiguous shards, and the ring engine the zigzag and stripe layouts share.

Rank r of N holds a contiguous slice of the sequence: q, k, v of shape (B, S, H|Hk, D), global positions
[r*S, (r+1)*S). At step s it computes its queries against the K/V block of rank (r - s) mod N while the next
block is already in flight (``comm.RingExchange``), merging each block's (out, lse) into fp32 accumulators
(``merge``). The backward sends K/V around again and passes fp32 dK/dV accumulators one step behind them, so
that after N steps each rank holds the gradients of its own K/V summed over every rank's queries.

A *layout* only decides which (query rows, key rows, mask) blocks one step computes: ``_Block`` lists below.
Standard (no window) blocks are FULL or aligned CAUSAL, so fast backends never need a dense mask.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List, Tuple

import torch

from . import _validate
from .backends import CAUSAL, FULL, GENERAL, get_backend
from .backends.base import BlockBackend, BlockMask
from .comm import RingExchange, group_rank_and_size
from .merge import merge_block_, new_accumulators, set_block_

__all__ = ["ring_attn_func"]

_ALL = slice(None)


@dataclass(frozen=True)
class _Block:
    """One backend call of a ring step: local query rows x rows of the visiting K/V block, and its mask."""

    q_rows: slice
    kv_rows: slice
    mask: BlockMask


@dataclass
class _RingConfig:
    """Everything one call needs besides the tensors; ``steps[s]`` = blocks of step s (K/V from rank - s)."""

    steps: List[List[_Block]]
    backend: BlockBackend
    scale: float
    softcap: float
    group: object
    rank: int
    world: int


# ----------------------------------------------------------------------------------------------- engine

def _first_block_covers_all(cfg: _RingConfig) -> bool:
    """Whether step 0 starts with a block over every query and key row: it can then initialise the fp32
    accumulators by a copy (no zero fill, no read of zeros)."""
    first = cfg.steps[0] if cfg.steps else []
    return bool(first) and first[0].q_rows == _ALL and first[0].kv_rows == _ALL


def _forward(q, k, v, cfg: _RingConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ring forward: q (B, S, H, D), k/v (B, S, Hk, D) -> out_acc (B, S, H, D) fp32, lse (B, H, S) fp32."""
    if _first_block_covers_all(cfg):
        b, s, h, _ = q.shape
        out_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse_acc = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    else:
        out_acc, lse_acc = new_accumulators(q)
    exchange = RingExchange(cfg.group, tag=0)
    # Two receive buffers alternate (the one just computed on may still be read by the send in flight).
    buffers = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, cfg.world - 1))]
    current = (k, v)
    accumulators_empty = True
    for step, blocks in enumerate(cfg.steps):
        incoming = buffers[step % 2] if step + 1 < cfg.world else None
        if incoming is not None:
            exchange.start(current, incoming)       # next block travels while this one computes
        for block in blocks:
            out, lse = cfg.backend.forward(
                q[:, block.q_rows], current[0][:, block.kv_rows], current[1][:, block.kv_rows],
                scale=cfg.scale, mask=block.mask, softcap=cfg.softcap)
            if accumulators_empty and block.q_rows == _ALL:
                set_block_(out_acc, lse_acc, out, lse)   # a copy instead of a merge into -inf
            else:
                merge_block_(out_acc[:, block.q_rows], lse_acc[:, :, block.q_rows], out, lse)
            accumulators_empty = False
        if incoming is not None:
            exchange.wait()
            current = incoming
    return out_acc, lse_acc


def _backward(dout, q, k, v, out, lse, cfg: _RingConfig):
    """Ring backward from the merged ``out``/``lse``: (dq fp32, dk, dv) shaped like q, k, v (dk/dv in k's dtype
    when they crossed the ring, fp32 in a world of one; the caller casts)."""
    # fp32 accumulators: the first block initialises them by a copy when it covers every row, else zeros.
    dq_fresh = dkv_fresh = _first_block_covers_all(cfg)
    new = torch.empty if dq_fresh else torch.zeros
    dq_acc = new(q.shape, dtype=torch.float32, device=q.device)
    # dK/dV accumulators travel with a one-step lag; [0] starts empty/zero, [1] only ever receives.
    dkv = [(new(k.shape, dtype=torch.float32, device=k.device), new(v.shape, dtype=torch.float32, device=v.device))]
    if cfg.world > 1:
        dkv.append((torch.empty_like(dkv[0][0]), torch.empty_like(dkv[0][1])))
    kv_exchange, dkv_exchange = RingExchange(cfg.group, tag=0), RingExchange(cfg.group, tag=1)
    buffers = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, cfg.world - 1))]
    current = (k, v)
    for step, blocks in enumerate(cfg.steps):
        incoming = buffers[step % 2] if step + 1 < cfg.world else None
        if incoming is not None:
            kv_exchange.start(current, incoming)
        grads = []
        for block in blocks:
            rows = block.q_rows
            dq, dk, dv = cfg.backend.backward(
                dout[:, rows], q[:, rows], current[0][:, block.kv_rows], current[1][:, block.kv_rows],
                out[:, rows], lse[:, :, rows], scale=cfg.scale, mask=block.mask, softcap=cfg.softcap)
            if dq_fresh:
                dq_acc.copy_(dq)
                dq_fresh = False
            else:
                dq_acc[:, rows] += dq
            grads.append((block.kv_rows, dk, dv))
        if dkv_exchange.in_flight:
            dkv_exchange.wait()                      # the previous rank's partial sums for this K/V block
        dk_acc, dv_acc = dkv[step % 2]
        for kv_rows, dk, dv in grads:
            if dkv_fresh:
                dk_acc.copy_(dk)
                dv_acc.copy_(dv)
                dkv_fresh = False
            else:
                dk_acc[:, kv_rows] += dk
                dv_acc[:, kv_rows] += dv
        if step + 1 < cfg.world:
            dkv_exchange.start((dk_acc, dv_acc), dkv[(step + 1) % 2])
        elif cfg.world > 1:
            # The last hop carries finished sums: casting before sending gives the same result as after,
            # with half the bytes (bf16) on the one transfer that nothing overlaps.
            home = (torch.empty_like(k), torch.empty_like(v))
            dkv_exchange.start((dk_acc.to(k.dtype), dv_acc.to(v.dtype)), home)
        if incoming is not None:
            kv_exchange.wait()
            current = incoming
    if cfg.world == 1:
        return dq_acc, dkv[0][0], dkv[0][1]
    dkv_exchange.wait()                              # after N hops our own K/V's gradients came home
    return dq_acc, home[0], home[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: _RingConfig):
        out_acc, lse = _forward(q, k, v, cfg)
        out = out_acc.to(q.dtype)                    # accumulated in fp32, cast once
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# ------------------------------------------------------------------------------------ shared front end

def _mask_kind(causal: bool, window: Tuple[int, int]) -> str:
    if window != (-1, -1):
        return GENERAL
    return CAUSAL if causal else FULL


def _out_of_reach(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: Tuple[int, int]) -> bool:
    """True when no query can see any key, judged from position ranges only (O(S), no dense mask)."""
    q_min, q_max, k_min, k_max = int(q_pos.min()), int(q_pos.max()), int(k_pos.min()), int(k_pos.max())
    left, right = window
    return ((causal and k_min > q_max) or (left >= 0 and k_max < q_min - left)
            or (right >= 0 and k_min > q_max + right))


def _positional_steps(positions: Callable[[int], torch.Tensor], rank: int, world: int, causal: bool,
                      window: Tuple[int, int]) -> List[List[_Block]]:
    """Blocks for any layout given the global positions of each rank's tokens: one masked block per step;
    steps whose keys are out of every query's reach are dropped (the rest may still be EMPTY for the backend).
    Used when a window makes the blocks irregular."""
    q_pos = positions(rank)
    steps = []
    for step in range(world):
        k_pos = positions((rank - step) % world)
        skip = _out_of_reach(q_pos, k_pos, causal, window)
        steps.append([] if skip else [_Block(_ALL, _ALL, BlockMask(causal=causal, q_pos=q_pos, k_pos=k_pos,
                                                                    window=window))])
    return steps


def _positions_to(steps: List[List[_Block]], device: torch.device) -> List[List[_Block]]:
    """Move masks' position tensors to the device of q, where backends build dense masks from them."""
    def moved(mask: BlockMask) -> BlockMask:
        if mask.q_pos is None or mask.q_pos.device == device:
            return mask
        return replace(mask, q_pos=mask.q_pos.to(device), k_pos=mask.k_pos.to(device))
    return [[_Block(b.q_rows, b.kv_rows, moved(b.mask)) for b in blocks] for blocks in steps]


def _run(fn: str, q, k, v, *, group, causal, softmax_scale, backend, window_size, softcap, dropout_p,
         layout_code: int, make_steps: Callable[[int, int, int, bool, Tuple[int, int]], List[List[_Block]]]):
    """Validate, build the per-step blocks for this rank, pick the backend, and run the autograd ring."""
    _validate.check_qkv(fn, q, k, v)
    window = _validate.check_options(fn, window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    scale = _validate.resolve_scale(fn, softmax_scale, q.shape[-1])
    rank, world = group_rank_and_size(group)
    b, s, h, d = q.shape
    if s == 0 or b == 0:
        raise _validate.RingInputError(
            f"{fn}: q has shape {tuple(q.shape)}; batch and seqlen_local must be >= 1 on every rank")
    fields = [("layout", layout_code), ("batch", b), ("seqlen_local", s), ("nheads", h), ("nheads_k", k.shape[2]),
              ("headdim", d), ("dtype", _validate.dtype_code(q.dtype)), ("causal", int(bool(causal))),
              ("softmax_scale", scale), ("softcap", float(softcap)), ("window_left", window[0]),
              ("window_right", window[1])]
    if world > 1:
        _validate.check_ranks_agree(fn, group, fields, q.device)
    chosen = get_backend(backend, device=q.device, dtype=q.dtype, head_dim=d,
                         mask_kind=_mask_kind(causal, window), softcap=float(softcap))
    steps = _positions_to(make_steps(rank, world, s, bool(causal), window), q.device)
    cfg = _RingConfig(steps, chosen, scale, float(softcap), group, rank, world)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), cfg)


# ------------------------------------------------------------------------------------- contiguous ring

def _ring_steps(rank: int, world: int, seqlen: int, causal: bool, window: Tuple[int, int]) -> List[List[_Block]]:
    """Contiguous shards: rank j holds positions [j*S, (j+1)*S). Causal: earlier ranks FULL, own CAUSAL, later none."""
    if window != (-1, -1):
        return _positional_steps(lambda j: torch.arange(seqlen) + j * seqlen, rank, world, causal, window)
    steps = []
    for step in range(world):
        src = (rank - step) % world
        if not causal:
            steps.append([_Block(_ALL, _ALL, BlockMask())])
        elif src == rank:
            steps.append([_Block(_ALL, _ALL, BlockMask(causal=True))])
        elif src < rank:
            steps.append([_Block(_ALL, _ALL, BlockMask())])
        else:
            steps.append([])                      # keys after every query: nothing to compute, only to pass on
    return steps


def ring_attn_func(q, k, v, *, group=None, causal=False, softmax_scale=None, backend="auto",
                   window_size=(-1, -1), softcap=0.0, dropout_p=0.0):
    """Attention over a sequence sharded contiguously across ``group`` (layout ``"contiguous"``).

    q: (B, S_local, H, D); k, v: (B, S_local, Hk, D) with H % Hk == 0; rank r holds global tokens
    [r*S_local, (r+1)*S_local). Returns out (B, S_local, H, D) in q's dtype; differentiable in q, k, v.
    ``window_size`` (left, right) and ``softcap`` follow flash-attn; ``dropout_p`` must be 0.
    Causal work is unbalanced across ranks with this layout; prefer ``zigzag_ring_attn_func`` for causal.
    """
    return _run("ring_attn_func", q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                backend=backend, window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                layout_code=0, make_steps=_ring_steps)
