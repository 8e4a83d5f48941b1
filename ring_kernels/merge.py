"""Combining partial results of attention: the LSE merge of outputs and the sum of gradients, fp32 math.

A ring computes the attention of this rank's queries against one key/value block at a time. Each block
gives a partial output ``o_b`` (normalised over the block's keys only) and its log-sum-exp ``lse_b``.
Two partial results over disjoint key sets combine exactly:

    lse = log(exp(lse_1) + exp(lse_2))
    o   = o_1 * exp(lse_1 - lse) + o_2 * exp(lse_2 - lse)

Shapes (batch layout; varlen uses B = 1):
    outputs a, b, dst: (B, S, H, D), each fp32, bf16 or fp16      lse: (B, H, S) float32

``merge_(dst, a, lse_a, b, lse_b)`` writes ``dst = merge(a, b)`` and the merged LSE into ``lse_a``, in place;
``dst`` may be ``a`` itself. The arithmetic is fp32 whatever the dtypes, and the result is rounded once, to
``dst``'s dtype: a ring merges straight into its bf16 output when a row receives its last block, and keeps an
fp32 accumulator only for rows with >= 3 blocks (``ring_kernels.rounding``). ``add_(dst, a, b)`` is the same for
gradients: ``dst = a + b`` in fp32, rounded once to ``dst``'s dtype (``torch.add`` would round bf16 + bf16 to
bf16 first when ``dst`` is fp32).

A row that has seen no key yet has ``lse = -inf`` and ``out = 0``; merging two such rows keeps them so,
without NaN (``exp(-inf - -inf)`` is what a naive merge would compute).

Attention sinks: a per-head logit that joins every query's softmax as an extra key of value 0 is one more merge,
of a block whose output is 0: ``fold_sink`` folds it into a finished (out, lse), and ``sink_grad`` is its
gradient; every kernel's backward then runs unchanged on the folded (out, lse).

On CUDA with triton installed, ``merge_`` (and ``add_`` when it widens) runs one fused kernel: read a and b,
write dst, each crossing memory once (eager PyTorch crosses them about four times). Elsewhere, when the
option ``fused_merge`` is off (``ring_kernels.options``), or when the kernel fails to compile (a warning says
why, once), they run the eager version, which computes the same formula.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from .options import get_options
from .torch_releases import triton_unsupported_reason

__all__ = ["merge_", "add_", "safe_lse", "fold_sink", "sink_grad"]

_LOW = (torch.bfloat16, torch.float16)


def merge_(dst: torch.Tensor, a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """``dst = merge(a, b)`` and ``lse_a = logaddexp(lse_a, lse_b)``, fp32 math, one rounding to ``dst.dtype``.

    dst, a, b: (B, S, H, D), any of fp32/bf16/fp16 (views allowed; ``dst`` may be ``a``, never partly overlap
    it, never overlap ``b``); lse_a, lse_b: (B, H, S) fp32.
    """
    if dst.is_cuda and use_fused() and _rows_contiguous(dst, a, b):
        if _launch(merge_into_fused_, dst, a, lse_a, b, lse_b):
            return
    merge_into_eager_(dst, a, lse_a, b, lse_b)


def add_(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``dst = a + b`` computed in fp32 (for fp32/bf16/fp16 operands), rounded once to ``dst.dtype``.

    Shapes (B, S, H, D) alike; ``dst`` may be ``a``, never ``b``. ``torch.add`` already does this unless both
    operands are half precision and ``dst`` is wider (it would round the sum to half precision first): that
    case is one fused pass on CUDA, a copy and an fp32 add elsewhere.
    """
    if not (a.dtype in _LOW and b.dtype in _LOW and dst.dtype == torch.float32):
        torch.add(a, b, out=dst)
        return
    if dst.is_cuda and use_fused() and _rows_contiguous(dst, a, b):
        if _launch(add_fused_, dst, a, b):
            return
    add_eager_(dst, a, b)


def safe_lse(lse: torch.Tensor) -> torch.Tensor:
    """The LSE with -inf (rows that see no key at all) replaced by 0, for backward kernels.

    A backward computes ``p = exp(score - lse)``; for a row with no visible key every score is masked
    (-inf), so ``exp(-inf - 0) = 0`` is the right probability, whereas ``-inf - -inf`` would be NaN.
    """
    return lse.masked_fill(lse == float("-inf"), 0.0)


# ------------------------------------------------------------------------------------------------ sinks

