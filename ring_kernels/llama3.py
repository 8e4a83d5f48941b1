"""Llama3-style context parallelism for packed documents: all-gather K/V in head slices, local queries.

Layout ``"contiguous"``: rank r holds packed tokens [r*L, (r+1)*L) of the global sequence described by
``cu_seqlens``. Instead of a ring, each rank all-gathers the K/V of the whole sequence, ``heads_k_stride``
K/V heads at a time (bounding the memory of the gathered copy: 2 buffers x (N*L, stride, D) for K and V),
and computes its queries of the matching query heads against them.

Blocks, per document d overlapping our tokens [qa, qb): causally, keys [start(d), qa) are FULL and keys
[qa, qb) are aligned CAUSAL; non-causally all keys of d are FULL; a window classifies them like the ring
(``documents.classify``), so there is no dense (S x S) mask in the standard cases. Key ranges are also cut at
our own token range: *local* blocks (keys this rank holds) need no gathered copy and run while the
all-gather is in flight; only *remote* blocks (documents that cross a rank boundary) wait for it.

Backward, per head slice: half of the local blocks while the K/V all-gather is in flight (their dK/dV go to
our own rows of a full-sequence partial buffer), the remote blocks (into the other ranks' rows of it), the
reduce-scatter of the partials back to their owners started, and the other half of the local blocks meanwhile
(held, and added to our rows once the reduce-scatter has landed there).

Rounding (``rounding``'s rule: every value rounded to its output dtype once; fp32 only where a value gets >= 3
contributions): out and dq are written in q's dtype, each row rounded once: a row with one block (most rows:
only documents that cross a rank boundary have remote blocks) gets a copy of it, a second block merges (adds)
into it with fp32 math, and only rows with >= 3 blocks use an fp32 accumulator. A K/V row gets one dK/dV
contribution per rank that sees it (this rank's local blocks have disjoint key rows, and so have each rank's
remote blocks; head slices split heads, not rows): with N <= 2 at most two, so the partials and the results
are in k's dtype — the reduce-scatter adds (ours or 0) + (the other rank's or 0), exact or one rounding, and
the held half lands on rows holding 0 or the other rank's value, one rounding. With N >= 3 they are fp32
(the reduce-scatter sums N values) and cast once at the end. The forward needs no fp32 buffer at N = 2 but
the lse (1, H, L): no query row gets >= 3 blocks (a document would have to cross both ends of a rank).

Memory, in units of U = the local k + v (bytes, k's dtype), for one slice (``heads_k_stride=None``; with S
slices the gathered and partial buffers are per slice, 2 resp. 1 of them alive, each 1/S of the sizes below):
the gathered K/V are N*U (the benchmarks' "K/V double buffer" allowance, 2U at N = 2), the partials N*U,
the results dk/dv U (allocated when the reduce-scatter starts: it writes them), dq as single-GPU attention's.
The backward's peak is its first half of local blocks (or the remote blocks): gathered K/V 2U + bf16
partials 2U + dq + the running call's outputs and workspace for about half of the local rows (the halves
also halve that). The second half runs with the partials (in flight) + results 3U: the gathered K/V are freed
after their last use. So the backward's peak holds 4U of ring buffers where an fp32 design would hold 10U
(2U gathered + 4U fp32 partials + 2U fp32 receive buffers + 2U fp32 dK/dV accumulators). Measured GPU and CPU
peaks: benchmarks/results/README.md, "llama3 memory".

Per call, nothing is planned twice: the plan, the fast path's segments (cumulative lengths already on the
device) and the rounding plans are cached with the cu_seqlens tensor (``documents.CuEntry``: same object, same
``_version``), so a repeated call with the same cu_seqlens (every layer of a step) makes no device->host copy.

Varlen fast path (CUDA, ``backends.torch_cuda_varlen``): the local blocks are aligned squares, one per local
document, tiling our rows in order, so all of them are ONE call of torch's packed-document flash op per head
slice (``cu_seqlens`` = our local document boundaries, for q and k alike) instead of one call per document;
the backward splits them at a document boundary into two such calls around the remote blocks. Only the
(at most two) documents that cross a rank boundary still have per-block remote calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import validation
from .backends import EMPTY, FULL, get_backend
from .backends.base import CAUSAL, BlockBackend, BlockMask
from .backends.torch_cuda_varlen import VarlenKernel, VarlenSegments, segments_from_rows, varlen_kernel_for
from .checkpointing import current_region
from .documents import StepBuilder, VarlenCall, classify, documents_overlapping
from .engine import fold_sink, sink_grad
from .rounding import RowPlan, fold_grads, fold_outputs, plan_rows

__all__ = ["llama3_attn_varlen_func"]

# torch 2.13 renamed the tensor collectives (the old names warn); same arguments, older torch has only the old.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class _Llama3Block:
    """One backend call: local query rows x key rows, of the local K/V (``local``) or of the gathered sequence.

    ``first``: the first block over these query rows (local blocks run first, and every query row has one: its
    own position is always visible); the engine's rounding plan (``rounding.plan_rows``) derives the same from the
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


