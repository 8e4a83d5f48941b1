"""Llama3-style context parallelism for packed documents: all-gather K/V in head slices, local queries.

Layout ``"contiguous"``: rank r holds packed tokens [r*L, (r+1)*L) of the global sequence described by
``cu_seqlens``. Instead of a ring, each rank all-gathers the K/V of the whole sequence, ``heads_k_stride``
K/V heads at a time (bounding the memory of the gathered copy: 2 buffers x (N*L, stride, D) for K and V),
and computes its queries of the matching query heads against them.

Blocks, per document d overlapping our tokens [qa, qb): causally, keys [start(d), qa) are FULL and keys
[qa, qb) are aligned CAUSAL; non-causally all keys of d are FULL; a window classifies them like the ring
(``varlen._classify``), so there is no dense (S x S) mask in the standard cases. Key ranges are also cut at
our own token range: *local* blocks (keys this rank holds) need no gathered copy and run while the
all-gather is in flight; only *remote* blocks (documents that cross a rank boundary) wait for it.

Backward, per head slice: half of the local blocks while the K/V all-gather is in flight, then the remote
blocks into fp32 full-sequence dK/dV, whose reduce-scatter back to the owners overlaps the other half.

Rounding (``ring``'s rule): out and dq are written in q's dtype, each row rounded once: a row with one block
(most rows: only documents that cross a rank boundary have remote blocks) gets a copy of it, a second block
merges (adds) into it with fp32 math, and only rows with >= 3 blocks use an fp32 accumulator. dK/dV stay fp32
(summed over ranks by the reduce-scatter) and are cast once at the end.

Varlen fast path (CUDA, ``backends.torch_cuda_varlen``): the local blocks are aligned squares, one per local
document, tiling our rows in order, so all of them are ONE call of torch's packed-document flash op per head
slice (``cu_seqlens`` = our local document boundaries, for q and k alike) instead of one call per document;
the backward splits them at a document boundary into two such calls around the remote blocks. Only the
(at most two) documents that cross a rank boundary still have per-block remote calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _validate
from .backends import EMPTY, FULL, get_backend
from .backends.base import CAUSAL, BlockBackend, BlockMask
from .backends.torch_cuda_varlen import VarlenKernel, VarlenSegments, segments_from_rows, varlen_kernel_for
from .ring import _RowPlan, _fold_grads, _fold_outputs, _plan_rows
from .varlen import _classify, _documents_overlapping, _StepBuilder, _VarlenCall

__all__ = ["llama3_attn_varlen_func"]

# torch 2.13 renamed the tensor collectives (the old names warn); same arguments, older torch has only the old.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class _Llama3Block:
    """One backend call: local query rows x key rows, of the local K/V (``local``) or of the gathered sequence.

    ``first``: the first block over these query rows (local blocks run first, and every query row has one: its
    own position is always visible); the engine's rounding plan (``ring._plan_rows``) derives the same from the
    blocks' rows, and more: which rows get a second or a third contribution.
    """

    q_rows: slice
    kv_rows: slice
    mask: BlockMask
    local: bool
    first: bool


@dataclass
class _Llama3Plan:
    """This rank's blocks (local ones run while the K/V all-gather is in flight) and whether to gather (N > 1)."""

    local_blocks: List[_Llama3Block]
    remote_blocks: List[_Llama3Block]
    kind: str
    gather: bool


def _split_at(ka: int, kb: int, cuts: Tuple[int, int]) -> List[Tuple[int, int]]:
    """[ka, kb) cut at the positions ``cuts`` (our own token range's ends), empty pieces dropped."""
    points = [ka] + [c for c in cuts if ka < c < kb] + [kb]
    return [(a, b) for a, b in zip(points, points[1:]) if a < b]


