"""Llama3-style context parallelism for packed documents: exchange the K/V rows other ranks read, local queries.

Layout ``"contiguous"``: rank r holds packed tokens [r*L, (r+1)*L) of the global sequence described by
``cu_seqlens``. Instead of a ring, each rank receives the K/V rows that its queries can see on other ranks, and
only those: the rows of the (at most two) documents that cross its range's ends, cut to what the window lets its
queries see (``Exchange``). Every rank derives every rank's needs from ``cu_seqlens`` alone (identical on every
rank), so one all-to-all per tensor moves them, ``heads_k_stride`` K/V heads at a time (bounding the memory of
the received copy: 2 buffers x (R, stride, D) for K and V, R the rows received). Where every document stays on
one rank nothing travels at all. An all-gather of the whole sequence (what Llama 3's paper describes) would move
(N-1)*L rows to every rank; packed documents shorter than L need a small fraction of that.

Blocks, per document d overlapping our tokens [qa, qb): causally, keys [start(d), qa) are FULL and keys
[qa, qb) are aligned CAUSAL; non-causally all keys of d are FULL; a window first cuts the key range to the keys
some query sees and classifies the rest like the ring (``documents.classify``), so there is no dense (S x S)
mask in the standard cases. Key ranges are also cut at our own token range: *local* blocks (keys this rank
holds) need no received copy and run while the exchange is in flight; only *remote* blocks (documents that
cross a rank boundary) wait for it.

Backward, per head slice: half of the local blocks while the K/V exchange is in flight (their dK/dV go straight
into our results), the remote blocks (into partials over the received rows, one block per row), the partials
sent back to their owners by the reverse all-to-all, and the other half of the local blocks meanwhile; once the
partials have landed, each owner adds them into its results.

Rounding (``rounding``'s rule: every value rounded to its output dtype once; fp32 only where a value gets >= 3
contributions): out and dq are written in q's dtype, each row rounded once: a row with one block (most rows:
only documents that cross a rank boundary have remote blocks) gets a copy of it, a second block merges (adds)
into it with fp32 math, and only rows with >= 3 blocks use an fp32 accumulator. A K/V row gets one dK/dV
contribution from this rank's local blocks (their key rows are disjoint) and one from each other rank that
receives it (each rank's remote blocks have disjoint key rows too; head slices split heads, not rows), so the
partials travel in k's dtype, exact. The results are in k's dtype when no row of ours gets more than two
contributions (one rounding at most), else fp32, cast once at the end (``Exchange.accumulate``: a document
that spans a whole rank, seen by ranks on both sides, or by several ranks after it). The forward needs no fp32
buffer but the lse (1, H, L) unless a query row gets >= 3 blocks (a document would have to cross both ends of
a rank, non-causally).

Memory, for one head slice (``heads_k_stride=None``; with S slices each buffer below is 1/S of it): the
received K/V, 2 buffers of R rows each for K and V (R <= (N-1)*L; R = 0 where no document crosses into our
range); in the backward, the partials over the R received rows, the rows we sent (their gradients land there)
and the results dk/dv over our L rows, as single-GPU attention's (fp32 when ``accumulate``). The backward's
peak is its first half of local blocks (or the remote blocks): the running call's outputs and workspace for
about half of the local rows (the halves also halve that). Measured GPU and CPU peaks of the all-gather form
this replaced: benchmarks/results/README.md, "llama3 memory".

Per call, nothing is planned twice: the plan (with every rank's exchange), the fast path's segments
(cumulative lengths already on the device) and the rounding plans are cached with the cu_seqlens tensor
(``documents.CuEntry``: same object, same ``_version``), so a repeated call with the same cu_seqlens (every
layer of a step) makes no device->host copy.

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
from .checkpointing import kept_forward
from .documents import StepBuilder, VarlenCall, classify, documents_overlapping
from .merge import sink_grad
from .rounding import RowPlan, fold_grads, fold_outputs, plan_rows

__all__ = ["llama3_attn_varlen_func"]

# One all-to-all per tensor moves the K/V rows (and their gradients back); module-level so that the benchmarks'
# no-communication stand-in (benchmarks/_nocomm.py) and the tests can replace it.
all_to_all_single = dist.all_to_all_single


@dataclass(frozen=True)
class _Llama3Block:
    """One backend call: local query rows x key rows of the local K/V (``local``) or of the received rows.

    ``kv_rows``: rows of the tensor the block reads (our K/V, or the received rows); ``keys``: the same keys as
    global token positions. ``first``: the first block over these query rows (local blocks run first, and every
    query row has one: its own position is always visible); the engine's rounding plan (``rounding.plan_rows``)
    derives the same from the blocks' rows, and more: which rows get a second or a third contribution.
    """

    q_rows: slice
    kv_rows: slice
    keys: slice
    mask: BlockMask
    local: bool
    first: bool


@dataclass(frozen=True)
class Exchange:
    """The K/V rows that travel in one call, as this rank sees them (every rank derives all of them from
    ``cu_seqlens``, so the split sizes agree without a message).

    send:       per destination rank, our local rows [a, b) that its remote blocks read ((0, 0): none).
    recv:       per source rank, how many of its rows we receive. In rank order they are our remote keys in
                global order: [lo, q0) from the ranks before us, then [q1, hi) from the ranks after us.
    lo, hi:     the first received key before our range (q0 when none) and the end of those after it (q1).
    accumulate: some K/V row of ours gets >= 3 dK/dV contributions (ours and other ranks'): the results are
                accumulated in fp32 and rounded once; else they stay in k's dtype (one rounding at most).
    """

    send: Tuple[Tuple[int, int], ...]
    recv: Tuple[int, ...]
    lo: int
    hi: int
    accumulate: bool

    @property
    def send_sizes(self) -> List[int]:
        return [b - a for a, b in self.send]

    @property
    def received(self) -> int:
        return sum(self.recv)

    @property
    def sent(self) -> int:
        return sum(b - a for a, b in self.send)


@dataclass
class _Llama3Plan:
    """This rank's blocks (local ones run while the exchange is in flight) and its ``exchange`` (None when no
    rank reads another's rows: a world of one, or every document on one rank)."""

    local_blocks: List[_Llama3Block]
    remote_blocks: List[_Llama3Block]
    kind: str
    exchange: Optional[Exchange]


def _split_at(ka: int, kb: int, cuts: Tuple[int, int]) -> List[Tuple[int, int]]:
    """[ka, kb) cut at the positions ``cuts`` (our own token range's ends), empty pieces dropped."""
    points = [ka] + [c for c in cuts if ka < c < kb] + [kb]
    return [(a, b) for a, b in zip(points, points[1:]) if a < b]


def _visible(qa: int, qb: int, ka: int, kb: int, window: Tuple[int, int]) -> Tuple[int, int]:
    """[ka, kb) cut to the keys that some query in [qa, qb) sees through ``window`` (possibly empty)."""
    if window[0] >= 0:
        ka = max(ka, qa - window[0])
    if window[1] >= 0:
        kb = min(kb, qb + window[1])
    return ka, kb


_Piece = Tuple[slice, int, int, BlockMask]


def _pieces(cu: torch.Tensor, rank: int, local: int, causal: bool, window: Tuple[int, int],
            builder: StepBuilder) -> List[_Piece]:
    """(query rows, first key, end key, mask) of rank ``rank``'s blocks, per document overlapping its tokens."""
    q0, q1 = rank * local, (rank + 1) * local
    pieces: List[_Piece] = []
    for d in documents_overlapping(cu, q0, q1):
        doc_a, doc_b = int(cu[d]), int(cu[d + 1])
        qa, qb = max(doc_a, q0), min(doc_b, q1)
        # Causal: split at qa so that both parts are standard blocks (FULL before, aligned CAUSAL after);
        # then cut at our own range so that local keys need no received copy.
        key_ranges = [(doc_a, qa), (qa, qb)] if causal else [(doc_a, doc_b)]
        for ka, kb in key_ranges:
            ka, kb = _visible(qa, qb, ka, kb, window)
            for pa, pb in _split_at(ka, kb, (q0, q1)):
                kind, mask = classify(qa, qb, pa, pb, causal, window)
                if builder.keep(kind):
                    pieces.append((slice(qa - q0, qb - q0), pa, pb, mask))
    return pieces


def _remote_span(pieces: List[_Piece], q0: int, q1: int) -> Tuple[int, int]:
    """(lo, hi): the keys a rank reads from others are [lo, q0) and [q1, hi) (the pieces are cut at q0, q1)."""
    lo = min([ka for _, ka, kb, _ in pieces if kb <= q0], default=q0)
    hi = max([kb for _, ka, kb, _ in pieces if ka >= q1], default=q1)
    return lo, hi


def _most_overlapping(ranges: List[Tuple[int, int]]) -> int:
    """The largest number of ``ranges`` [a, b) that share one position."""
    events = sorted([(a, 1) for a, b in ranges if b > a] + [(b, -1) for a, b in ranges if b > a])
    most = now = 0
    for _, step in events:            # at equal positions -1 sorts first: [a, b) and [b, c) do not overlap
        now += step
        most = max(most, now)
    return most


def _exchange(spans: List[Tuple[int, int]], rank: int, local: int,
              local_keys: List[Tuple[int, int]]) -> Optional[Exchange]:
    """This rank's ``Exchange`` from every rank's remote span; None when no rank reads another's rows."""
    if all(lo == r * local and hi == (r + 1) * local for r, (lo, hi) in enumerate(spans)):
        return None
    q0, q1 = rank * local, (rank + 1) * local

    def overlap(a: int, b: int, c: int, d: int) -> Tuple[int, int]:
        lo, hi = max(a, c), min(b, d)
        return (lo, hi) if lo < hi else (0, 0)

    send, recv = [], []
    for r, (lo, hi) in enumerate(spans):
        wanted = (lo, r * local) if rank < r else (r * local + local, hi) if rank > r else (0, 0)
        a, b = overlap(*wanted, q0, q1)
        send.append((a - q0, b - q0) if b > a else (0, 0))
        ours = (spans[rank][0], q0) if r < rank else (q1, spans[rank][1]) if r > rank else (0, 0)
        a, b = overlap(*ours, r * local, r * local + local)
        recv.append(b - a)
    # Contributions per K/V row of ours: our local blocks (disjoint key rows) + every rank that receives it.
    counted = list(local_keys) + [(a + q0, b + q0) for a, b in send if b > a]
    lo, hi = spans[rank]
    return Exchange(tuple(send), tuple(recv), lo, hi, _most_overlapping(counted) >= 3)


def llama3_plan(cu: torch.Tensor, rank: int, world: int, local: int, causal: bool,
                window: Tuple[int, int]) -> _Llama3Plan:
    """Blocks of our queries (local rows) per document overlapping our tokens [q0, q0 + L), and the exchange
    of every rank's remote keys."""
    builder = StepBuilder()
    q0, q1 = rank * local, (rank + 1) * local
    pieces = _pieces(cu, rank, local, causal, window, builder)
    spans = [_remote_span(pieces, q0, q1) if r == rank else
             _remote_span(_pieces(cu, r, local, causal, window, StepBuilder()), r * local, (r + 1) * local)
             for r in range(world)]
    lo = spans[rank][0]
    local_blocks, remote_blocks, seen = [], [], set()
    for is_local in (True, False):            # execution order: local blocks, then remote ones
        for rows, ka, kb, mask in pieces:
            if (q0 <= ka and kb <= q1) != is_local:
                continue
            first = (rows.start, rows.stop) not in seen
            seen.add((rows.start, rows.stop))
            # Received rows: [lo, q0) then [q1, hi), in that order.
            at = ka - q0 if is_local else ka - lo if kb <= q0 else (q0 - lo) + (ka - q1)
            block = _Llama3Block(rows, slice(at, at + kb - ka), slice(ka, kb), mask, is_local, first)
            (local_blocks if is_local else remote_blocks).append(block)
    exchange = _exchange(spans, rank, local, [(b.keys.start, b.keys.stop) for b in local_blocks])
    return _Llama3Plan(local_blocks, remote_blocks, builder.kind, exchange)


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
    before, after = halves(plan.local_blocks) if plan.exchange else (plan.local_blocks, [])
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


def _send_rows(x: torch.Tensor, send: Tuple[Tuple[int, int], ...]) -> torch.Tensor:
    """The rows of x (L, stride, D) for each destination in rank order, one contiguous tensor (a view when
    only one destination takes rows and they are contiguous already)."""
    parts = [x[a:b] for a, b in send if b > a]
    if not parts:
        return x.new_empty((0, *x.shape[1:]))
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


class _SliceExchange:
    """All-to-alls of K/V head slices (``Exchange``) into two alternating buffers, one in flight while the other
    is used.

    k, v: (1, L, Hk, D) local; a received slice is (1, R, stride, D): our remote keys in global order. Every
    started slice must be taken with ``get`` (which waits for it) before the slice two later reuses its buffer.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cfg: _Llama3Config):
        self.k, self.v, self.cfg, self.exchange = k, v, cfg, cfg.plan.exchange
        n_bufs = min(2, k.shape[2] // cfg.stride)
        shape = (self.exchange.received, cfg.stride, k.shape[3])
        self.buffers = [(k.new_empty(shape), v.new_empty(shape)) for _ in range(n_bufs)]
        self.blocks = [(kb.unsqueeze(0), vb.unsqueeze(0)) for kb, vb in self.buffers]   # the same, as (1, R, .)
        self.pending = {}   # j -> (works, the inputs they read): both live until ``get(j)`` has waited

    def start(self, j: int) -> None:
        heads = slice(j * self.cfg.stride, (j + 1) * self.cfg.stride)
        assert j - len(self.buffers) not in self.pending, f"K/V slice {j}: its buffer is still being received"
        kbuf, vbuf = self.buffers[j % len(self.buffers)]
        # The send buffers are held with the works, not left to the backend to keep alive, until waited.
        ex = self.exchange
        inputs = tuple(_send_rows(x[0, :, heads], ex.send) for x in (self.k, self.v))
        works = [all_to_all_single(buf, part, list(ex.recv), ex.send_sizes, group=self.cfg.group, async_op=True)
                 for buf, part in zip((kbuf, vbuf), inputs)]
        self.pending[j] = (works, inputs)

    def get(self, j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Wait for slice j; received (1, R, stride, D) K and V."""
        works, _inputs = self.pending.pop(j)
        for work in works:
            work.wait()
        return self.blocks[j % len(self.blocks)]

    def release(self, j: int, slices: int) -> None:
        """Slice j's received K/V are no longer used: free their buffer when no later slice reuses it, so that
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
    return local + [b.q_rows for b in cfg.plan.remote_blocks]


def forward_pass(q4, k4, v4, cfg: _Llama3Config):
    """q4 (1, L, H, D), k4/v4 (1, L, Hk, D) -> out (1, L, H, D) in q's dtype, lse (1, H, L) fp32."""
    plan = cfg.plan
    rows = cfg.memoised(("forward rows", q4.shape[1]), lambda: _rows_plan(_forward_ranges(cfg), q4.shape[1]))
    result = _Result(q4, rows)
    slices, group_size = k4.shape[2] // cfg.stride, q4.shape[2] // k4.shape[2]
    exchange = _SliceExchange(k4, v4, cfg) if plan.exchange else None
    if exchange:
        exchange.start(0)
    for j in range(slices):
        if exchange and j + 1 < slices:
            exchange.start(j + 1)                     # the next slice travels while this one computes
        hk, hq = heads(j, cfg, group_size)
        done = _forward_local(q4, k4, v4, hk, hq, result, cfg)
        if exchange:
            _forward_blocks(plan.remote_blocks, done, q4, *exchange.get(j), hq, result, cfg)  # received meanwhile
            exchange.release(j, slices)
    return result.out, result.lse


def _disjoint(ranges: List[slice]) -> bool:
    """No row lies in two of ``ranges``."""
    spans = sorted((r.start, r.stop) for r in ranges if r.stop > r.start)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


class _Into:
    """Adds block gradients dk, dv (1, rows, stride, D) into ``dk``/``dv`` (1, T, stride, D) at their key rows.
    A row that holds 0 takes the value exactly; a row that holds one value is summed in fp32 and rounded once."""

    def __init__(self, dk: torch.Tensor, dv: torch.Tensor):
        self.dk, self.dv = dk, dv

    def __call__(self, rows: slice, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.dk[:, rows] += dk
        self.dv[:, rows] += dv


class _KVGrads:
    """dK/dV of one backward: the results ``dk``/``dv`` (1, L, Hk, D), zeroed, that our local blocks add into,
    and, per head slice when ranks exchange rows, the partials over the received rows (one remote block per row,
    in k's dtype: exact) that one all-to-all per tensor sends back to their owners (``start``), to land in the
    rows we sent and be added into the results (``finish``).

    The results are in k's dtype, or fp32 when a row of ours gets >= 3 contributions (``Exchange.accumulate``;
    the caller casts once). Every row: (our local block or 0) + (each receiving rank's partial or 0).
    """

    def __init__(self, k4: torch.Tensor, cfg: _Llama3Config):
        self.cfg, self.exchange = cfg, cfg.plan.exchange
        # Checked once per plan (the memo is shared by the calls of one cu_seqlens), not on every backward.
        assert cfg.memoised("kv rows disjoint", lambda: (_disjoint([b.kv_rows for b in cfg.plan.local_blocks]),
                                                        _disjoint([b.kv_rows for b in cfg.plan.remote_blocks]))) \
            == (True, True), "local (or remote) blocks share K/V rows"
        wide = self.exchange is not None and self.exchange.accumulate
        dtype = torch.float32 if wide else k4.dtype
        self.dk, self.dv = (torch.zeros(k4.shape, dtype=dtype, device=k4.device) for _ in range(2))
        if self.exchange is not None:
            d = k4.shape[3]
            new = lambda rows: k4.new_empty((rows, cfg.stride, d))  # noqa: E731
            self.partials = (new(self.exchange.received), new(self.exchange.received))
            self.landed = (new(self.exchange.sent), new(self.exchange.sent))
        self.pending = None                                # (j, works) of the all-to-all in flight

    def local(self, hk: slice) -> _Into:
        """Where our local blocks add: the results at K/V heads ``hk``."""
        return _Into(self.dk[:, :, hk], self.dv[:, :, hk])

    def remote(self, j: int) -> _Into:
        """Where the remote blocks of slice j add: its zeroed partials; the previous slice has finished."""
        assert self.pending is None, f"dK/dV slice {self.pending[0]} was never finished"
        return _Into(*(x.zero_().unsqueeze(0) for x in self.partials))

    def start(self, j: int) -> None:
        """Send slice j's partials back to the ranks that own their rows."""
        ex = self.exchange
        self.pending = (j, [all_to_all_single(out, part, ex.send_sizes, list(ex.recv), group=self.cfg.group,
                                              async_op=True) for out, part in zip(self.landed, self.partials)])

    def finish(self, j: int) -> None:
        """Wait for slice j's partials and add them into the results at the rows each destination read."""
        pending_j, works = self.pending
        assert pending_j == j, (pending_j, j)
        for work in works:
            work.wait()
        self.pending = None
        heads = slice(j * self.cfg.stride, (j + 1) * self.cfg.stride)
        at = 0
        for a, b in self.exchange.send:
            if b > a:
                for result, landed in zip((self.dk, self.dv), self.landed):
                    result[0, a:b, heads] += landed[at:at + b - a]
                at += b - a


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
    dk/dv go to ``sink(kv_rows, dk, dv)`` (an ``_Into``). Returns the next contribution index."""
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
    return local[0] + [b.q_rows for b in cfg.plan.remote_blocks] + local[1]


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
    """Gradients dq (1, L, H, D) in q's dtype, dk, dv (1, L, Hk, D) in k's dtype or fp32 (``_KVGrads``) from the
    merged out4 (1, L, H, D) and lse (1, H, L).

    Per head slice: half of the local blocks while its K/V exchange is in flight, the remote blocks, their
    partials sent back to the owners, then the other half of the local blocks meanwhile.
    """
    plan = cfg.plan
    slices, group_size = k4.shape[2] // cfg.stride, q4.shape[2] // k4.shape[2]
    before, after = cfg.memoised("halves", lambda: halves(plan.local_blocks) if plan.exchange
                                 else (plan.local_blocks, []))
    dq = _QueryGrads(q4, cfg.memoised(("backward rows", q4.shape[1]), lambda: _rows_plan(
        _backward_ranges(cfg, before, after), q4.shape[1])))
    if cfg.fast is not None:                          # the same halves as packed-document calls
        before, after = cfg.fast.before, cfg.fast.after
    grads = _KVGrads(k4, cfg)
    exchange = _SliceExchange(k4, v4, cfg) if plan.exchange else None
    if exchange:
        exchange.start(0)
    for j in range(slices):
        if exchange and j + 1 < slices:
            exchange.start(j + 1)
        hk, hq = heads(j, cfg, group_size)
        common = (dout4, q4, out4, lse, k4, v4, hk, hq, dq)
        done = _backward_local(before, 0, *common, grads.local(hk), cfg)
        if not exchange:
            continue
        done = _backward_blocks(plan.remote_blocks, done, dout4, q4, out4, lse, *exchange.get(j), hq, dq,
                                grads.remote(j), cfg)
        exchange.release(j, slices)
        grads.start(j)                                # back to their owners while the rest computes
        _backward_local(after, done, *common, grads.local(hk), cfg)
        grads.finish(j)
    return dq.dq, grads.dk, grads.dv


class _Llama3Attention(torch.autograd.Function):
    """q (1, L, H, D), k, v (1, L, Hk, D), sink (H,) or None -> out (1, L, H, D); the entry point adds/drops the
    batch dim. A sink is folded into the finished (out, lse) as the ring engine does (``merge.fold_sink``); a
    recomputation of a kept checkpoint region takes the forward's out and lse, no exchange."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cfg: _Llama3Config):
        # out in q's dtype, each row rounded once
        forward = kept_forward(q, "llama3_attn_varlen_func", sink, lambda: forward_pass(q, k, v, cfg))
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, forward.out, forward.lse, *((sink,) if sink is not None else ()))
        return forward.out

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
            f"{fn}: heads_k_stride={heads_k_stride} must divide nheads_k={nheads_k} (K/V heads are exchanged "
            f"heads_k_stride at a time); use one of {divisors}, or None to exchange all K/V heads at once")
    return heads_k_stride


def llama3_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=False, softmax_scale=None,
                            backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0,
                            heads_k_stride: Optional[int] = None, sink=None):
    """Attention over packed documents sharded contiguously; each rank receives the K/V rows its queries see
    on other ranks (Llama 3 style, without gathering the rest).

    q: (T_local, H, D); k, v: (T_local, Hk, D), H % Hk == 0 — or all three as HF's packed row (1, T_local,
    H|Hk, D), used as is (no view); rank r holds packed tokens [r*T_local, (r+1)*T_local) of the global sequence
    described by ``cu_seqlens`` (int32 (num_docs + 1,), identical on every rank). ``heads_k_stride`` K/V heads
    are exchanged at a time (None = all; it must divide Hk): peak extra memory is 2 x 2 x (R, heads_k_stride, D),
    R <= (N-1)*T_local the rows received (those of the documents that cross into our range). Returns out
    (T_local, H, D), or (1, T_local, H, D) for 4-D q; differentiable.
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
