"""Varlen ring attention: packed documents, contiguous (``ring``) and ``zigzag`` layouts.

A packed sequence holds documents back to back; ``cu_seqlens`` (int, (num_docs + 1,)) are the cumulative
lengths of the *global* packed sequence, identical on every rank. Documents are independent: a token attends
only to tokens of its own document (causally when ``causal=True``). Tensors are (local_tokens, nheads, headdim),
or all of q, k, v one packed row (1, local_tokens, nheads, headdim) as HF passes them: that is the engine's own
batch-1 layout, so the 4-D form runs without a view and returns out of q's rank (3-D inputs get one unsqueeze).

The ring engine (``engine``) runs unchanged on batch 1: a varlen layout only decides which blocks one ring
step computes. Each block is one document's (query rows x key rows) of the visiting K/V, and with no window
every block is FULL or aligned CAUSAL, so fast backends never see a dense (S x S) mask:

- contiguous (rank r holds packed tokens [r*L, (r+1)*L); documents may cross rank boundaries): the part of
  document d on this rank against the part of d in the visiting block; causally, earlier blocks are FULL,
  our own block is aligned CAUSAL (same positions), later blocks are skipped;
- zigzag (each document cut into 2N chunks of c tokens, rank r holds chunks r and 2N-1-r of every document,
  local cu_seqlens = cu_seqlens // N): per document, the same three cases as the batch zigzag ring.

With a sliding window the blocks are classified from their global positions (FULL, aligned CAUSAL, skipped,
or GENERAL with the window in the mask).

Varlen fast path (CUDA, ``backends.torch_cuda_varlen``): the blocks of one step belong to different documents
(disjoint query rows, disjoint key rows) and are all FULL or all aligned CAUSAL, so a step becomes ONE call of
torch's packed-document flash op: one block over the step's row range whose mask carries the documents'
cumulative lengths (``_StepMask``), served by ``_VarlenStepBackend``. Rows of that range that no document of
the step uses (zigzag's half-steps) are gathered out before the call and come back as out 0 / lse -inf.

Host work per call: cu_seqlens is copied to the host (on CUDA a copy that waits for every queued kernel),
validated and planned from ONCE per tensor object and version (the host cache of ``documents``, an LRU of 8
keyed safely by the tensor itself); a repeated call (every layer of a step passes the same tensor) reuses the validation, the steps,
the ring engine's contribution plan and the device tensors of the fast path: no device sync, no planning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from . import validation
from .backends import CAUSAL, EMPTY, FULL, get_backend
from .backends.base import BlockBackend, BlockMask
from .backends.torch_cuda_varlen import VarlenKernel, VarlenSegments, segments_from_lengths, varlen_kernel_for
from .documents import FULL_MASK, StepBuilder, VarlenCall, classify, documents_overlapping
from .engine import Block, Plan, RingAttention, RingConfig, plan_steps
from .layout import check_zigzag_documents

__all__ = ["ring_attn_varlen_func", "zigzag_ring_attn_varlen_func", "ring_varlen_steps", "zigzag_varlen_steps"]


# ------------------------------------------------------------------------------------------- planners

def ring_varlen_steps(cu: torch.Tensor, rank: int, world: int, local: int, causal: bool,
                       window: Tuple[int, int]) -> Tuple[List[List[Block]], str]:
    """Contiguous layout: step s computes our tokens against those of rank (rank - s) mod N, per document."""
    builder = StepBuilder()
    q0 = rank * local
    steps = []
    for step in range(world):
        src = (rank - step) % world
        k0 = src * local
        blocks: List[Block] = []
        steps.append(blocks)
        if causal and src > rank:   # every key comes after every query: nothing to compute, only to pass on
            continue
        for d in documents_overlapping(cu, q0, q0 + local):
            doc_a, doc_b = int(cu[d]), int(cu[d + 1])
            qa, qb = max(doc_a, q0), min(doc_b, q0 + local)
            ka, kb = max(doc_a, k0), min(doc_b, k0 + local)
            if qa < qb and ka < kb:
                kind, mask = classify(qa, qb, ka, kb, causal, window)
                builder.add(blocks, kind, mask, slice(qa - q0, qb - q0), slice(ka - k0, kb - k0))
    return steps, builder.kind


def zigzag_varlen_steps(cu: torch.Tensor, rank: int, world: int, causal: bool,
                         window: Tuple[int, int]) -> Tuple[List[List[Block]], str]:
    """Zigzag layout per document (see the module docstring); every document length divides by 2N."""
    builder = StepBuilder()
    lengths = (cu[1:] - cu[:-1]).tolist()
    starts = cu[:-1].tolist()
    steps = []
    for step in range(world):
        src = (rank - step) % world
        blocks: List[Block] = []
        for start, length in zip(starts, lengths):
            c = length // (2 * world)
            lo = start // world                       # local offset of this document on every rank
            if c == 0:
                continue
            if window != (-1, -1):
                _zigzag_window_blocks(builder, blocks, start, lo, c, rank, src, world, window)
            elif src == rank:                          # chunks r, 2N-1-r against themselves: positions increase
                builder.add(blocks, CAUSAL, BlockMask(causal=True), slice(lo, lo + 2 * c), slice(lo, lo + 2 * c))
            elif src < rank:                           # all queries see the earlier chunk `src` only
                builder.add(blocks, FULL, FULL_MASK, slice(lo, lo + 2 * c), slice(lo, lo + c))
            else:                                      # only the late query chunk 2N-1-r sees, and sees both
                builder.add(blocks, FULL, FULL_MASK, slice(lo + c, lo + 2 * c), slice(lo, lo + 2 * c))
        steps.append(blocks)
    return steps, builder.kind


def _zigzag_window_blocks(builder: StepBuilder, blocks: List[Block], start: int, lo: int, c: int, rank: int,
                          src: int, world: int, window: Tuple[int, int]) -> None:
    """With a window: one block per (query chunk, key chunk) pair, classified from global positions."""
    for q_chunk, q_off in ((rank, 0), (2 * world - 1 - rank, c)):
        for k_chunk, k_off in ((src, 0), (2 * world - 1 - src, c)):
            qa, ka = start + q_chunk * c, start + k_chunk * c
            kind, mask = classify(qa, qa + c, ka, ka + c, True, window)
            builder.add(blocks, kind, mask, slice(lo + q_off, lo + q_off + c), slice(lo + k_off, lo + k_off + c))


# --------------------------------------------------------------------------------- varlen fast path


@dataclass(frozen=True)
class _StepMask(BlockMask):
    """All documents of one step as one block: ``segments`` over the packed rows ``q_index``/``k_index``
    (int64 row numbers within the block's row range, in document order; None = every row, in order)."""

    segments: Optional[VarlenSegments] = None
    q_index: Optional[torch.Tensor] = None
    k_index: Optional[torch.Tensor] = None


def _rows_index(rows: List[slice], base: int, device) -> Optional[torch.Tensor]:
    """Row numbers (relative to ``base``) of ``rows`` in order; None when they tile [base, end) in order."""
    if all(a.stop == b.start for a, b in zip(rows, rows[1:])) and rows[0].start == base:
        return None
    return torch.cat([torch.arange(r.start - base, r.stop - base) for r in rows]).to(device)


def _one_block_per_step(blocks: List[Block], device) -> Optional[Block]:
    """The step's blocks as one varlen block, or None when they are not all FULL or all aligned CAUSAL
    (a window), or share rows."""
    sizes = [(b.q_rows.stop - b.q_rows.start, b.kv_rows.stop - b.kv_rows.start) for b in blocks]
    # A 1 x 1 block is FULL and CAUSAL at once: it does not decide the kind.
    kinds = {b.mask.kind(*size) for b, size in zip(blocks, sizes) if size != (1, 1)} or {FULL}
    if len(kinds) != 1 or not kinds <= {FULL, CAUSAL}:
        return None
    if CAUSAL in kinds and any(sq != sk for sq, sk in sizes):
        return None
    q_rows = sorted((b.q_rows for b in blocks), key=lambda r: r.start)
    k_rows = sorted((b.kv_rows for b in blocks), key=lambda r: r.start)
    if any(a.stop > b.start for rows in (q_rows, k_rows) for a, b in zip(rows, rows[1:])):
        return None                                   # overlapping rows would need a merge inside the step
    q0, q1 = q_rows[0].start, q_rows[-1].stop
    k0, k1 = k_rows[0].start, k_rows[-1].stop
    mask = _StepMask(segments=segments_from_lengths([sq for sq, _ in sizes], [sk for _, sk in sizes],
                                                    kinds == {CAUSAL}, device),
                     q_index=_rows_index([b.q_rows for b in blocks], q0, device),
                     k_index=_rows_index([b.kv_rows for b in blocks], k0, device))
    return Block(slice(q0, q1), slice(k0, k1), mask)


def _batched_steps(steps: List[List[Block]], device) -> Optional[List[List[Block]]]:
    """Every non-empty step as one varlen block, or None when some step cannot be batched."""
    batched = []
    for blocks in steps:
        one = _one_block_per_step(blocks, device) if blocks else None
        if blocks and one is None:
            return None
        batched.append([one] if one is not None else [])
    return batched


class _VarlenStepBackend:
    """A block backend that computes ``_StepMask`` blocks with a varlen kernel (other blocks: ``inner``).

    Shapes as every block backend: q (1, Sq, H, D), k/v (1, Sk, Hk, D), out (1, Sq, H, D), lse (1, H, Sq).
    """

    def __init__(self, kernel: VarlenKernel, inner: BlockBackend):
        self.kernel, self.inner = kernel, inner
        self.name = f"{inner.name}+{kernel.name}"

    def unsupported_reason(self, **query):
        return self.inner.unsupported_reason(**query)

    @staticmethod
    def _rows(x: torch.Tensor, index: Optional[torch.Tensor]) -> torch.Tensor:
        return x[0] if index is None else x[0].index_select(0, index)

    @staticmethod
    def _unpack(x: torch.Tensor, index: Optional[torch.Tensor], shape: Tuple[int, ...], fill: float = 0.0,
                dim: int = 0) -> torch.Tensor:
        """Packed rows ``x`` back at their rows of a (1, *shape) tensor; the rows no document uses get ``fill``."""
        if index is None:
            return x.unsqueeze(0)
        full = torch.full(shape, fill, dtype=x.dtype, device=x.device)
        return full.index_copy_(dim, index, x).unsqueeze(0)

    def forward(self, q, k, v, *, scale, mask, softcap=0.0):
        if not isinstance(mask, _StepMask):
            return self.inner.forward(q, k, v, scale=scale, mask=mask, softcap=softcap)
        out, lse = self.kernel.forward(self._rows(q, mask.q_index), self._rows(k, mask.k_index),
                                       self._rows(v, mask.k_index), mask.segments, scale=scale)
        return (self._unpack(out, mask.q_index, q.shape[1:]),
                self._unpack(lse, mask.q_index, (q.shape[2], q.shape[1]), float("-inf"), dim=1))  # no key seen

    def backward(self, dout, q, k, v, out, lse, *, scale, mask, softcap=0.0):
        if not isinstance(mask, _StepMask):
            return self.inner.backward(dout, q, k, v, out, lse, scale=scale, mask=mask, softcap=softcap)
        qi, ki = mask.q_index, mask.k_index
        lse_rows = lse[0] if qi is None else lse[0].index_select(1, qi)
        dq, dk, dv = self.kernel.backward(self._rows(dout, qi), self._rows(q, qi), self._rows(k, ki),
                                          self._rows(v, ki), self._rows(out, qi), lse_rows, mask.segments,
                                          scale=scale)
        return self._unpack(dq, qi, q.shape[1:]), self._unpack(dk, ki, k.shape[1:]), self._unpack(dv, ki, v.shape[1:])


# -------------------------------------------------------------------------------------------- running


Steps = List[List[Block]]


class _RingPrepared:
    """The host plan of one ring/zigzag varlen call (cached per cu_seqlens: ``CuEntry.get``).

    ``steps``: the per-document blocks of every ring step; ``kind``: their most general mask kind; ``sizes``:
    every block's (query rows, key rows), for ``varlen_kernel_for``; ``local``: tokens per rank. Filled on
    first use: the ring engine's contribution plan (``engine.plan_steps``) of ``steps``, and per device the varlen
    fast path's batched steps (one block per step, index/cumulative-length tensors already on the device)
    with their own plan -- so a repeated call plans nothing and copies nothing to the device.
    """

    def __init__(self, steps: Steps, kind: str, local: int):
        self.steps, self.kind, self.local = steps, kind, local
        self.sizes = [(b.q_rows.stop - b.q_rows.start, b.kv_rows.stop - b.kv_rows.start)
                      for step in steps for b in step]
        self._plan: Optional[Plan] = None
        self._batched: Dict[torch.device, Optional[Tuple[Steps, Plan]]] = {}

    def per_block(self) -> Tuple[Steps, Plan]:
        """The per-document steps and their contribution plan."""
        if self._plan is None:
            self._plan = plan_steps(self.steps, self.local, self.local)
        return self.steps, self._plan

    def batched(self, device: torch.device) -> Optional[Tuple[Steps, Plan]]:
        """Every step as one ``_StepMask`` block on ``device`` and their plan, or None (cannot be batched)."""
        if device not in self._batched:
            steps = _batched_steps(self.steps, device)
            self._batched[device] = None if steps is None else (steps, plan_steps(steps, self.local, self.local))
        return self._batched[device]


def _ring_prepared(call: VarlenCall) -> _RingPrepared:
    key = ("ring", call.rank, call.world, call.local, call.causal, call.window)
    return call.entry.get(key, lambda: _RingPrepared(
        *ring_varlen_steps(call.cu, call.rank, call.world, call.local, call.causal, call.window), call.local))


def _zigzag_prepared(fn: str, call: VarlenCall) -> _RingPrepared:
    # The documents' check is cached only once it passed (a failing one raises again on every call).
    instead = "use ring_attn_varlen_func or llama3_attn_varlen_func (layout='contiguous')"
    call.entry.get(("zigzag documents", call.world),
                   lambda: check_zigzag_documents(call.cu, call.world, fn=fn, instead=instead))
    key = ("zigzag", call.rank, call.world, call.local, call.causal, call.window)
    return call.entry.get(key, lambda: _RingPrepared(
        *zigzag_varlen_steps(call.cu, call.rank, call.world, call.causal, call.window), call.local))


def _run_ring_varlen(q, k, v, sink, call: VarlenCall, prepared: _RingPrepared, backend: str, group):
    """Pick the backend for the most general block kind and run the ring engine on batch 1 (plans from
    ``prepared``: the engine's ``RingConfig.plan`` is passed in, not recomputed)."""
    kind = prepared.kind
    chosen = get_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                         mask_kind=FULL if kind == EMPTY else kind, softcap=call.softcap)
    kernel = varlen_kernel_for(backend, chosen.name, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                               softcap=call.softcap, document_lengths=prepared.sizes)
    batched = prepared.batched(q.device) if kernel is not None else None
    if batched is not None:
        (steps, plan), chosen = batched, _VarlenStepBackend(kernel, chosen)
    else:
        steps, plan = prepared.per_block()
    cfg = RingConfig(steps, chosen, call.scale, call.softcap, group, call.rank, call.world, plan=plan)
    if q.dim() == 4:                                  # a packed row (1, T, H, D) is the engine's own layout
        return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sink, cfg)
    out = RingAttention.apply(q.contiguous().unsqueeze(0), k.contiguous().unsqueeze(0),
                              v.contiguous().unsqueeze(0), sink, cfg)
    return out.squeeze(0)