def _llama3_plan(cu: torch.Tensor, rank: int, world: int, local: int, causal: bool,
                 window: Tuple[int, int]) -> _Llama3Plan:
    """Blocks of our queries (local rows) per document overlapping our tokens [q0, q0 + L)."""
    builder = _StepBuilder()
    q0, q1 = rank * local, (rank + 1) * local
    pieces: List[Tuple[slice, int, int, BlockMask]] = []
    for d in _documents_overlapping(cu, q0, q1):
        doc_a, doc_b = int(cu[d]), int(cu[d + 1])
        qa, qb = max(doc_a, q0), min(doc_b, q0 + local)
        # Causal: split at qa so that both parts are standard blocks (FULL before, aligned CAUSAL after);
        # then cut at our own range so that local keys need no gathered copy.
        key_ranges = [(doc_a, qa), (qa, qb)] if causal else [(doc_a, doc_b)]
        for ka, kb in (piece for kr in key_ranges for piece in _split_at(*kr, (q0, q1))):
            kind, mask = _classify(qa, qb, ka, kb, causal, window)
            if builder.keep(kind):
                pieces.append((slice(qa - q0, qb - q0), ka, kb, mask))
    local_blocks, remote_blocks, seen = [], [], set()
    for is_local in (True, False):            # execution order: local blocks, then remote ones
        for rows, ka, kb, mask in pieces:
            if (q0 <= ka and kb <= q1) != is_local:
                continue
            first = (rows.start, rows.stop) not in seen
            seen.add((rows.start, rows.stop))
            kv_rows = slice(ka - q0, kb - q0) if is_local else slice(ka, kb)
            (local_blocks if is_local else remote_blocks).append(_Llama3Block(rows, kv_rows, mask, is_local, first))
    # Every rank joins the collectives whenever there are other ranks (even if its own blocks are all local:
    # another rank may need its K/V); local blocks hide them.
    return _Llama3Plan(local_blocks, remote_blocks, builder.kind, world > 1)


@dataclass(frozen=True)
class _VarlenLocal:
    """The local blocks as packed-document calls of ``kernel``: ``whole`` (forward), ``before``/``after``
    (backward, split at a document boundary around the remote blocks; either may be None when empty)."""

    kernel: VarlenKernel
    whole: VarlenSegments
    before: Optional[VarlenSegments]
    after: Optional[VarlenSegments]


def _local_segments(blocks: List[_Llama3Block], device) -> Optional[VarlenSegments]:
    """One varlen call for ``blocks`` when they are aligned squares of one kind (all CAUSAL or all FULL) that
    follow each other without gaps; else None (kept as per-block calls)."""
    # A 1 x 1 block is FULL and CAUSAL at once (its mask says FULL): it does not decide the kind.
    kinds = {b.mask.kind(b.q_rows.stop - b.q_rows.start, b.kv_rows.stop - b.kv_rows.start) for b in blocks
             if b.q_rows.stop - b.q_rows.start > 1} or {FULL}
    if len(kinds) != 1 or any(b.q_rows != b.kv_rows or not b.local for b in blocks):
        return None
    # An aligned square is the same for bottom-right and top-left causal alignment.
    return segments_from_rows([b.q_rows for b in blocks], [b.kv_rows for b in blocks], kinds == {CAUSAL}, device)


def _varlen_local(plan: _Llama3Plan, kernel: Optional[VarlenKernel], local: int,
                  device) -> Optional[_VarlenLocal]:
    """The varlen fast path for ``plan``'s local blocks, or None (no kernel, or blocks it cannot batch).

    The forward initialises the accumulators with this call, so its documents must cover all ``local`` rows.
    """
    if kernel is None or not plan.local_blocks:
        return None
    whole = _local_segments(plan.local_blocks, device)
    if whole is None or (whole.q_rows.start, whole.q_rows.stop) != (0, local):
        return None
    before, after = _halves(plan.local_blocks) if plan.gather else (plan.local_blocks, [])
    split = [_local_segments(part, device) if part else None for part in (before, after)]
    if any(part and seg is None for part, seg in zip((before, after), split)):
        return None
    return _VarlenLocal(kernel, whole, split[0], split[1])


class _Llama3Config:
    def __init__(self, plan: _Llama3Plan, backend: BlockBackend, scale, softcap, group, world, heads_k_stride,
                 fast: Optional[_VarlenLocal] = None):
        self.plan, self.backend, self.scale, self.softcap = plan, backend, scale, softcap
        self.group, self.world, self.stride = group, world, heads_k_stride
        self.fast = fast