def llama3_plan(cu: torch.Tensor, rank: int, world: int, local: int, causal: bool,
                window: Tuple[int, int]) -> _Llama3Plan:
    """Blocks of our queries (local rows) per document overlapping our tokens [q0, q0 + L)."""
    builder = StepBuilder()
    q0, q1 = rank * local, (rank + 1) * local
    pieces: List[Tuple[slice, int, int, BlockMask]] = []
    for d in documents_overlapping(cu, q0, q1):
        doc_a, doc_b = int(cu[d]), int(cu[d + 1])
        qa, qb = max(doc_a, q0), min(doc_b, q0 + local)
        # Causal: split at qa so that both parts are standard blocks (FULL before, aligned CAUSAL after);
        # then cut at our own range so that local keys need no gathered copy.
        key_ranges = [(doc_a, qa), (qa, qb)] if causal else [(doc_a, doc_b)]
        for ka, kb in (piece for kr in key_ranges for piece in _split_at(*kr, (q0, q1))):
            kind, mask = classify(qa, qb, ka, kb, causal, window)
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


_Segments3 = Tuple[VarlenSegments, Optional[VarlenSegments], Optional[VarlenSegments]]


def _local_fast_segments(plan: _Llama3Plan, local: int, device) -> Optional[_Segments3]:
    """(whole, before, after) segments of the varlen fast path for ``plan``'s local blocks (see
    ``_VarlenLocal``), or None when the blocks cannot be batched.

    The forward initialises the accumulators with this call, so its documents must cover all ``local`` rows.
    """
    if not plan.local_blocks:
        return None
    whole = _local_segments(plan.local_blocks, device)
    if whole is None or (whole.q_rows.start, whole.q_rows.stop) != (0, local):
        return None
    before, after = halves(plan.local_blocks) if plan.gather else (plan.local_blocks, [])
    split = [_local_segments(part, device) if part else None for part in (before, after)]
    if any(part and seg is None for part, seg in zip((before, after), split)):
        return None
    return whole, split[0], split[1]


class _Llama3Prepared:
    """The host plan of one llama3 call (cached per cu_seqlens: ``documents.CuEntry.get``): the ``plan``, the
    local blocks' ``local_sizes`` (for ``varlen_kernel_for``), and, filled on first use, the fast path's
    segments per device (their cumulative lengths already on the device) and the rounding plans of the rows
    (``memo``, per fast path or not) -- so a repeated call plans nothing and copies nothing to the device."""

    def __init__(self, plan: _Llama3Plan, local: int):
        self.plan, self.local = plan, local
        self.local_sizes = [(b.q_rows.stop - b.q_rows.start, b.kv_rows.stop - b.kv_rows.start)
                            for b in plan.local_blocks]
        self._segments: Dict[torch.device, Optional[_Segments3]] = {}
        self.memos: Dict[bool, dict] = {False: {}, True: {}}

    def fast(self, kernel: Optional[VarlenKernel], device: torch.device) -> Optional[_VarlenLocal]:
        if kernel is None:
            return None
        if device not in self._segments:
            self._segments[device] = _local_fast_segments(self.plan, self.local, device)
        segments = self._segments[device]
        return None if segments is None else _VarlenLocal(kernel, *segments)