def ring_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=False, softmax_scale=None, backend="auto",
                          window_size=(-1, -1), softcap=0.0, dropout_p=0.0, sink=None):
    """Ring attention over packed documents sharded contiguously (layout ``"contiguous"``).

    q: (T_local, H, D); k, v: (T_local, Hk, D), H % Hk == 0 — or all three as HF's packed row (1, T_local, H|Hk,
    D), used as is (no view); rank r holds packed tokens [r*T_local, (r+1)*T_local) of the global sequence
    described by ``cu_seqlens`` (int32 (num_docs + 1,), identical on every rank; documents may cross rank
    boundaries). Returns out (T_local, H, D), or (1, T_local, H, D) for 4-D q, in q's dtype; differentiable.
    ``window_size`` (left, right) and ``softcap`` follow flash-attn; ``dropout_p`` must be 0.
    ``sink``: None, or attention-sink logits (H,) -- any float dtype, on q's device, may require grad: every
    query's softmax gets one extra key per head with this logit and value 0 (gpt-oss's ``s_aux``). Its
    gradient on each rank is the partial sum over that rank's queries; the sum over the group is the whole
    gradient (what the usual gradient all-reduce computes). Every rank passes a sink or none does.
    """
    fn = "ring_attn_varlen_func"
    call = VarlenCall(fn, q, k, v, cu_seqlens, group=group, causal=causal, softmax_scale=softmax_scale,
                      window_size=window_size, softcap=softcap, dropout_p=dropout_p, sink=sink,
                      layout_code=validation.LayoutCode.RING_VARLEN)
    return _run_ring_varlen(q, k, v, sink, call, _ring_prepared(call), backend, group)