class _SliceGather:
    """All-gathers of K/V head slices into two alternating buffers, one in flight while the other is used.

    k, v: (1, L, Hk, D) local; a gathered slice is (1, N*L, stride, D) in global token order (the collective
    writes its (N*L, stride, D) storage: gloo gathers along dim 0). Every started slice must be taken with
    ``get`` (which waits for it) before the slice two later reuses its buffer.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cfg: _Llama3Config):
        self.k, self.v, self.cfg = k, v, cfg
        n_bufs = min(2, k.shape[2] // cfg.stride)
        shape = (k.shape[1] * cfg.world, cfg.stride, k.shape[3])
        self.buffers = [(k.new_empty(shape), v.new_empty(shape)) for _ in range(n_bufs)]
        self.blocks = [(kb.unsqueeze(0), vb.unsqueeze(0)) for kb, vb in self.buffers]   # the same, as (1, T, .)
        self.pending = {}   # j -> (works, the inputs they read): both live until ``get(j)`` has waited

    def start(self, j: int) -> None:
        heads = slice(j * self.cfg.stride, (j + 1) * self.cfg.stride)
        assert j - len(self.buffers) not in self.pending, f"K/V slice {j}: its buffer is still being gathered"
        kbuf, vbuf = self.buffers[j % len(self.buffers)]
        # The (L, stride, D) copies are held with the works, not left to the backend to keep alive, until waited.
        inputs = (self.k[0, :, heads].contiguous(), self.v[0, :, heads].contiguous())
        # The tensor all-gather concatenates along dim 0 = the global token order of the contiguous layout.
        works = [_all_gather_tensor(buf, part, group=self.cfg.group, async_op=True)
                 for buf, part in zip((kbuf, vbuf), inputs)]
        self.pending[j] = (works, inputs)

    def get(self, j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Wait for slice j; gathered (1, N*L, stride, D) K and V."""
        works, _inputs = self.pending.pop(j)
        for work in works:
            work.wait()
        return self.blocks[j % len(self.blocks)]


def _heads(j: int, cfg: _Llama3Config, group_size: int) -> Tuple[slice, slice]:
    """(K/V heads, query heads) of head slice j."""
    return (slice(j * cfg.stride, (j + 1) * cfg.stride),
            slice(j * cfg.stride * group_size, (j + 1) * cfg.stride * group_size))


def _rows_plan(ranges: List[slice], local: int) -> _RowPlan:
    """The rounding plan (``ring._plan_rows``) of contributions over ``local`` query rows, in call order."""
    return _plan_rows([(r.start, r.stop) for r in ranges], local)