class _Llama3Config:
    """Everything one call needs besides the tensors. ``memo``: derived values of (plan, fast path or not)
    computed once (shared through ``_Llama3Prepared`` by the calls of one cu_seqlens; {} = this call only)."""

    def __init__(self, plan: _Llama3Plan, backend: BlockBackend, scale, softcap, group, rank, world,
                 heads_k_stride, fast: Optional[_VarlenLocal] = None, memo: Optional[dict] = None):
        self.plan, self.backend, self.scale, self.softcap = plan, backend, scale, softcap
        self.group, self.rank, self.world, self.stride = group, rank, world, heads_k_stride
        self.fast = fast
        self.memo = {} if memo is None else memo

    def memoised(self, key, compute: Callable[[], object]):
        """``compute()`` once per ``key`` (which must name everything it depends on besides plan and fast)."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


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
        works = [all_gather_tensor(buf, part, group=self.cfg.group, async_op=True)
                 for buf, part in zip((kbuf, vbuf), inputs)]
        self.pending[j] = (works, inputs)

    def get(self, j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Wait for slice j; gathered (1, N*L, stride, D) K and V."""
        works, _inputs = self.pending.pop(j)
        for work in works:
            work.wait()
        return self.blocks[j % len(self.blocks)]

    def release(self, j: int, slices: int) -> None:
        """Slice j's gathered K/V are no longer used: free their buffer when no later slice reuses it, so that
        what runs next (the backward's second half of local blocks) does not carry it."""
        slot = j % len(self.buffers)
        if j + len(self.buffers) >= slices:
            self.buffers[slot] = self.blocks[slot] = None


def heads(j: int, cfg: _Llama3Config, group_size: int) -> Tuple[slice, slice]:
    """(K/V heads, query heads) of head slice j."""
    return (slice(j * cfg.stride, (j + 1) * cfg.stride),
            slice(j * cfg.stride * group_size, (j + 1) * cfg.stride * group_size))


def _rows_plan(ranges: List[slice], local: int) -> RowPlan:
    """The rounding plan (``rounding.plan_rows``) of contributions over ``local`` query rows, in call order."""
    return plan_rows([(r.start, r.stop) for r in ranges], local)


class _Result:
    """Out (1, L, H, D) in q's dtype and lse (1, H, L) fp32 filled head slice by head slice, each row rounded
    once (``rounding``'s rule): rows with one block get a copy, two blocks merge into out, >= 3 use ``acc`` (fp32)."""

    def __init__(self, q4: torch.Tensor, plan: RowPlan):
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
        fold_outputs(self.plan.parts[index], out, lse, self.out[:, :, hq], self.lse[:, hq], self.acc[:, :, hq])


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


def forward_pass(q4, k4, v4, cfg: _Llama3Config):
    """q4 (1, L, H, D), k4/v4 (1, L, Hk, D) -> out (1, L, H, D) in q's dtype, lse (1, H, L) fp32."""
    plan = cfg.plan
    rows = cfg.memoised(("forward rows", q4.shape[1]), lambda: _rows_plan(_forward_ranges(cfg), q4.shape[1]))
    result = _Result(q4, rows)
    slices, group_size = k4.shape[2] // cfg.stride, q4.shape[2] // k4.shape[2]
    gather = _SliceGather(k4, v4, cfg) if plan.gather else None
    if gather:
        gather.start(0)
    for j in range(slices):
        if gather and j + 1 < slices:
            gather.start(j + 1)                       # the next slice travels while this one computes
        hk, hq = heads(j, cfg, group_size)
        done = _forward_local(q4, k4, v4, hk, hq, result, cfg)
        if gather:
            _forward_blocks(plan.remote_blocks, done, q4, *gather.get(j), hq, result, cfg)  # gathered meanwhile
            gather.release(j, slices)
    return result.out, result.lse


