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

On CUDA with triton installed, ``merge_block_`` runs one fused kernel (read acc, read block, write acc: the
fp32 accumulator crosses memory once instead of about four times in eager PyTorch); elsewhere, or when
``RING_KERNELS_FUSED_MERGE=0``, it runs the eager version. Both compute the same formula.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

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
    bf16/fp16 (it is promoted inside the multiply-add, never materialised in fp32).
    """
    if out_acc.is_cuda and _use_fused():
        _merge_fused_(out_acc, lse_acc, block_out, block_lse)
    else:
        _merge_eager_(out_acc, lse_acc, block_out, block_lse)


def _merge_eager_(out_acc, lse_acc, block_out, block_lse) -> None:
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


# ------------------------------------------------------------------------------------------ fused (triton)

_FUSED_ENV = "RING_KERNELS_FUSED_MERGE"
_fused_kernel = None
_fused_available: Optional[bool] = None


def _use_fused() -> bool:
    global _fused_available
    if os.environ.get(_FUSED_ENV, "1") == "0":
        return False
    if _fused_available is None:
        try:
            _build_fused_kernel()
            _fused_available = True
        except ImportError:
            _fused_available = False
    return _fused_available


def _build_fused_kernel():
    """Compile-on-first-use Triton kernel; defined lazily so importing ring_kernels never imports triton."""
    global _fused_kernel
    if _fused_kernel is not None:
        return _fused_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_rows(out_ptr, lse_ptr, blk_ptr, blk_lse_ptr,
                    S, H, D,
                    o_sb, o_ss, o_sh, l_sb, l_sh, l_ss, bo_sb, bo_ss, bo_sh, bl_sb, bl_sh, bl_ss,
                    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, N_ROWS):
        # One program merges BLOCK_ROWS rows (b, s, h) of BLOCK_D >= D columns. Head dim is contiguous.
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < N_ROWS
        h = rows % H
        s = (rows // H) % S
        b = rows // (H * S)
        a = tl.load(lse_ptr + b * l_sb + h * l_sh + s * l_ss, mask=row_ok, other=float("-inf"))
        c = tl.load(blk_lse_ptr + b * bl_sb + h * bl_sh + s * bl_ss, mask=row_ok, other=float("-inf"))
        m = tl.maximum(a, c)
        dead = m == float("-inf")                 # no key seen in either: keep out 0, lse -inf, no NaN
        m_safe = tl.where(dead, 0.0, m)
        sum_exp = tl.exp(a - m_safe) + tl.exp(c - m_safe)
        new = tl.where(dead, float("-inf"), m_safe + tl.log(tl.where(dead, 1.0, sum_exp)))
        new_safe = tl.where(dead, 0.0, new)
        wa = tl.exp(a - new_safe)
        wc = tl.exp(c - new_safe)
        cols = tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (cols[None, :] < D)
        o_off = (b * o_sb + s * o_ss + h * o_sh)[:, None] + cols[None, :]
        bo_off = (b * bo_sb + s * bo_ss + h * bo_sh)[:, None] + cols[None, :]
        acc = tl.load(out_ptr + o_off, mask=ok, other=0.0)
        blk = tl.load(blk_ptr + bo_off, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + o_off, acc * wa[:, None] + blk * wc[:, None], mask=ok)
        tl.store(lse_ptr + b * l_sb + h * l_sh + s * l_ss, new, mask=row_ok)

    _fused_kernel = (triton, _merge_rows)
    return _fused_kernel


def _merge_fused_(out_acc, lse_acc, block_out, block_lse) -> None:
    """The fused merge: one pass over (B*S*H) rows; any strides except a contiguous head dim."""
    triton, kernel = _build_fused_kernel()
    if out_acc.stride(-1) != 1 or block_out.stride(-1) != 1:
        return _merge_eager_(out_acc, lse_acc, block_out, block_lse)
    b, s, h, d = out_acc.shape
    n_rows = b * s * h
    block_d = triton.next_power_of_2(d)
    block_rows = max(1, min(64, 4096 // block_d))
    grid = (triton.cdiv(n_rows, block_rows),)
    kernel[grid](out_acc, lse_acc, block_out, block_lse, s, h, d,
                 out_acc.stride(0), out_acc.stride(1), out_acc.stride(2),
                 lse_acc.stride(0), lse_acc.stride(1), lse_acc.stride(2),
                 block_out.stride(0), block_out.stride(1), block_out.stride(2),
                 block_lse.stride(0), block_lse.stride(1), block_lse.stride(2),
                 BLOCK_ROWS=block_rows, BLOCK_D=block_d, N_ROWS=n_rows)