def zigzag_ring_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=True, softmax_scale=None,
                                 backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0, sink=None):
    """Causal ring attention over packed documents in the varlen ``"zigzag"`` layout.

    Every document of the global ``cu_seqlens`` is cut into 2N chunks; rank r holds chunk r then chunk 2N-1-r
    of each document, documents in order (``ring_kernels.shard(x, layout="zigzag", dim=0, cu_seqlens=...)``).
    q: (T_local, H, D); k, v: (T_local, Hk, D) — or all three 4-D with batch 1 (HF's packed row, no view);
    out has q's shape. Each document length must be divisible by 2N.
    ``causal=False`` raises (use ``ring_attn_varlen_func``). ``window_size``, ``softcap``: as flash-attn.
    ``sink``: None, or attention-sink logits (H,) -- any float dtype, on q's device, may require grad: every
    query's softmax gets one extra key per head with this logit and value 0 (gpt-oss's ``s_aux``). Its
    gradient on each rank is the partial sum over that rank's queries; the sum over the group is the whole
    gradient (what the usual gradient all-reduce computes). Every rank passes a sink or none does.
    """
    fn = "zigzag_ring_attn_varlen_func"
    validation.require_causal(fn, causal, alternative="ring_attn_varlen_func")
    call = VarlenCall(fn, q, k, v, cu_seqlens, group=group, causal=causal, softmax_scale=softmax_scale,
                      window_size=window_size, softcap=softcap, dropout_p=dropout_p, sink=sink,
                      layout_code=validation.LayoutCode.ZIGZAG_VARLEN)
    return _run_ring_varlen(q, k, v, sink, call, _zigzag_prepared(fn, call), backend, group)