def _disjoint(ranges: List[slice]) -> bool:
    """No row lies in two of ``ranges``."""
    spans = sorted((r.start, r.stop) for r in ranges if r.stop > r.start)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _kv_grad_dtype(cfg: _Llama3Config, dtype: torch.dtype) -> torch.dtype:
    """dtype of the dK/dV results and partials: k's own for N <= 2, fp32 for N >= 3 (``rounding``'s rule).

    A K/V row of rank r gets one contribution per rank whose queries see it: one from r's local blocks (their
    key rows are disjoint: one query range per document, its keys cut into disjoint pieces) and one from each
    other rank's remote blocks (disjoint likewise). Head slices split heads, never rows, and a document that
    crosses a rank boundary only adds the other rank's one contribution. So with N <= 2 every row gets <= 2,
    summed once; with N >= 3 up to N. Decided from N alone: every rank must reduce-scatter in the same dtype.
    """
    # Checked once per plan (the memo is shared by the calls of one cu_seqlens), not on every backward.
    assert cfg.memoised("kv rows disjoint", lambda: (_disjoint([b.kv_rows for b in cfg.plan.local_blocks]),
                                                    _disjoint([b.kv_rows for b in cfg.plan.remote_blocks]))) \
        == (True, True), "local (or remote) blocks share K/V rows"
    return dtype if cfg.world <= 2 else torch.float32


