"""Llama3-style context parallelism for packed documents: all-gather K/V in head slices, local queries.

Layout ``"contiguous"``: rank r holds packed tokens [r*L, (r+1)*L) of the global sequence described by
``cu_seqlens``. Instead of a ring, each rank all-gathers the K/V of the whole sequence, ``heads_k_stride``
K/V heads at a time (bounding the memory of the gathered copy), and computes its queries of the matching
query heads against them. The next head slice's all-gather is in flight while the current one computes.
The backward gathers K/V again, computes dK/dV of the whole sequence for the slice in fp32, and
reduce-scatters them back to their owners (again overlapped with the next slice).

Blocks, per document d overlapping our tokens [qa, qb): causally, keys [start(d), qa) are FULL and keys
[qa, qb) are aligned CAUSAL; non-causally all keys of d are FULL; a window classifies them like the ring
(``varlen._classify``). No dense (S x S) mask for the standard cases.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _validate
from .backends import EMPTY, FULL, get_backend
from .backends.base import BlockBackend
from .merge import merge_block_, new_accumulators
from .ring import _Block
from .varlen import _classify, _documents_overlapping, _StepBuilder, _VarlenCall

__all__ = ["llama3_attn_varlen_func"]

# torch 2.13 renamed the tensor collectives (the old names warn); same arguments, older torch has only the old.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _llama3_blocks(cu: torch.Tensor, rank: int, local: int, causal: bool,
                   window: Tuple[int, int]) -> Tuple[List[_Block], str]:
    """Blocks of our queries (rows of the local tensor) against the gathered K/V (rows = global positions)."""
    builder = _StepBuilder()
    blocks: List[_Block] = []
    q0 = rank * local
    for d in _documents_overlapping(cu, q0, q0 + local):
        doc_a, doc_b = int(cu[d]), int(cu[d + 1])
        qa, qb = max(doc_a, q0), min(doc_b, q0 + local)
        # Causal: split at qa so that both parts are standard blocks (FULL before, aligned CAUSAL after).
        key_ranges = [(doc_a, qa), (qa, qb)] if causal else [(doc_a, doc_b)]
        for ka, kb in key_ranges:
            if ka < kb:
                kind, mask = _classify(qa, qb, ka, kb, causal, window)
                builder.add(blocks, kind, mask, slice(qa - q0, qb - q0), slice(ka, kb))
    return blocks, builder.kind


class _Llama3Config:
    def __init__(self, blocks, backend: BlockBackend, scale, softcap, group, world, heads_k_stride):
        self.blocks, self.backend, self.scale, self.softcap = blocks, backend, scale, softcap
        self.group, self.world, self.stride = group, world, heads_k_stride


class _SliceGather:
    """All-gathers of K/V head slices into two alternating buffers, one in flight while the other is used.

    k, v: (L, Hk, D) local; a gathered slice is (N*L, stride, D) in global token order.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cfg: _Llama3Config):
        self.k, self.v, self.cfg = k, v, cfg
        n_bufs = min(2, k.shape[1] // cfg.stride)
        shape = (k.shape[0] * cfg.world, cfg.stride, k.shape[2])
        self.buffers = [(k.new_empty(shape), v.new_empty(shape)) for _ in range(n_bufs)] if cfg.world > 1 else []
        self.pending = {}

    def start(self, j: int) -> None:
        if self.cfg.world == 1:
            return
        heads = slice(j * self.cfg.stride, (j + 1) * self.cfg.stride)
        kbuf, vbuf = self.buffers[j % len(self.buffers)]
        # The tensor all-gather concatenates along dim 0 = the global token order of the contiguous layout.
        self.pending[j] = [
            _all_gather_tensor(kbuf, self.k[:, heads].contiguous(), group=self.cfg.group, async_op=True),
            _all_gather_tensor(vbuf, self.v[:, heads].contiguous(), group=self.cfg.group, async_op=True),
        ]

    def get(self, j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Wait for slice j; gathered (N*L, stride, D) K and V."""
        if self.cfg.world == 1:
            heads = slice(j * self.cfg.stride, (j + 1) * self.cfg.stride)
            return self.k[:, heads], self.v[:, heads]
        for work in self.pending.pop(j):
            work.wait()
        return self.buffers[j % len(self.buffers)]


def _forward(q, k, v, cfg: _Llama3Config):
    """q (L, H, D), k/v (L, Hk, D) -> out_acc (1, L, H, D) fp32, lse (1, H, L) fp32."""
    q4 = q.unsqueeze(0)
    out_acc, lse_acc = new_accumulators(q4)
    slices = k.shape[1] // cfg.stride
    group_size = q.shape[1] // k.shape[1]
    gather = _SliceGather(k, v, cfg)
    gather.start(0)
    for j in range(slices):
        k_all, v_all = gather.get(j)
        if j + 1 < slices:
            gather.start(j + 1)                       # the next slice travels while this one computes
        hq = slice(j * cfg.stride * group_size, (j + 1) * cfg.stride * group_size)
        for blk in cfg.blocks:
            out, lse = cfg.backend.forward(
                q4[:, blk.q_rows, hq], k_all[blk.kv_rows].unsqueeze(0), v_all[blk.kv_rows].unsqueeze(0),
                scale=cfg.scale, mask=blk.mask, softcap=cfg.softcap)
            merge_block_(out_acc[:, blk.q_rows, hq], lse_acc[:, hq, blk.q_rows], out, lse)
    return out_acc, lse_acc


class _SliceReduceScatter:
    """Reduce-scatters of full-sequence fp32 dK/dV slices back to their owners, one in flight per buffer."""

    def __init__(self, k: torch.Tensor, cfg: _Llama3Config):
        self.cfg = cfg
        self.dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        self.dv = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        n_bufs = min(2, k.shape[1] // cfg.stride)
        full = (k.shape[0] * cfg.world, cfg.stride, k.shape[2])
        part = (k.shape[0], cfg.stride, k.shape[2])
        new = lambda shape: torch.empty(shape, dtype=torch.float32, device=k.device)  # noqa: E731
        self.full = [(new(full), new(full)) for _ in range(n_bufs)]
        self.part = [(new(part), new(part)) for _ in range(n_bufs)] if cfg.world > 1 else []
        self.pending = {}

    def buffers(self, j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zeroed full-sequence accumulators for slice j (waiting for the slice that used them before)."""
        slot = j % len(self.full)
        if j - len(self.full) in self.pending:
            self._finish(j - len(self.full))
        dk_all, dv_all = self.full[slot]
        dk_all.zero_()
        dv_all.zero_()
        return dk_all, dv_all

    def start(self, j: int) -> None:
        slot = j % len(self.full)
        if self.cfg.world == 1:
            self._store(j, *self.full[slot])
            return
        (dk_all, dv_all), (dk_part, dv_part) = self.full[slot], self.part[slot]
        self.pending[j] = [
            _reduce_scatter_tensor(dk_part, dk_all, group=self.cfg.group, async_op=True),
            _reduce_scatter_tensor(dv_part, dv_all, group=self.cfg.group, async_op=True),
        ]

    def _finish(self, j: int) -> None:
        for work in self.pending.pop(j):
            work.wait()
        self._store(j, *self.part[j % len(self.part)])

    def _store(self, j: int, dk_part: torch.Tensor, dv_part: torch.Tensor) -> None:
        heads = slice(j * self.cfg.stride, (j + 1) * self.cfg.stride)
        self.dk[:, heads] = dk_part
        self.dv[:, heads] = dv_part

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        for j in sorted(self.pending):
            self._finish(j)
        return self.dk, self.dv


def _backward(dout, q, k, v, out, lse, cfg: _Llama3Config):
    """Gradients (fp32) dq (L, H, D), dk, dv (L, Hk, D) from the merged out (L, H, D) and lse (1, H, L)."""
    q4, dout4, out4 = q.unsqueeze(0), dout.unsqueeze(0), out.unsqueeze(0)
    dq_acc = torch.zeros(q4.shape, dtype=torch.float32, device=q.device)
    slices = k.shape[1] // cfg.stride
    group_size = q.shape[1] // k.shape[1]
    gather = _SliceGather(k, v, cfg)
    scatter = _SliceReduceScatter(k, cfg)
    gather.start(0)
    for j in range(slices):
        k_all, v_all = gather.get(j)
        if j + 1 < slices:
            gather.start(j + 1)
        dk_all, dv_all = scatter.buffers(j)
        hq = slice(j * cfg.stride * group_size, (j + 1) * cfg.stride * group_size)
        for blk in cfg.blocks:
            rows = blk.q_rows
            dq, dk, dv = cfg.backend.backward(
                dout4[:, rows, hq], q4[:, rows, hq], k_all[blk.kv_rows].unsqueeze(0),
                v_all[blk.kv_rows].unsqueeze(0), out4[:, rows, hq], lse[:, hq, rows],
                scale=cfg.scale, mask=blk.mask, softcap=cfg.softcap)
            dq_acc[:, rows, hq] += dq
            dk_all[blk.kv_rows] += dk.squeeze(0)
            dv_all[blk.kv_rows] += dv.squeeze(0)
        scatter.start(j)                              # back to the owners while the next slice computes
    dk, dv = scatter.result()
    return dq_acc.squeeze(0), dk, dv


class _Llama3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: _Llama3Config):
        out_acc, lse = _forward(q, k, v, cfg)
        out = out_acc.squeeze(0).to(q.dtype)          # accumulated in fp32, cast once
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _check_stride(fn: str, heads_k_stride, nheads_k: int) -> int:
    if heads_k_stride is None:
        return nheads_k
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int):
        raise TypeError(f"{fn}: heads_k_stride must be an int or None, got {type(heads_k_stride).__name__}")
    if heads_k_stride < 1 or nheads_k % heads_k_stride != 0:
        divisors = [s for s in range(1, nheads_k + 1) if nheads_k % s == 0]
        raise _validate.RingInputError(
            f"{fn}: heads_k_stride={heads_k_stride} must divide nheads_k={nheads_k} (K/V heads are gathered "
            f"heads_k_stride at a time); use one of {divisors}, or None to gather all K/V heads at once")
    return heads_k_stride