def fold_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Fold an attention sink into a finished result: ``out`` (B, S, H, D) is rescaled in place and the new
    lse (B, H, S) fp32 returned; ``sink`` (H,) is one logit per query head, an extra key of value 0 in every
    query's softmax: lse' = logaddexp(lse, sink), out' = out * exp(lse - lse') (fp32 math; in half precision
    this is out's second rounding). A row that saw no key (lse = -inf) keeps out = 0 and gets lse' = sink."""
    s = sink.detach().to(torch.float32).view(1, -1, 1)
    folded = torch.logaddexp(lse, s)
    weight = torch.exp(lse - folded).transpose(1, 2).unsqueeze(-1)
    if out.dtype == torch.float32:
        out.mul_(weight)
    else:
        out.copy_(out.float() * weight)
    return folded


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """d loss / d sink (H,) in sink's dtype, summed over this rank's queries, from the *folded* out (B, S, H, D)
    and lse (B, H, S): -sum over (b, s) of exp(sink - lse') * rowsum(dout * out'). (The q/k/v gradients need
    nothing else: the usual backward with the folded out and lse' is the backward with the sink.)"""
    s = sink.detach().to(torch.float32).view(1, -1, 1)
    delta = torch.einsum("bshd,bshd->bhs", dout.float(), out.float())
    return (-(torch.exp(s - lse) * delta).sum(dim=(0, 2))).to(sink.dtype)


# ------------------------------------------------------------------------------------------------ eager

def _row_weight(lse: torch.Tensor, new_lse_safe: torch.Tensor) -> torch.Tensor:
    """exp(lse - new_lse) as (B, S, H, 1), ready to broadcast over an output (B, S, H, D)."""
    return torch.exp(lse - new_lse_safe).transpose(1, 2).unsqueeze(-1)


def merge_into_eager_(dst, a, lse_a, b, lse_b) -> None:
    new_lse = torch.logaddexp(lse_a, lse_b)
    # Rows that still see no key: new_lse = -inf. Subtract 0 there instead, so both weights are exp(-inf) = 0.
    new_safe = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    wa, wb = _row_weight(lse_a, new_safe), _row_weight(lse_b, new_safe)
    if dst.dtype == torch.float32 and dst.data_ptr() == a.data_ptr() and dst.stride() == a.stride():
        dst.mul_(wa)                               # in place on an fp32 accumulator: no temporary
        dst.addcmul_(b, wb)
    else:
        merged = a * wa                            # fp32 (the weights are fp32), then one rounding into dst
        merged.addcmul_(b, wb)
        dst.copy_(merged)
    lse_a.copy_(new_lse)


def add_eager_(dst, a, b) -> None:
    dst.copy_(a)                                   # exact: half precision widens to fp32 without rounding
    dst.add_(b)                                    # fp32 + half: computed in fp32, one rounding


# ------------------------------------------------------------------------------------------ fused (triton)

_kernels = None
_fused_available: Optional[bool] = None


def use_fused() -> bool:
    global _fused_available
    if not get_options().fused_merge:
        return False
    if _fused_available is None:
        try:
            _build_fused_kernels()
            _fused_available = True
        except ImportError:
            _fused_available = False
    return _fused_available


def _rows_contiguous(*tensors: torch.Tensor) -> bool:
    """The kernels address rows (b, s, h) by strides and need each row's head dim contiguous."""
    return all(t.dim() == 4 and (t.stride(-1) == 1 or t.shape[-1] == 1) for t in tensors)


def _launch(fused, *args) -> bool:
    """Run a fused kernel; on a compile or launch failure turn the fused path off (warning once) and say so."""
    global _fused_available
    try:
        fused(*args)
        return True
    except Exception as exc:  # noqa: BLE001 - a Triton build/launch failure of any kind: the eager path is exact
        _fused_available = False
        warnings.warn(f"ring_kernels.merge: the fused Triton kernel failed ({type(exc).__name__}: {exc}); "
                      f"using the eager merge from now on (the option fused_merge=False, or "
                      f"RING_KERNELS_FUSED_MERGE=0, skips the attempt)",
                      RuntimeWarning, stacklevel=3)
        return False


def _build_fused_kernels():
    """Compile-on-first-use Triton kernels; defined lazily so importing ring_kernels never imports triton."""
    global _kernels
    if _kernels is not None:
        return _kernels
    if triton_unsupported_reason() is not None:
        raise ImportError(triton_unsupported_reason())
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_rows(dst_ptr, a_ptr, lse_ptr, b_ptr, blse_ptr, S, H, D,
                    d_sb, d_ss, d_sh, a_sb, a_ss, a_sh, l_sb, l_sh, l_ss, b_sb, b_ss, b_sh, bl_sb, bl_sh, bl_ss,
                    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, N_ROWS):
        # One program merges BLOCK_ROWS rows of BLOCK_D >= D columns: reads a and b, writes dst (may be a).
        # Rows are (b, s, h) triples, h fastest; int64 so that offsets of large tensors cannot overflow.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok, b, s, h = rows < N_ROWS, rows // (H * S), (rows // H) % S, rows % H
        la = tl.load(lse_ptr + b * l_sb + h * l_sh + s * l_ss, mask=row_ok, other=float("-inf"))
        lb = tl.load(blse_ptr + b * bl_sb + h * bl_sh + s * bl_ss, mask=row_ok, other=float("-inf"))
        m = tl.maximum(la, lb)
        dead = m == float("-inf")                 # no key seen in either: keep out 0, lse -inf, no NaN
        m_safe = tl.where(dead, 0.0, m)
        sum_exp = tl.exp(la - m_safe) + tl.exp(lb - m_safe)
        new = tl.where(dead, float("-inf"), m_safe + tl.log(tl.where(dead, 1.0, sum_exp)))
        new_safe = tl.where(dead, 0.0, new)
        wa = tl.exp(la - new_safe)
        wb = tl.exp(lb - new_safe)
        cols = tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (cols[None, :] < D)
        x = tl.load(a_ptr + (b * a_sb + s * a_ss + h * a_sh)[:, None] + cols[None, :], mask=ok, other=0.0)
        y = tl.load(b_ptr + (b * b_sb + s * b_ss + h * b_sh)[:, None] + cols[None, :], mask=ok, other=0.0)
        merged = x.to(tl.float32) * wa[:, None] + y.to(tl.float32) * wb[:, None]
        tl.store(dst_ptr + (b * d_sb + s * d_ss + h * d_sh)[:, None] + cols[None, :],
                 merged.to(dst_ptr.dtype.element_ty), mask=ok)
        tl.store(lse_ptr + b * l_sb + h * l_sh + s * l_ss, new, mask=row_ok)

    @triton.jit
    def _add_rows(dst_ptr, a_ptr, b_ptr, S, H, D, d_sb, d_ss, d_sh, a_sb, a_ss, a_sh, b_sb, b_ss, b_sh,
                  BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, N_ROWS):
        # Rows are (b, s, h) triples, h fastest; int64 so that offsets of large tensors cannot overflow.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok, b, s, h = rows < N_ROWS, rows // (H * S), (rows // H) % S, rows % H
        cols = tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (cols[None, :] < D)
        x = tl.load(a_ptr + (b * a_sb + s * a_ss + h * a_sh)[:, None] + cols[None, :], mask=ok, other=0.0)
        y = tl.load(b_ptr + (b * b_sb + s * b_ss + h * b_sh)[:, None] + cols[None, :], mask=ok, other=0.0)
        total = x.to(tl.float32) + y.to(tl.float32)
        tl.store(dst_ptr + (b * d_sb + s * d_ss + h * d_sh)[:, None] + cols[None, :],
                 total.to(dst_ptr.dtype.element_ty), mask=ok)

    _kernels = (triton, _merge_rows, _add_rows)
    return _kernels


def _grid(triton, dst: torch.Tensor) -> Tuple[tuple, dict]:
    """Launch grid and block sizes for (B, S, H, D) rows: ~4096 elements per program."""
    b, s, h, d = dst.shape
    n_rows = b * s * h
    block_d = triton.next_power_of_2(d)
    block_rows = max(1, min(64, 4096 // block_d))
    return (triton.cdiv(n_rows, block_rows),), dict(BLOCK_ROWS=block_rows, BLOCK_D=block_d, N_ROWS=n_rows)


def merge_into_fused_(dst, a, lse_a, b, lse_b) -> None:
    """The fused merge: one pass over (B*S*H) rows; any strides except a contiguous head dim."""
    triton, merge_rows, _ = _build_fused_kernels()
    if dst.numel() == 0:
        return
    grid, sizes = _grid(triton, dst)
    _, s, h, d = dst.shape
    merge_rows[grid](dst, a, lse_a, b, lse_b, s, h, d, *dst.stride()[:3], *a.stride()[:3], *lse_a.stride(),
                     *b.stride()[:3], *lse_b.stride(), **sizes)


def add_fused_(dst, a, b) -> None:
    """The fused widening add: dst (fp32) = a + b (half precision) in one pass."""
    triton, _, add_rows = _build_fused_kernels()
    if dst.numel() == 0:
        return
    grid, sizes = _grid(triton, dst)
    _, s, h, d = dst.shape
    add_rows[grid](dst, a, b, s, h, d, *dst.stride()[:3], *a.stride()[:3], *b.stride()[:3], **sizes)