class _Into:
    """Adds block gradients dk, dv (1, rows, stride, D) into ``dk``/``dv`` (1, T, stride, D) at their key rows.
    A row that holds 0 takes the value exactly; a row that holds one value is summed in fp32 and rounded once."""

    def __init__(self, dk: torch.Tensor, dv: torch.Tensor):
        self.dk, self.dv = dk, dv

    def __call__(self, rows: slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.dk[:, rows] += dk
        self.dv[:, rows] += dv


class _Held:
    """Block gradients kept until their destination is written (``_KVGrads.finish``), then added ``into`` it."""

    def __init__(self):
        self.grads: List[Tuple[slice, torch.Tensor, torch.Tensor]] = []

    def __call__(self, rows: slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.grads.append((rows, dk, dv))

    def into(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        add = _Into(dk, dv)
        for rows, gk, gv in self.grads:
            add(rows, gk, gv)
        self.grads.clear()


class _KVGrads:
    """dK/dV of one backward: the results ``dk``/``dv`` (1, L, Hk, D) and, per head slice, the full-sequence
    partials (1, N*L, stride, D) that one reduce-scatter per tensor sends back to the K/V owners.

    dtype (``_kv_grad_dtype``): k's for N <= 2, fp32 for N >= 3 (the caller casts once). One slice at a time
    (N > 1): ``partials(j)`` zeroes the partials; the first half of the local blocks adds into our own rows of
    them (``own``) and the remote blocks into the other ranks' rows; ``start(j)`` reduce-scatters them into our
    rows of the results (straight into ``dk``/``dv`` when one slice holds every head, else into ``part`` and
    copied by ``finish``) while the second half of the local blocks is ``held``; ``finish(j)`` waits and adds
    it. Every row: (own half or 0) + (the other rank's or 0) in the reduce-scatter, + (held or 0) -- at most
    two non-zero terms with N = 2, one rounding.
    """

    def __init__(self, k4: torch.Tensor, cfg: _Llama3Config):
        self.cfg, self.shape, self.device = cfg, k4.shape, k4.device
        self.dtype = _kv_grad_dtype(cfg, k4.dtype)
        n, hk, d = k4.shape[1], k4.shape[2], k4.shape[3]
        self.whole = cfg.stride == hk                      # one slice: the reduce-scatter lands in the results
        new = lambda *shape: torch.empty(shape, dtype=self.dtype, device=self.device)  # noqa: E731
        if cfg.plan.gather:
            self.dk = self.dv = None                       # allocated when the first reduce-scatter starts
            self.full = (new(n * cfg.world, cfg.stride, d), new(n * cfg.world, cfg.stride, d))
            self.part = None if self.whole else (new(n, cfg.stride, d), new(n, cfg.stride, d))
        else:                                              # one rank: local blocks only, one per row
            self.dk, self.dv = (torch.zeros(k4.shape, dtype=self.dtype, device=self.device) for _ in range(2))
        self.pending = None                                # (j, works) of the reduce-scatter in flight

    def local(self, hk: slice) -> _Into:
        """Where a world of one adds its local blocks: the results at heads ``hk``."""
        return _Into(self.dk[:, :, hk], self.dv[:, :, hk])

    def partials(self, j: int) -> Tuple[_Into, _Into]:
        """(own rows, all rows) of slice j's zeroed full-sequence partials; the previous slice has finished."""
        assert self.pending is None, f"dK/dV slice {self.pending[0]} was never finished"
        fk, fv = (x.zero_().unsqueeze(0) for x in self.full)
        n = self.shape[1]
        own = slice(self.cfg.rank * n, (self.cfg.rank + 1) * n)
        return _Into(fk[:, own], fv[:, own]), _Into(fk, fv)

    def start(self, j: int) -> None:
        if self.dk is None:
            self.dk, self.dv = (torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in range(2))
        outputs = (self.dk[0], self.dv[0]) if self.whole else self.part
        self.pending = (j, [reduce_scatter_tensor(out, full, group=self.cfg.group, async_op=True)
                            for out, full in zip(outputs, self.full)])

    def finish(self, j: int, held: _Held) -> None:
        """Wait for slice j's reduce-scatter, then add the second half's ``held`` gradients (rows written once)."""
        pending_j, works = self.pending
        assert pending_j == j, (pending_j, j)
        for work in works:
            work.wait()
        self.pending = None
        heads = slice(j * self.cfg.stride, (j + 1) * self.cfg.stride)
        if not self.whole:
            self.dk[0, :, heads].copy_(self.part[0])
            self.dv[0, :, heads].copy_(self.part[1])
        held.into(self.dk[:, :, heads], self.dv[:, :, heads])


class _QueryGrads:
    """dq (1, L, H, D) in q's dtype, filled head slice by head slice with ``rounding``'s rule."""

    def __init__(self, q4: torch.Tensor, plan: RowPlan):
        self.plan = plan
        self.dq = torch.zeros_like(q4) if plan.untouched else torch.empty_like(q4)
        wide = plan.accumulates and q4.dtype != torch.float32
        self.acc = torch.empty(q4.shape, dtype=torch.float32, device=q4.device) if wide else self.dq

    def fold(self, index: int, hq: slice, dq: torch.Tensor) -> None:
        held = self.dq[:, :, hq]
        fold_grads(self.plan.parts[index], dq, held, held, self.acc[:, :, hq])


def _backward_blocks(blocks, first: int, dout4, q4, out4, lse, k_rows, v_rows, hq, dq: _QueryGrads, sink,
                     cfg) -> int:
    """Backward of ``blocks`` (dq contributions ``first``, ...) against K/V rows (1, T, stride, D): each block's
    dk/dv go to ``sink(kv_rows, dk, dv)`` (``_Into`` or ``_Held``). Returns the next contribution index."""
    for i, blk in enumerate(blocks):
        rows = blk.q_rows
        dq_b, dk, dv = cfg.backend.backward(
            dout4[:, rows, hq], q4[:, rows, hq], k_rows[:, blk.kv_rows], v_rows[:, blk.kv_rows],
            out4[:, rows, hq], lse[:, hq, rows], scale=cfg.scale, mask=blk.mask, softcap=cfg.softcap)
        dq.fold(first + i, hq, dq_b)
        sink(blk.kv_rows, dk, dv)
    return first + len(blocks)


def _backward_segments(seg: Optional[VarlenSegments], first: int, dout4, q4, out4, lse, k4, v4, hk, hq,
                       dq: _QueryGrads, sink, cfg: _Llama3Config) -> int:
    """Backward of one varlen call of local documents (dq contribution ``first``) at K/V heads ``hk``: dk/dv
    (as (1, rows, stride, D)) to ``sink(kv_rows, dk, dv)``. Returns the next contribution index."""
    if seg is None:
        return first
    rows, kv = seg.q_rows, seg.k_rows
    dq_b, dk, dv = cfg.fast.kernel.backward(
        dout4[0, rows, hq], q4[0, rows, hq], k4[0, kv, hk], v4[0, kv, hk], out4[0, rows, hq], lse[0, hq, rows],
        seg, scale=cfg.scale)
    dq.fold(first, hq, dq_b.unsqueeze(0))
    sink(kv, dk.unsqueeze(0), dv.unsqueeze(0))
    return first + 1


def _backward_ranges(cfg: _Llama3Config, before, after) -> List[slice]:
    """Query rows of the backward's dq contributions in call order: local (first part), remote, local (rest)."""
    if cfg.fast is None:
        local = ([b.q_rows for b in before], [b.q_rows for b in after])
    else:
        local = tuple([seg.q_rows] if seg is not None else [] for seg in (cfg.fast.before, cfg.fast.after))
    remote = [b.q_rows for b in cfg.plan.remote_blocks] if cfg.plan.gather else []
    return local[0] + remote + local[1]


def halves(blocks: List[_Llama3Block]) -> Tuple[List[_Llama3Block], List[_Llama3Block]]:
    """Split blocks into two parts of about equal work (query rows x key rows)."""
    work = [(b.q_rows.stop - b.q_rows.start) * (b.kv_rows.stop - b.kv_rows.start) for b in blocks]
    total, acc = sum(work), 0
    for i, w in enumerate(work):
        if 2 * (acc + w) > total:
            return blocks[:i], blocks[i:]
        acc += w
    return blocks, []


def _backward_local(part, first: int, dout4, q4, out4, lse, k4, v4, hk, hq, dq: _QueryGrads, sink,
                    cfg: _Llama3Config) -> int:
    """One part of the local blocks (``before``/``after``: block lists, or the fast path's segments)."""
    if cfg.fast is None:
        return _backward_blocks(part, first, dout4, q4, out4, lse, k4[:, :, hk], v4[:, :, hk], hq, dq, sink, cfg)
    return _backward_segments(part, first, dout4, q4, out4, lse, k4, v4, hk, hq, dq, sink, cfg)


def _backward(dout4, q4, k4, v4, out4, lse, cfg: _Llama3Config):
    """Gradients dq (1, L, H, D) in q's dtype, dk, dv (1, L, Hk, D) in ``_kv_grad_dtype`` from the merged out4
    (1, L, H, D) and lse (1, H, L).

    Per head slice: half of the local blocks while its K/V all-gather is in flight, the remote blocks, the
    reduce-scatter of the slice's partials started, then the other half of the local blocks meanwhile.
    """
    plan = cfg.plan
    slices, group_size = k4.shape[2] // cfg.stride, q4.shape[2] // k4.shape[2]
    before, after = cfg.memoised("halves", lambda: halves(plan.local_blocks) if plan.gather
                                 else (plan.local_blocks, []))
    dq = _QueryGrads(q4, cfg.memoised(("backward rows", q4.shape[1]), lambda: _rows_plan(
        _backward_ranges(cfg, before, after), q4.shape[1])))
    if cfg.fast is not None:                          # the same halves as packed-document calls
        before, after = cfg.fast.before, cfg.fast.after
    grads = _KVGrads(k4, cfg)
    gather = _SliceGather(k4, v4, cfg) if plan.gather else None
    if gather:
        gather.start(0)
    for j in range(slices):
        if gather and j + 1 < slices:
            gather.start(j + 1)
        hk, hq = heads(j, cfg, group_size)
        common = (dout4, q4, out4, lse, k4, v4, hk, hq, dq)
        if not gather:
            _backward_local(before, 0, *common, grads.local(hk), cfg)
            continue
        own, every = grads.partials(j)
        done = _backward_local(before, 0, *common, own, cfg)
        done = _backward_blocks(plan.remote_blocks, done, dout4, q4, out4, lse, *gather.get(j), hq, dq, every, cfg)
        gather.release(j, slices)
        grads.start(j)                                # back to their owners while the rest computes
        held = _Held()
        _backward_local(after, done, *common, held, cfg)
        grads.finish(j, held)
    return dq.dq, grads.dk, grads.dv


class _Llama3Attention(torch.autograd.Function):
    """q (1, L, H, D), k, v (1, L, Hk, D), sink (H,) or None -> out (1, L, H, D); the entry point adds/drops the
    batch dim. A sink is folded into the finished (out, lse) as the ring engine does (``engine.fold_sink``)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cfg: _Llama3Config):
        region = current_region()                     # a kept checkpoint region (ring_kernels.checkpointing)
        kept = region.take(q, "llama3_attn_varlen_func") if region is not None else None
        if kept is not None:                          # a recomputation: the forward's own out and lse, no gather
            out, lse = kept
        else:
            out, lse = forward_pass(q, k, v, cfg)     # in q's dtype, each row rounded once
            if sink is not None:
                lse = fold_sink(out, lse, sink)
            if region is not None:
                region.offer(out, lse)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse, *((sink,) if sink is not None else ()))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *sink = ctx.saved_tensors
        sink = sink[0] if sink else None
        dout = dout.contiguous()
        dsink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[3] else None
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.cfg)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dsink, None


def _check_stride(fn: str, heads_k_stride, nheads_k: int) -> int:
    if heads_k_stride is None:
        return nheads_k
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int):
        raise TypeError(f"{fn}: heads_k_stride must be an int or None, got {type(heads_k_stride).__name__}")
    if heads_k_stride < 1 or nheads_k % heads_k_stride != 0:
        divisors = [s for s in range(1, nheads_k + 1) if nheads_k % s == 0]
        raise validation.RingInputError(
            f"{fn}: heads_k_stride={heads_k_stride} must divide nheads_k={nheads_k} (K/V heads are gathered "
            f"heads_k_stride at a time); use one of {divisors}, or None to gather all K/V heads at once")
    return heads_k_stride


def llama3_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=False, softmax_scale=None,
                            backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0,
                            heads_k_stride: Optional[int] = None, sink=None):
    """Attention over packed documents sharded contiguously, by all-gathering K/V (Llama 3 style).

    q: (T_local, H, D); k, v: (T_local, Hk, D), H % Hk == 0 — or all three as HF's packed row (1, T_local,
    H|Hk, D), used as is (no view); rank r holds packed tokens [r*T_local, (r+1)*T_local) of the global sequence
    described by ``cu_seqlens`` (int32 (num_docs + 1,), identical on every rank). ``heads_k_stride`` K/V heads
    are gathered at a time (None = all; it must divide Hk): peak extra memory is 2 x 2 x (N*T_local,
    heads_k_stride, D). Returns out (T_local, H, D), or (1, T_local, H, D) for 4-D q; differentiable.
    ``window_size`` (left, right) and ``softcap`` follow flash-attn; ``dropout_p`` must be 0.
    ``sink``: None, or attention-sink logits (H,) -- any float dtype, on q's device, may require grad: every
    query's softmax gets one extra key per head with this logit and value 0 (gpt-oss's ``s_aux``). Its
    gradient on each rank is the partial sum over that rank's queries; the sum over the group is the whole
    gradient (what the usual gradient all-reduce computes). Every rank passes a sink or none does.
    """
    fn = "llama3_attn_varlen_func"
    stride = _check_stride(fn, heads_k_stride, k.shape[-2] if isinstance(k, torch.Tensor) and k.dim() >= 3 else 1)
    call = VarlenCall(fn, q, k, v, cu_seqlens, group=group, causal=causal, softmax_scale=softmax_scale,
                      window_size=window_size, softcap=softcap, dropout_p=dropout_p, sink=sink,
                      layout_code=validation.LayoutCode.LLAMA3_VARLEN,
                      extra_fields=[("heads_k_stride", stride)])
    prepared = call.entry.get(("llama3", call.rank, call.world, call.local, call.causal, call.window),
                              lambda: _Llama3Prepared(llama3_plan(call.cu, call.rank, call.world, call.local,
                                                                  call.causal, call.window), call.local))
    plan = prepared.plan
    chosen = get_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                         mask_kind=FULL if plan.kind == EMPTY else plan.kind, softcap=call.softcap)
    kernel = varlen_kernel_for(backend, chosen.name, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                               softcap=call.softcap, document_lengths=prepared.local_sizes)
    fast = prepared.fast(kernel, q.device)
    cfg = _Llama3Config(plan, chosen, call.scale, call.softcap, group, call.rank, call.world, stride, fast,
                        prepared.memos[fast is not None])
    if q.dim() == 4:                                  # HF's packed row (1, T, H, D): the kernel's own layout
        return _Llama3Attention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sink, cfg)
    out = _Llama3Attention.apply(q.contiguous().unsqueeze(0), k.contiguous().unsqueeze(0),
                                 v.contiguous().unsqueeze(0), sink, cfg)
    return out.squeeze(0)
