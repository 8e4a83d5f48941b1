"""Block backend on our own Triton flash-attention kernels: forward with LSE, backward from a merged out/LSE.

Layout is flash-attn's and no copy of q/k/v is made when their last dimension is contiguous:
    q:    (B, Sq, H,  D)        any strides with stride(-1) == 1
    k, v: (B, Sk, Hk, D)        H % Hk == 0; query head h reads K/V head h // (H // Hk) (GQA, never repeated)
    out:  (B, Sq, H,  D)        q's dtype
    lse:  (B, H,  Sq)           float32, natural log; -inf for a row that sees no key (out 0 there)

Kernels (all private, compile-time parameters in upper case):
    _attn_fwd       grid (Sq blocks, B*H):   online softmax in base 2 (scores pre-scaled by log2(e)), so the
                                             inner loop needs exp2 only; causal masking only on diagonal blocks.
    _attn_bwd_delta grid (Sq blocks, B*H):   delta = rowsum(dout * out) (fp32), the softmax-backward term.
    _attn_bwd_dkdv  grid (Sk blocks, B*Hk):  dK/dV of one key block, looping over the G query heads of its
                                             group and over query blocks: deterministic (no atomics) and
                                             already summed over the group.
    _attn_bwd_dq    grid (Sq blocks, B*H):   dQ of one query block, looping over key blocks.

Mask kinds: FULL, CAUSAL (aligned: q and k cover the same positions, Sq == Sk) and EMPTY (no kernel runs).
Softcap (score -> c * tanh(score / c), flash-attn semantics) is applied in the kernels, forward and backward.
On CUDA the launch configurations are autotuned per (bucket of Sq, bucket of Sk, head dim, causal), buckets being
powers of two (``tune_bucket``: packed documents of many lengths share a few tunings); under Triton's
interpreter (``TRITON_INTERPRET=1``, set before triton is imported) the kernels run on CPU tensors with small
fixed blocks.
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import Dict, Optional, Tuple

import torch

from ..torch_releases import triton_unsupported_reason

# The registry imports this module lazily and reports the backend as absent when it cannot be imported.
if triton_unsupported_reason() is not None:
    raise ImportError(f"ring_kernels.backends.triton_attn: {triton_unsupported_reason()}")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .base import CAUSAL, EMPTY, FULL, BlockMask  # noqa: E402

__all__ = ["TritonBackend"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256)  # tl.dot needs >= 16 and power-of-two block shapes
# Read once, like triton itself does when it decorates the kernels below.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------- helpers
@triton.jit
def _tanh(x):
    # tanh through exp2 (tl.math has no tanh on every triton 3.x); saturates to +-1 without inf/inf.
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2.885... = 2 * log2(e)


@triton.jit
def _scores_log2(qk, cap_in, score_scale2, SOFTCAP: tl.constexpr):
    """Raw q.k (fp32) -> (scores in base 2, tanh term for the softcap backward (or a dummy 0))."""
    if SOFTCAP:
        t = _tanh(qk * cap_in)                  # cap_in = scale / c
        return t * score_scale2, t              # score_scale2 = c * log2(e)
    else:
        return qk * score_scale2, 0.0           # score_scale2 = scale * log2(e)


# ----------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, Sk,
               cap_in, score_scale2,
               BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_KEYS: tl.constexpr,
               SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax over key blocks [lo, hi): acc (BM, D) fp32, l_i/m_i (BM,) fp32 (base-2 max)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kt_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None]          # K^T block (D, BN)
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]           # V block (BN, D)
        if MASK_KEYS:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < Sk, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        # Every row sees at least one key of the first block it visits (see _attn_fwd), so m_new is finite.
        if SOFTCAP or MASK_CAUSAL or MASK_KEYS:
            s, _t = _scores_log2(qk, cap_in, score_scale2, SOFTCAP)
            if MASK_CAUSAL:
                s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
            if MASK_KEYS:
                s = tl.where(offs_n[None, :] < Sk, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # The hot path: max of the raw scores, then one fused multiply-add per score (scale > 0).
            m_new = tl.maximum(m_i, tl.max(qk, 1) * score_scale2)
            p = tl.math.exp2(qk * score_scale2 - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK_KEYS:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < Sk, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.heuristics({"EVEN_N": lambda a: a["Sk"] % a["BLOCK_N"] == 0})
@triton.jit
def _attn_fwd(Q, K, V, Out, Lse,
              stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
              H, GROUP, Sq, Sk, cap_in, score_scale2, tune_sq, tune_sk,
              HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """One (query block, batch*head): out (BM, D) and lse (BM,). Needs BLOCK_M % BLOCK_N == 0 when causal.

    EVEN_N (Sk % BLOCK_N == 0, set by the heuristic) drops the ragged-tail loop from the compiled kernel.
    tune_sq/tune_sk are unused here: they are the autotuner's key (``tune_bucket`` of Sq and Sk).
    """
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.cdiv(Sq, BLOCK_M) - 1 - pid_m  # heaviest (last) query blocks first: a shorter tail
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=offs_m[:, None] < Sq, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if IS_CAUSAL:
        # Keys left of the diagonal block are visible to every row: no mask. Then the diagonal block(s).
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                                   0, start_m, Sk, cap_in, score_scale2,
                                   BLOCK_N, False, False, SOFTCAP, DOT_PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                                   start_m, tl.minimum(start_m + BLOCK_M, Sk), Sk, cap_in, score_scale2,
                                   BLOCK_N, True, True, SOFTCAP, DOT_PRECISION)
    else:
        n_full = (Sk // BLOCK_N) * BLOCK_N  # whole key blocks, then at most one ragged block
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                                   0, n_full, Sk, cap_in, score_scale2,
                                   BLOCK_N, False, False, SOFTCAP, DOT_PRECISION)
        if not EVEN_N:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                                       n_full, Sk, Sk, cap_in, score_scale2,
                                       BLOCK_N, False, True, SOFTCAP, DOT_PRECISION)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]                                    # rows that saw nothing: acc = 0 -> 0
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < Sq)
    tl.store(Lse + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < Sq)


# ---------------------------------------------------------------------------------------------- backward
@triton.jit
def _attn_bwd_delta(Out, DO, Delta,
                    stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                    H, Sq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, m] = sum_d dout * out (fp32); Delta is a contiguous (B, H, Sq) buffer."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < Sq
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                mask=rows, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :],
                 mask=rows, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + pid_bh.to(tl.int64) * Sq + offs_m, delta, mask=offs_m < Sq)


@triton.jit
def _load_lse2(Lse_row, offs, n, stride_ls, MASK: tl.constexpr):
    """LSE of rows ``offs`` in base 2; rows out of range or with lse = -inf get +inf, so p = exp2(s - lse) = 0."""
    if MASK:
        lse = tl.load(Lse_row + offs * stride_ls, mask=offs < n, other=float("inf"))
    else:
        lse = tl.load(Lse_row + offs * stride_ls)
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos, stride_ls,
                offs_n, offs_d, lo, hi, Sq, cap_in, score_scale2,
                BLOCK_M: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_ROWS: tl.constexpr,
                SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Accumulate dK (unscaled) and dV (BN, D) over query blocks [lo, hi), in the transposed (key-major) form."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        qt_ptrs = q_base + offs_m[None, :] * stride_qs + offs_d[:, None]          # Q^T (D, BM)
        do_ptrs = do_base + offs_m[:, None] * stride_dos + offs_d[None, :]        # dO (BM, D)
        if MASK_ROWS:
            qt = tl.load(qt_ptrs, mask=offs_m[None, :] < Sq, other=0.0)
            do = tl.load(do_ptrs, mask=offs_m[:, None] < Sq, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < Sq, other=0.0)
        else:
            qt = tl.load(qt_ptrs)
            do = tl.load(do_ptrs)
            delta = tl.load(delta_base + offs_m)
        lse2 = _load_lse2(lse_base, offs_m, Sq, stride_ls, MASK_ROWS)
        st, tt = _scores_log2(tl.dot(k, qt, input_precision=DOT_PRECISION), cap_in, score_scale2, SOFTCAP)
        pt = tl.math.exp2(st - lse2[None, :])                                     # P^T (BN, BM)
        if MASK_CAUSAL:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        if MASK_ROWS:
            pt = tl.where(offs_m[None, :] < Sq, pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)             # (dO V^T)^T (BN, BM)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.heuristics({"EVEN_M": lambda a: a["Sq"] % a["BLOCK_M"] == 0})
@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                   stride_lb, stride_lh, stride_ls, stride_dkb, stride_dks, stride_dkh,
                   stride_dvb, stride_dvs, stride_dvh,
                   H, HK, GROUP, Sq, Sk, scale, cap_in, score_scale2, tune_sq, tune_sk,
                   HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   EVEN_M: tl.constexpr):
    """dK, dV of one (key block, batch*kv-head), summed over the GROUP query heads that read it.

    Needs BLOCK_N % BLOCK_M == 0 when causal (the diagonal is whole query blocks). EVEN_M (Sq % BLOCK_M == 0)
    drops the ragged-tail loop: fewer live registers in a kernel that holds dK and dV in them.
    """
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    b = (pid_bhk // HK).to(tl.int64)
    hk = pid_bhk % HK
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_rows = offs_n[:, None] < Sk
    k = tl.load(K + b * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=kv_rows, other=0.0)
    v = tl.load(V + b * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                mask=kv_rows, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    m_full = (Sq // BLOCK_M) * BLOCK_M  # whole query blocks end here; a ragged one may follow
    for g in range(0, GROUP):
        h = (hk * GROUP + g).to(tl.int64)
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_base = Lse + b * stride_lb + h * stride_lh
        delta_base = Delta + (b * H + h) * Sq
        if IS_CAUSAL:
            # Diagonal query blocks (masked), then the ones below it (all visible), then a ragged tail.
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos,
                                 stride_ls, offs_n, offs_d, start_n, tl.minimum(start_n + BLOCK_N, Sq), Sq,
                                 cap_in, score_scale2, BLOCK_M, True, True, SOFTCAP, DOT_PRECISION)
            lo = start_n + BLOCK_N
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos,
                                 stride_ls, offs_n, offs_d, lo, m_full, Sq,
                                 cap_in, score_scale2, BLOCK_M, False, False, SOFTCAP, DOT_PRECISION)
            if not EVEN_M:
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos,
                                     stride_ls, offs_n, offs_d, tl.maximum(lo, m_full), Sq, Sq,
                                     cap_in, score_scale2, BLOCK_M, False, True, SOFTCAP, DOT_PRECISION)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos,
                                 stride_ls, offs_n, offs_d, 0, m_full, Sq,
                                 cap_in, score_scale2, BLOCK_M, False, False, SOFTCAP, DOT_PRECISION)
            if not EVEN_M:
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos,
                                     stride_ls, offs_n, offs_d, m_full, Sq, Sq,
                                     cap_in, score_scale2, BLOCK_M, False, True, SOFTCAP, DOT_PRECISION)
    dk = dk * scale
    tl.store(DK + b * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_rows)
    tl.store(DV + b * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_rows)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, lo, hi, Sk,
              cap_in, score_scale2,
              BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, MASK_KEYS: tl.constexpr,
              SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Accumulate dQ (unscaled, (BM, D) fp32) over key blocks [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kt_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None]          # K^T (D, BN)
        vt_ptrs = v_base + offs_n[None, :] * stride_vn + offs_d[:, None]          # V^T (D, BN)
        if MASK_KEYS:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < Sk, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_n[None, :] < Sk, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        s, t = _scores_log2(tl.dot(q, kt, input_precision=DOT_PRECISION), cap_in, score_scale2, SOFTCAP)
        p = tl.math.exp2(s - lse2[:, None])
        if MASK_CAUSAL:
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        if MASK_KEYS:
            p = tl.where(offs_n[None, :] < Sk, p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
    return dq


@triton.heuristics({"EVEN_N": lambda a: a["Sk"] % a["BLOCK_N"] == 0})
@triton.jit
def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ,
                 stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                 stride_lb, stride_lh, stride_ls, stride_dqb, stride_dqs, stride_dqh,
                 H, GROUP, Sq, Sk, scale, cap_in, score_scale2, tune_sq, tune_sk,
                 HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """dQ of one (query block, batch*head). Needs BLOCK_M % BLOCK_N == 0 when causal; EVEN_N as in _attn_fwd."""
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.cdiv(Sq, BLOCK_M) - 1 - pid_m  # heaviest (last) query blocks first: a shorter tail
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < Sq
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=rows, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
                 mask=rows, other=0.0)
    lse2 = _load_lse2(Lse + b * stride_lb + h * stride_lh, offs_m, Sq, stride_ls, True)
    delta = tl.load(Delta + (b * H + h) * Sq + offs_m, mask=offs_m < Sq, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if IS_CAUSAL:
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                       0, start_m, Sk, cap_in, score_scale2, BLOCK_N, False, False, SOFTCAP, DOT_PRECISION)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                       start_m, tl.minimum(start_m + BLOCK_M, Sk), Sk, cap_in, score_scale2,
                       BLOCK_N, True, True, SOFTCAP, DOT_PRECISION)
    else:
        n_full = (Sk // BLOCK_N) * BLOCK_N
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                       0, n_full, Sk, cap_in, score_scale2, BLOCK_N, False, False, SOFTCAP, DOT_PRECISION)
        if not EVEN_N:
            dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
                           n_full, Sk, Sk, cap_in, score_scale2, BLOCK_N, False, True, SOFTCAP, DOT_PRECISION)
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=rows)


# ------------------------------------------------------------------------------------ launch configurations
def _cfg(block_m: int, block_n: int, warps: int, stages: int) -> "triton.Config":
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# Small lists aimed at Hopper (H100/H200), checked by compiling for sm_90 ahead of time (registers, spills,
# shared memory at D=128, bf16): 128-row tiles need 8 warps to keep the fp32 accumulators in registers;
# 64-row tiles with 4 warps and fewer stages are the fallback that fits D=256. A config that does not fit
# a shape fails to compile and the autotuner skips it.
_FWD_CONFIGS = [
    _cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4), _cfg(128, 128, 8, 2),
    _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 2),
]
# dK/dV: the key tile BLOCK_N stays resident (K, V in shared memory, dK, dV in registers: 128 registers per
# thread at BLOCK_N=128 and 8 warps), so the streamed query tile BLOCK_M is small (BLOCK_N % BLOCK_M == 0).
_DKDV_CONFIGS = [
    _cfg(32, 128, 8, 3), _cfg(16, 128, 8, 3), _cfg(32, 128, 8, 2), _cfg(64, 128, 8, 2), _cfg(32, 64, 4, 2),
]
# dQ: query tile BLOCK_M (with dQ in registers), key tile BLOCK_N streams by (BLOCK_M % BLOCK_N == 0).
_DQ_CONFIGS = [
    _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 2), _cfg(128, 32, 8, 3), _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 2),
]
# The autotuner's key: bucketed lengths, not Sq and Sk themselves. Packed documents of many lengths would each
# tune (compile and time every configuration: seconds per new length); lengths in one bucket share the chosen
# configuration instead. Results do not depend on it: a configuration only picks tile sizes, and the kernels
# mask ragged tails whatever the tile (EVEN_* are still decided per launch from the exact lengths).
TUNE_KEY = ["tune_sq", "tune_sk", "HEAD_DIM", "IS_CAUSAL"]
_TUNE_MIN = 16       # the smallest tile: shorter lengths all run one tile; a multiple of 16 keeps one
                     # integer specialisation of tune_sq/tune_sk (no extra compile per bucket)
_TUNE_CAP = 16384    # past this the best tiles are the largest ones whatever the length


def tune_bucket(length: int) -> int:
    """Autotune key of a sequence length: the next power of two, clamped to [16, 16384] (1..16 -> 16,
    17..32 -> 32, ..., > 8192 -> 16384)."""
    return min(_TUNE_CAP, max(_TUNE_MIN, triton.next_power_of_2(max(int(length), 1))))


attn_fwd_tuned = triton.autotune(configs=_FWD_CONFIGS, key=TUNE_KEY)(_attn_fwd)
attn_bwd_dkdv_tuned = triton.autotune(configs=_DKDV_CONFIGS, key=TUNE_KEY)(_attn_bwd_dkdv)
attn_bwd_dq_tuned = triton.autotune(configs=_DQ_CONFIGS, key=TUNE_KEY)(_attn_bwd_dq)

# Fixed (BLOCK_M, BLOCK_N) per kernel instead of autotuning: always under the interpreter (no GPU timer, and
# small blocks keep it fast), and on GPU when a test pins them with ``set_fixed_blocks`` to exercise edges.
_INTERPRETER_BLOCKS = {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16), "delta": (16, 0)}
fixed_blocks: Optional[Dict[str, Tuple[int, int]]] = dict(_INTERPRETER_BLOCKS) if INTERPRET else None


def set_fixed_blocks(blocks: Optional[Dict[str, Tuple[int, int]]]) -> None:
    """Pin (BLOCK_M, BLOCK_N) per kernel ("fwd", "dkdv", "dq", "delta"), or None to autotune (CUDA only).

    Causal needs fwd/dq BLOCK_M % BLOCK_N == 0 and dkdv BLOCK_N % BLOCK_M == 0; every block >= 16.
    """
    global fixed_blocks
    if blocks is None and INTERPRET:
        blocks = dict(_INTERPRETER_BLOCKS)
    if blocks is not None:
        blocks = {**_INTERPRETER_BLOCKS, **blocks}
        for name, (bm, bn) in blocks.items():
            assert bm >= 16 and (name == "delta" or bn >= 16), f"{name} blocks {bm}x{bn} below 16"
    fixed_blocks = blocks


def _launch(tuned, plain, name: str, grid_rows: int, grid_cols: int, args: tuple, meta: dict) -> None:
    """Launch ``tuned`` (autotuned) or ``plain`` with the pinned blocks; grid = (cdiv(rows, block), cols)."""
    if fixed_blocks is None:
        block_key = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
        tuned[lambda m: (triton.cdiv(grid_rows, m[block_key]), grid_cols)](*args, **meta)
        return
    bm, bn = fixed_blocks[name]
    if meta["IS_CAUSAL"]:  # the diagonal must be whole inner blocks (see the kernels' docstrings)
        assert (bn % bm == 0) if name == "dkdv" else (bm % bn == 0), f"causal {name} blocks {bm}x{bn}"
    rows_block = bn if name == "dkdv" else bm
    plain[(triton.cdiv(grid_rows, rows_block), grid_cols)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn,
                                                          num_warps=4, num_stages=2)


# ---------------------------------------------------------------------------------------------- host side
def _strides3(x: torch.Tensor) -> Tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, S, H, D) tensor whose last dimension is contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels address D as contiguous (vectorised loads); any other stride pattern is used as is.
    return x if x.stride(-1) == 1 else x.contiguous()


def _score_params(scale: float, softcap: float) -> Tuple[float, float]:
    """(cap_in, score_scale2): score_log2 = qk * score_scale2, or tanh(qk * cap_in) * score_scale2 with softcap."""
    if softcap > 0.0:
        return scale / softcap, softcap * _LOG2E
    return 0.0, scale * _LOG2E


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed exactly (not tf32): whoever asks for fp32 attention wants fp32 accuracy.
    return "ieee" if dtype == torch.float32 else "tf32"


class TritonBackend:
    """Our Triton flash-attention kernels: FULL/CAUSAL/EMPTY blocks, GQA, softcap, fp16/bf16/fp32, D in 16..256."""

    name = "triton"

    def unsupported_reason(self, *, device, dtype, head_dim, mask_kind, softcap) -> Optional[str]:
        if dtype not in _SUPPORTED_DTYPES:
            return f"dtype {dtype} not supported (supported: {_SUPPORTED_DTYPES})"
        if head_dim not in _HEAD_DIMS:
            return f"head_dim {head_dim} not supported (supported: powers of two {_HEAD_DIMS})"
        if mask_kind not in (FULL, CAUSAL, EMPTY):
            return (f"mask kind {mask_kind!r} not supported: only full, aligned causal and empty blocks "
                    f"(no windows, documents or offset causal); use 'reference' or a torch backend")
        if softcap < 0.0:
            return f"softcap must be >= 0 (0 = off), got {softcap}"
        device = torch.device(device)
        if device.type != "cuda" and not (INTERPRET and device.type == "cpu"):
            return (f"runs on CUDA devices (or on CPU under TRITON_INTERPRET=1 set before importing triton), "
                    f"not {device}")
        return None

    # ------------------------------------------------------------------------------------------ checks
    def _check_inputs(self, q, k, v, scale, mask, softcap) -> None:
        """Types, shapes, dtypes and devices of the block's inputs (before asking what is supported)."""
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"triton backend: {name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 4:
                raise ValueError(f"triton backend: {name} must be (batch, seqlen, heads, head_dim), "
                                 f"got shape {tuple(x.shape)}")
        if not isinstance(mask, BlockMask):
            raise TypeError(f"triton backend: mask must be a BlockMask, got {type(mask).__name__}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise TypeError(f"triton backend: scale must be a finite float, got {scale!r}")
        if scale <= 0:  # the forward takes the row maximum of unscaled scores: a positive scale keeps it the max
            raise ValueError(f"triton backend: scale must be > 0 (usually 1/sqrt(head_dim)), got {scale!r}")
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap):
            raise TypeError(f"triton backend: softcap must be a finite float (0 = off), got {softcap!r}")
        b, sq, h, d = q.shape
        if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
            raise ValueError(f"triton backend: k and v must be (batch={b}, seqlen_k, kv_heads, head_dim={d}) "
                             f"like q {tuple(q.shape)}; got k {tuple(k.shape)}, v {tuple(v.shape)}")
        if k.shape[2] == 0 or h % k.shape[2] != 0:
            raise ValueError(f"triton backend: q heads ({h}) must be a multiple of k/v heads ({k.shape[2]}) "
                             f"for grouped-query attention")
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"triton backend: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"triton backend: q, k, v must be on one device, got {q.device}, {k.device}, "
                             f"{v.device}")

    def _check_supported(self, q, k, mask, softcap) -> str:
        """Raise if this backend cannot compute the block; return its mask kind (FULL, CAUSAL or EMPTY)."""
        kind = mask.kind(q.shape[1], k.shape[1])
        reason = self.unsupported_reason(device=q.device, dtype=q.dtype, head_dim=q.shape[3], mask_kind=kind,
                                         softcap=float(softcap))
        if reason is not None:
            raise ValueError(f"triton backend cannot compute this block: {reason}")
        return kind

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, q, k, v, *, scale: float, mask: BlockMask, softcap: float = 0.0
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, Sq, H, D) in q's dtype, lse (B, H, Sq) fp32)`` of one block."""
        self._check_inputs(q, k, v, scale, mask, softcap)
        kind = self._check_supported(q, k, mask, softcap)
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        if kind == EMPTY or b * h == 0:
            return (torch.zeros((b, sq, h, d), dtype=q.dtype, device=q.device),
                    torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device))
        out = torch.empty((b, sq, h, d), dtype=q.dtype, device=q.device)   # every row is written
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        cap_in, score_scale2 = _score_params(float(scale), float(softcap))
        args = (q, k, v, out, lse, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out),
                lse.stride(0), lse.stride(1), h, h // hk, sq, sk, cap_in, score_scale2,
                tune_bucket(sq), tune_bucket(sk))
        meta = dict(HEAD_DIM=d, IS_CAUSAL=kind == CAUSAL, SOFTCAP=softcap > 0.0,
                    DOT_PRECISION=_dot_precision(q.dtype))
        with torch.cuda.device(q.device) if q.is_cuda else nullcontext():
            _launch(attn_fwd_tuned, _attn_fwd, "fwd", sq, b * h, args, meta)
        return out, lse

    # ----------------------------------------------------------------------------------------- backward
    def backward(self, dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, softcap: float = 0.0
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of one block from the merged ``out`` (B, Sq, H, D) and ``lse`` (B, H, Sq) fp32."""
        self._check_inputs(q, k, v, scale, mask, softcap)
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        for name, x in (("dout", dout), ("out", out)):
            if not isinstance(x, torch.Tensor) or x.shape != q.shape or x.device != q.device:
                raise ValueError(f"triton backend: {name} must be a tensor shaped like q {tuple(q.shape)} on "
                                 f"{q.device}, got {getattr(x, 'shape', type(x).__name__)}")
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (b, h, sq) or lse.dtype != torch.float32:
            raise ValueError(f"triton backend: lse must be a float32 tensor of shape (batch, heads, seqlen_q) = "
                             f"{(b, h, sq)}, got {getattr(lse, 'dtype', None)} {getattr(lse, 'shape', None)}")
        kind = self._check_supported(q, k, mask, softcap)
        alloc = torch.zeros if kind == EMPTY or b * h == 0 else torch.empty   # the kernels write every row
        dq = alloc((b, sq, h, d), dtype=q.dtype, device=q.device)
        dk = alloc((b, sk, hk, d), dtype=k.dtype, device=k.device)
        dv = alloc((b, sk, hk, d), dtype=v.dtype, device=v.device)
        if kind == EMPTY or b * h == 0:
            return dq, dk, dv
        if dout.dtype != q.dtype:  # dout feeds tensor-core dots with q/k/v: one dtype (out is read in fp32)
            dout = dout.to(q.dtype)
        q, k, v, dout, out = (_last_dim_contiguous(x) for x in (q, k, v, dout, out))
        cap_in, score_scale2 = _score_params(float(scale), float(softcap))
        meta = dict(HEAD_DIM=d, IS_CAUSAL=kind == CAUSAL, SOFTCAP=softcap > 0.0,
                    DOT_PRECISION=_dot_precision(q.dtype))
        delta = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        tune = (tune_bucket(sq), tune_bucket(sk))
        with torch.cuda.device(q.device) if q.is_cuda else nullcontext():
            block_delta = (fixed_blocks or {}).get("delta", (64, 0))[0]
            _attn_bwd_delta[(triton.cdiv(sq, block_delta), b * h)](
                out, dout, delta, *_strides3(out), *_strides3(dout), h, sq, HEAD_DIM=d, BLOCK_M=block_delta)
            common = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *lse.stride())
            _launch(attn_bwd_dkdv_tuned, _attn_bwd_dkdv, "dkdv", sk, b * hk,
                    (q, k, v, dout, lse, delta, dk, dv, *common, *_strides3(dk), *_strides3(dv),
                     h, hk, h // hk, sq, sk, float(scale), cap_in, score_scale2, *tune), meta)
            _launch(attn_bwd_dq_tuned, _attn_bwd_dq, "dq", sq, b * h,
                    (q, k, v, dout, lse, delta, dq, *common, *_strides3(dq),
                     h, h // hk, sq, sk, float(scale), cap_in, score_scale2, *tune), meta)
        return dq, dk, dv