def llama3_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=False, softmax_scale=None,
                            backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0,
                            heads_k_stride: Optional[int] = None):
    """Attention over packed documents sharded contiguously, by all-gathering K/V (Llama 3 style).

    q: (T_local, H, D); k, v: (T_local, Hk, D), H % Hk == 0; rank r holds packed tokens [r*T_local,
    (r+1)*T_local) of the global sequence described by ``cu_seqlens`` (int32 (num_docs + 1,), identical on
    every rank). ``heads_k_stride`` K/V heads are gathered at a time (None = all; it must divide Hk): peak
    extra memory is 2 x 2 x (N*T_local, heads_k_stride, D). Returns out (T_local, H, D); differentiable.
    """
    fn = "llama3_attn_varlen_func"
    stride = _check_stride(fn, heads_k_stride, k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 3 else 1)
    call = _VarlenCall(fn, q, k, v, cu_seqlens, group=group, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, dropout_p=dropout_p, layout_code=12,
                       extra_fields=[("heads_k_stride", stride)])
    blocks, kind = _llama3_blocks(call.cu, call.rank, call.local, call.causal, call.window)
    chosen = get_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                         mask_kind=FULL if kind == EMPTY else kind, softcap=call.softcap)
    cfg = _Llama3Config(blocks, chosen, call.scale, call.softcap, group, call.world, stride)
    return _Llama3Attention.apply(q.contiguous(), k.contiguous(), v.contiguous(), cfg)