class _Result:
    """Out (1, L, H, D) in q's dtype and lse (1, H, L) fp32 filled head slice by head slice, each row rounded
    once (``ring``'s rule): rows with one block get a copy, two blocks merge into out, >= 3 use ``acc`` (fp32)."""

    def __init__(self, q4: torch.Tensor, plan: _RowPlan):
        self.plan = plan
        self.out = torch.empty(q4.shape, dtype=q4.dtype, device=q4.device)
        self.lse = torch.empty((1, q4.shape[2], q4.shape[1]), dtype=torch.float32, device=q4.device)
        for rows in plan.untouched:                       # rows that see no key: out 0, lse -inf
            self.out[:, rows] = 0
            self.lse[:, :, rows] = float("-inf")
        wide = plan.accumulates and q4.dtype != torch.float32
        self.acc = torch.empty(q4.shape, dtype=torch.float32, device=q4.device) if wide else self.out

    def fold(self, index: int, hq: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Contribution ``index`` of head slice ``hq``: out (1, Sb, h, D), lse (1, h, Sb)."""
        _fold_outputs(self.plan.parts[index], out, lse, self.out[:, :, hq], self.lse[:, hq], self.acc[:, :, hq])


def _forward_blocks(blocks, first: int, q4, k_rows, v_rows, hq, result: _Result, cfg: _Llama3Config) -> None:
    """Forward of ``blocks`` (contributions ``first``, ``first`` + 1, ...) for query heads ``hq`` against K/V
    rows (1, T, stride, D)."""
    for i, blk in enumerate(blocks):
        out, lse = cfg.backend.forward(
            q4[:, blk.q_rows, hq], k_rows[:, blk.kv_rows], v_rows[:, blk.kv_rows],
            scale=cfg.scale, mask=blk.mask, softcap=cfg.softcap)
        result.fold(first + i, hq, out, lse)


def _forward_local(q4, k4, v4, hk, hq, result: _Result, cfg: _Llama3Config) -> int:
    """The local blocks of head slice (hk, hq): one varlen call on the fast path, else one call per block.
    Returns how many contributions they were."""
    if cfg.fast is None:
        _forward_blocks(cfg.plan.local_blocks, 0, q4, k4[:, :, hk], v4[:, :, hk], hq, result, cfg)
        return len(cfg.plan.local_blocks)
    seg = cfg.fast.whole                              # covers every local row
    out, lse = cfg.fast.kernel.forward(q4[0, seg.q_rows, hq], k4[0, seg.k_rows, hk], v4[0, seg.k_rows, hk], seg,
                                       scale=cfg.scale)
    result.fold(0, hq, out.unsqueeze(0), lse.unsqueeze(0))
    return 1


def _forward_ranges(cfg: _Llama3Config) -> List[slice]:
    """Query rows of the forward's contributions in call order: the local call(s), then the remote blocks."""
    local = [cfg.fast.whole.q_rows] if cfg.fast is not None else [b.q_rows for b in cfg.plan.local_blocks]
    return local + ([b.q_rows for b in cfg.plan.remote_blocks] if cfg.plan.gather else [])


def _forward(q4, k4, v4, cfg: _Llama3Config):
    """q4 (1, L, H, D), k4/v4 (1, L, Hk, D) -> out (1, L, H, D) in q's dtype, lse (1, H, L) fp32."""
    plan = cfg.plan
    result = _Result(q4, _rows_plan(_forward_ranges(cfg), q4.shape[1]))
    slices, group_size = k4.shape[2] // cfg.stride, q4.shape[2] // k4.shape[2]
    gather = _SliceGather(k4, v4, cfg) if plan.gather else None
    if gather:
        gather.start(0)
    for j in range(slices):
        if gather and j + 1 < slices:
            gather.start(j + 1)                       # the next slice travels while this one computes
        hk, hq = _heads(j, cfg, group_size)
        done = _forward_local(q4, k4, v4, hk, hq, result, cfg)
        if gather:
            k_all, v_all = gather.get(j)              # in flight while the local blocks computed
            _forward_blocks(plan.remote_blocks, done, q4, k_all, v_all, hq, result, cfg)
    return result.out, result.lse


class _SliceReduceScatter:
    """Reduce-scatters of full-sequence fp32 dK/dV slices back to their owners, one in flight per buffer.

    The scattered parts are added into ``dk``/``dv`` (1, L, Hk, D) fp32, which already hold the local blocks' part.
    A slot's full-sequence buffer is zeroed again, and its part read, only after its reduce-scatter was waited
    for (``_finish``); ``finish_all`` must run before ``dk``/``dv`` are read.
    """

    def __init__(self, dk: torch.Tensor, dv: torch.Tensor, cfg: _Llama3Config):
        self.cfg, self.dk, self.dv = cfg, dk, dv
        n_bufs = min(2, dk.shape[2] // cfg.stride)
        full = (dk.shape[1] * cfg.world, cfg.stride, dk.shape[3])
        part = (dk.shape[1], cfg.stride, dk.shape[3])
        new = lambda shape: torch.empty(shape, dtype=torch.float32, device=dk.device)  # noqa: E731
        self.full = [(new(full), new(full)) for _ in range(n_bufs)]
        self.part = [(new(part), new(part)) for _ in range(n_bufs)]
        self.pending = {}   # j -> (works, the buffers they read and write): held until ``_finish(j)`` has waited

    def buffers(self, j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zeroed full-sequence accumulators (1, N*L, stride, D) for slice j (waiting for the slice that used
        them before)."""
        if j - len(self.full) in self.pending:
            self._finish(j - len(self.full))
        dk_all, dv_all = self.full[j % len(self.full)]
        dk_all.zero_()
        dv_all.zero_()
        return dk_all.unsqueeze(0), dv_all.unsqueeze(0)

    def start(self, j: int) -> None:
        slot = j % len(self.full)
        assert j - len(self.full) not in self.pending, f"dK/dV slice {j}: its buffers are still in flight"
        (dk_all, dv_all), (dk_part, dv_part) = self.full[slot], self.part[slot]
        works = [_reduce_scatter_tensor(dk_part, dk_all, group=self.cfg.group, async_op=True),
                 _reduce_scatter_tensor(dv_part, dv_all, group=self.cfg.group, async_op=True)]
        self.pending[j] = (works, (dk_all, dv_all, dk_part, dv_part))

    def _finish(self, j: int) -> None:
        works, _buffers = self.pending.pop(j)
        for work in works:
            work.wait()
        heads = slice(j * self.cfg.stride, (j + 1) * self.cfg.stride)
        dk_part, dv_part = self.part[j % len(self.part)]
        self.dk[0, :, heads] += dk_part
        self.dv[0, :, heads] += dv_part

    def finish_all(self) -> None:
        for j in sorted(self.pending):
            self._finish(j)
        assert not self.pending


class _QueryGrads:
    """dq (1, L, H, D) in q's dtype, filled head slice by head slice with ring's rounding rule."""

    def __init__(self, q4: torch.Tensor, plan: _RowPlan):
        self.plan = plan
        self.dq = torch.zeros_like(q4) if plan.untouched else torch.empty_like(q4)
        wide = plan.accumulates and q4.dtype != torch.float32
        self.acc = torch.empty(q4.shape, dtype=torch.float32, device=q4.device) if wide else self.dq

    def fold(self, index: int, hq: slice, dq: torch.Tensor) -> None:
        held = self.dq[:, :, hq]
        _fold_grads(self.plan.parts[index], dq, held, held, self.acc[:, :, hq])


def _backward_blocks(blocks, first: int, dout4, q4, out4, lse, k_rows, v_rows, hq, dq: _QueryGrads, dk_acc, dv_acc,
                     cfg) -> int:
    """Backward of ``blocks`` (dq contributions ``first``, ...) against K/V rows (1, T, stride, D): dk/dv into
    accumulators (1, T, stride, D) over the same rows. Returns the next contribution index."""
    for i, blk in enumerate(blocks):
        rows = blk.q_rows
        dq_b, dk, dv = cfg.backend.backward(
            dout4[:, rows, hq], q4[:, rows, hq], k_rows[:, blk.kv_rows], v_rows[:, blk.kv_rows],
            out4[:, rows, hq], lse[:, hq, rows], scale=cfg.scale, mask=blk.mask, softcap=cfg.softcap)
        dq.fold(first + i, hq, dq_b)
        dk_acc[:, blk.kv_rows] += dk
        dv_acc[:, blk.kv_rows] += dv
    return first + len(blocks)


def _backward_segments(seg: Optional[VarlenSegments], first: int, dout4, q4, out4, lse, k4, v4, hk, hq,
                       dq: _QueryGrads, dk_acc, dv_acc, cfg: _Llama3Config) -> int:
    """Backward of one varlen call of local documents (dq contribution ``first``): dk/dv into the local
    accumulators (1, L, Hk, D) at heads ``hk``. Returns the next contribution index."""
    if seg is None:
        return first
    rows, kv = seg.q_rows, seg.k_rows
    dq_b, dk, dv = cfg.fast.kernel.backward(
        dout4[0, rows, hq], q4[0, rows, hq], k4[0, kv, hk], v4[0, kv, hk], out4[0, rows, hq], lse[0, hq, rows],
        seg, scale=cfg.scale)
    dq.fold(first, hq, dq_b.unsqueeze(0))
    dk_acc[0, kv, hk] += dk
    dv_acc[0, kv, hk] += dv
    return first + 1


def _backward_ranges(cfg: _Llama3Config, before, after) -> List[slice]:
    """Query rows of the backward's dq contributions in call order: local (first part), remote, local (rest)."""
    if cfg.fast is None:
        local = ([b.q_rows for b in before], [b.q_rows for b in after])
    else:
        local = tuple([seg.q_rows] if seg is not None else [] for seg in (cfg.fast.before, cfg.fast.after))
    remote = [b.q_rows for b in cfg.plan.remote_blocks] if cfg.plan.gather else []
    return local[0] + remote + local[1]


def _halves(blocks: List[_Llama3Block]) -> Tuple[List[_Llama3Block], List[_Llama3Block]]:
    """Split blocks into two parts of about equal work (query rows x key rows)."""
    work = [(b.q_rows.stop - b.q_rows.start) * (b.kv_rows.stop - b.kv_rows.start) for b in blocks]
    total, acc = sum(work), 0
    for i, w in enumerate(work):
        if 2 * (acc + w) > total:
            return blocks[:i], blocks[i:]
        acc += w
    return blocks, []


def _backward(dout4, q4, k4, v4, out4, lse, cfg: _Llama3Config):
    """Gradients dq (1, L, H, D) in q's dtype, dk, dv (1, L, Hk, D) fp32 from the merged out4 (1, L, H, D) and
    lse (1, H, L).

    Per head slice: half of the local blocks while its K/V all-gather is in flight, the remote blocks into
    full-sequence dK/dV, their reduce-scatter started, then the other half of the local blocks meanwhile.
    """
    plan = cfg.plan
    dk_acc = torch.zeros(k4.shape, dtype=torch.float32, device=k4.device)
    dv_acc = torch.zeros(v4.shape, dtype=torch.float32, device=v4.device)
    slices, group_size = k4.shape[2] // cfg.stride, q4.shape[2] // k4.shape[2]
    before, after = _halves(plan.local_blocks) if plan.gather else (plan.local_blocks, [])
    dq = _QueryGrads(q4, _rows_plan(_backward_ranges(cfg, before, after), q4.shape[1]))
    gather = _SliceGather(k4, v4, cfg) if plan.gather else None
    scatter = _SliceReduceScatter(dk_acc, dv_acc, cfg) if plan.gather else None
    if gather:
        gather.start(0)
    for j in range(slices):
        if gather and j + 1 < slices:
            gather.start(j + 1)
        hk, hq = _heads(j, cfg, group_size)
        local_grads = (dout4, q4, out4, lse, k4[:, :, hk], v4[:, :, hk], hq, dq, dk_acc[:, :, hk],
                       dv_acc[:, :, hk], cfg)
        segment_grads = (dout4, q4, out4, lse, k4, v4, hk, hq, dq, dk_acc, dv_acc, cfg)
        if cfg.fast is None:
            done = _backward_blocks(before, 0, *local_grads)
        else:
            done = _backward_segments(cfg.fast.before, 0, *segment_grads)
        if gather:
            k_all, v_all = gather.get(j)
            dk_all, dv_all = scatter.buffers(j)
            done = _backward_blocks(plan.remote_blocks, done, dout4, q4, out4, lse, k_all, v_all, hq, dq, dk_all,
                                    dv_all, cfg)
            scatter.start(j)                          # back to their owners while the rest computes
        if cfg.fast is None:
            _backward_blocks(after, done, *local_grads)
        else:
            _backward_segments(cfg.fast.after, done, *segment_grads)
    if scatter:
        scatter.finish_all()
    return dq.dq, dk_acc, dv_acc


class _Llama3Attention(torch.autograd.Function):
    """q (1, L, H, D), k, v (1, L, Hk, D) -> out (1, L, H, D); the entry point adds/drops the batch dim."""

    @staticmethod
    def forward(ctx, q, k, v, cfg: _Llama3Config):
        out, lse = _forward(q, k, v, cfg)             # in q's dtype, each row rounded once
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.cfg)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


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

    q: (T_local, H, D); k, v: (T_local, Hk, D), H % Hk == 0 — or all three as HF's packed row (1, T_local,
    H|Hk, D), used as is (no view); rank r holds packed tokens [r*T_local, (r+1)*T_local) of the global sequence
    described by ``cu_seqlens`` (int32 (num_docs + 1,), identical on every rank). ``heads_k_stride`` K/V heads
    are gathered at a time (None = all; it must divide Hk): peak extra memory is 2 x 2 x (N*T_local,
    heads_k_stride, D). Returns out (T_local, H, D), or (1, T_local, H, D) for 4-D q; differentiable.
    """
    fn = "llama3_attn_varlen_func"
    stride = _check_stride(fn, heads_k_stride, k.shape[-2] if isinstance(k, torch.Tensor) and k.dim() >= 3 else 1)
    call = _VarlenCall(fn, q, k, v, cu_seqlens, group=group, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, dropout_p=dropout_p, layout_code=12,
                       extra_fields=[("heads_k_stride", stride)])
    plan = _llama3_plan(call.cu, call.rank, call.world, call.local, call.causal, call.window)
    chosen = get_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                         mask_kind=FULL if plan.kind == EMPTY else plan.kind, softcap=call.softcap)
    local_sizes = [(b.q_rows.stop - b.q_rows.start, b.kv_rows.stop - b.kv_rows.start) for b in plan.local_blocks]
    kernel = varlen_kernel_for(backend, chosen.name, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                               softcap=call.softcap, document_lengths=local_sizes)
    cfg = _Llama3Config(plan, chosen, call.scale, call.softcap, group, call.world, stride,
                        _varlen_local(plan, kernel, call.local, q.device))
    if q.dim() == 4:                                  # HF's packed row (1, T, H, D): the kernel's own layout
        return _Llama3Attention.apply(q.contiguous(), k.contiguous(), v.contiguous(), cfg)
    out = _Llama3Attention.apply(q.contiguous().unsqueeze(0), k.contiguous().unsqueeze(0),
                                 v.contiguous().unsqueeze(0), cfg)
    return out.squeeze(0)
