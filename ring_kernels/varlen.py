"""Varlen ring attention: packed documents, contiguous (``ring``) and ``zigzag`` layouts.

A packed sequence holds documents back to back; ``cu_seqlens`` (int, (num_docs + 1,)) are the cumulative
lengths of the *global* packed sequence, identical on every rank. Documents are independent: a token attends
only to tokens of its own document (causally when ``causal=True``). Tensors are (local_tokens, nheads, headdim),
or all of q, k, v one packed row (1, local_tokens, nheads, headdim) as HF passes them: that is the engine's own
batch-1 layout, so the 4-D form runs without a view and returns out of q's rank (3-D inputs get one unsqueeze).

The ring engine of ``ring.py`` runs unchanged on batch 1: a varlen layout only decides which blocks one ring
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
validated and planned from ONCE per tensor object and version (``_cu_entry``, an LRU of 8 keyed safely by the
tensor itself); a repeated call (every layer of a step passes the same tensor) reuses the validation, the steps,
the ring engine's contribution plan and the device tensors of the fast path: no device sync, no planning.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _validate
from .backends import CAUSAL, EMPTY, FULL, GENERAL, get_backend
from .backends.base import BlockBackend, BlockMask
from .backends.torch_cuda_varlen import VarlenKernel, VarlenSegments, segments_from_lengths, varlen_kernel_for
from .comm import group_rank_and_size
from .ring import _Block, _Plan, _RingAttention, _RingConfig, _plan

__all__ = ["ring_attn_varlen_func", "zigzag_ring_attn_varlen_func"]

_FULL_MASK = BlockMask()
_KIND_ORDER = {EMPTY: 0, FULL: 1, CAUSAL: 2, GENERAL: 3}
_UNBOUNDED = float("inf")


# ------------------------------------------------------------------------------------- classification


def _classify(qa: int, qb: int, ka: int, kb: int, causal: bool, window: Tuple[int, int]) -> Tuple[str, BlockMask]:
    """Kind and mask of queries at global positions [qa, qb) against keys [ka, kb) of the same document.

    A query q sees a key k when ``q - left <= k <= q + right`` (causal caps ``right`` at 0; -1 = unbounded).
    Computed from the interval ends only (no dense mask): EMPTY when no pair is visible, FULL when all are,
    aligned CAUSAL when q and k cover the same positions and the window does not bind, else GENERAL.
    """
    left = window[0] if window[0] >= 0 else _UNBOUNDED
    right = window[1] if window[1] >= 0 else _UNBOUNDED
    if causal:
        right = min(right, 0)
    # Keys visible from some query lie in [qa - left, qb - 1 + right]; from every query in [qb-1-left, qa+right].
    if ka > qb - 1 + right or kb - 1 < qa - left:
        return EMPTY, _FULL_MASK
    if kb - 1 <= qa + right and ka >= qb - 1 - left:
        return FULL, _FULL_MASK
    if causal and qa == ka and qb == kb and left >= qb - qa - 1:
        return CAUSAL, BlockMask(causal=True, q_start=qa, k_start=ka)
    return GENERAL, BlockMask(causal=causal, q_start=qa, k_start=ka, window=window)


class _StepBuilder:
    """Collects the blocks of one ring step and the most general mask kind over all steps."""

    def __init__(self):
        self.kind = EMPTY

    def keep(self, kind: str) -> bool:
        """Record a block's kind; False for an EMPTY block, which is skipped."""
        if _KIND_ORDER[kind] > _KIND_ORDER[self.kind]:
            self.kind = kind
        return kind != EMPTY

    def add(self, blocks: List[_Block], kind: str, mask: BlockMask, q_rows: slice, kv_rows: slice) -> None:
        if q_rows.stop > q_rows.start and kv_rows.stop > kv_rows.start and self.keep(kind):
            blocks.append(_Block(q_rows, kv_rows, mask))


# ------------------------------------------------------------------------------------------- planners


def _documents_overlapping(cu: torch.Tensor, start: int, end: int) -> range:
    """Indices of the documents with at least one token in [start, end) of the packed stream."""
    if end <= start:
        return range(0)
    first = int(torch.searchsorted(cu, torch.tensor(start), right=True)) - 1
    last = int(torch.searchsorted(cu, torch.tensor(end - 1), right=True)) - 1
    return range(first, last + 1)


def _ring_varlen_steps(cu: torch.Tensor, rank: int, world: int, local: int, causal: bool,
                       window: Tuple[int, int]) -> Tuple[List[List[_Block]], str]:
    """Contiguous layout: step s computes our tokens against those of rank (rank - s) mod N, per document."""
    builder = _StepBuilder()
    q0 = rank * local
    steps = []
    for step in range(world):
        src = (rank - step) % world
        k0 = src * local
        blocks: List[_Block] = []
        steps.append(blocks)
        if causal and src > rank:   # every key comes after every query: nothing to compute, only to pass on
            continue
        for d in _documents_overlapping(cu, q0, q0 + local):
            doc_a, doc_b = int(cu[d]), int(cu[d + 1])
            qa, qb = max(doc_a, q0), min(doc_b, q0 + local)
            ka, kb = max(doc_a, k0), min(doc_b, k0 + local)
            if qa < qb and ka < kb:
                kind, mask = _classify(qa, qb, ka, kb, causal, window)
                builder.add(blocks, kind, mask, slice(qa - q0, qb - q0), slice(ka - k0, kb - k0))
    return steps, builder.kind


def _zigzag_varlen_steps(cu: torch.Tensor, rank: int, world: int, causal: bool,
                         window: Tuple[int, int]) -> Tuple[List[List[_Block]], str]:
    """Zigzag layout per document (see the module docstring); every document length divides by 2N."""
    builder = _StepBuilder()
    lengths = (cu[1:] - cu[:-1]).tolist()
    starts = cu[:-1].tolist()
    steps = []
    for step in range(world):
        src = (rank - step) % world
        blocks: List[_Block] = []
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
                builder.add(blocks, FULL, _FULL_MASK, slice(lo, lo + 2 * c), slice(lo, lo + c))
            else:                                      # only the late query chunk 2N-1-r sees, and sees both
                builder.add(blocks, FULL, _FULL_MASK, slice(lo + c, lo + 2 * c), slice(lo, lo + 2 * c))
        steps.append(blocks)
    return steps, builder.kind


def _zigzag_window_blocks(builder: _StepBuilder, blocks: List[_Block], start: int, lo: int, c: int, rank: int,
                          src: int, world: int, window: Tuple[int, int]) -> None:
    """With a window: one block per (query chunk, key chunk) pair, classified from global positions."""
    for q_chunk, q_off in ((rank, 0), (2 * world - 1 - rank, c)):
        for k_chunk, k_off in ((src, 0), (2 * world - 1 - src, c)):
            qa, ka = start + q_chunk * c, start + k_chunk * c
            kind, mask = _classify(qa, qa + c, ka, ka + c, True, window)
            builder.add(blocks, kind, mask, slice(lo + q_off, lo + q_off + c), slice(lo + k_off, lo + k_off + c))


# ---------------------------------------------------------------------------------------- validation


def _check_cu_type(fn: str, cu_seqlens) -> None:
    """A 1-D integer tensor (metadata only: no device sync)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: cu_seqlens must be a 1-D int32 torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise _validate.RingInputError(
            f"{fn}: cu_seqlens has dtype {cu_seqlens.dtype} and shape {tuple(cu_seqlens.shape)}; expected a 1-D "
            f"integer tensor (int32) of cumulative document lengths starting at 0")


def _check_cu_seqlens(fn: str, cu_seqlens) -> torch.Tensor:
    """cu_seqlens as a CPU int64 tensor (num_docs + 1,), starting at 0, non-decreasing.
    On CUDA the copy waits for every queued kernel: call through ``_cu_entry``, which does it once per tensor."""
    _check_cu_type(fn, cu_seqlens)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise _validate.RingInputError(
            f"{fn}: cu_seqlens={cu.tolist()[:16]}{'...' if cu.numel() > 16 else ''} must start at 0 and be "
            f"non-decreasing (cumulative lengths of the global packed sequence)")
    return cu


def _cu_fingerprint(cu: torch.Tensor) -> float:
    """A number that differs when two ranks pass different cu_seqlens (exact in float64 for realistic sizes)."""
    weights = torch.arange(1, cu.numel() + 1, dtype=torch.int64)
    return float(int((cu * weights).sum()) % (1 << 52))


# ------------------------------------------------------------------------------ host cache of cu_seqlens
#
# hfpatch calls these functions once per attention layer with THE SAME cu_seqlens tensor for every layer of a
# step. Copying it to the host (and planning from it) on every call costs a device->host copy that waits for
# every queued kernel (the GPU idles while the host plans). The cache below keeps, per cu_seqlens object, its
# validated CPU copy and everything planned from it, so that a repeated call does no copy and no planning.
#
# Safety: an entry is keyed by ``id(cu_seqlens)`` but only answers for the very object it was built from
# (a weak reference to it is alive and ``is`` the tensor), unmodified since (``_version``, bumped by every
# in-place write through the tensor or a view sharing its version counter), on the same device, dtype and
# shape. A dead weak reference never matches, so an id reused by a new tensor is a miss. Writes that bypass the
# version counter (``.data``, or another tensor made with ``.data`` / ``set_`` over the same storage) are not
# seen: do not modify cu_seqlens that way between calls. Inference-mode tensors have no version counter: they
# are validated on every call (not cached). A new tensor with equal content is a miss (identity, not content).

_CU_CACHE_SIZE = 8          # cu_seqlens tensors remembered (LRU): one per step in flight is typical
_DERIVED_PER_TENSOR = 16    # plans per tensor (rank/world/local/causal/window/layout combinations), LRU
_CU_CACHE: "OrderedDict[int, _CuEntry]" = OrderedDict()
_CU_CACHE_STATS = {"hits": 0, "misses": 0}   # counted for tests and benchmarks
# Guards the LRU bookkeeping (two threads calling at once must not evict under each other); plans are computed
# outside it (a racing duplicate computes the same value twice, harmlessly).
_CU_LOCK = threading.Lock()


class _CuEntry:
    """What one cu_seqlens tensor gives on the host: ``cu`` (CPU int64 (num_docs + 1,), validated), ``total``
    (cu[-1]), ``fingerprint`` (``_cu_fingerprint``), and ``derived`` plans (``get``)."""

    __slots__ = ("ref", "version", "device", "dtype", "shape", "cu", "total", "fingerprint", "derived")

    def __init__(self, tensor: torch.Tensor, version: Optional[int], cu: torch.Tensor):
        self.ref = weakref.ref(tensor)
        self.version, self.device, self.dtype, self.shape = version, tensor.device, tensor.dtype, tensor.shape
        self.cu = cu
        self.total = int(cu[-1])                      # cu is on the host: no device sync
        self.fingerprint = _cu_fingerprint(cu)
        self.derived: "OrderedDict[tuple, object]" = OrderedDict()

    def matches(self, tensor: torch.Tensor) -> bool:
        """The entry was built from ``tensor`` itself, and it has not changed since (metadata only: no sync)."""
        return (self.ref() is tensor and tensor._version == self.version and tensor.device == self.device
                and tensor.dtype == self.dtype and tensor.shape == self.shape)

    def get(self, key: tuple, compute: Callable[[], object]):
        """The plan under ``key`` (a tuple of everything besides cu_seqlens that it depends on), computed once.
        A computation that raises stores nothing (the next call raises again)."""
        with _CU_LOCK:
            value = self.derived.get(key, _MISSING)
            if value is not _MISSING:
                self.derived.move_to_end(key)
                return value
        value = compute()
        with _CU_LOCK:
            self.derived[key] = value
            while len(self.derived) > _DERIVED_PER_TENSOR:
                self.derived.popitem(last=False)
        return value


_MISSING = object()


def _cu_entry(fn: str, cu_seqlens) -> _CuEntry:
    """The cache entry of ``cu_seqlens`` (validated once per object and version; errors as ``_check_cu_seqlens``).
    A hit reads tensor metadata only: no device->host copy, no ``.item()``."""
    _check_cu_type(fn, cu_seqlens)
    if cu_seqlens.is_inference():                     # no version counter: an in-place write would go unseen
        _CU_CACHE_STATS["misses"] += 1
        return _CuEntry(cu_seqlens, None, _check_cu_seqlens(fn, cu_seqlens))
    key = id(cu_seqlens)
    with _CU_LOCK:
        entry = _CU_CACHE.get(key)
        if entry is not None and entry.matches(cu_seqlens):
            _CU_CACHE.move_to_end(key)
            _CU_CACHE_STATS["hits"] += 1
            return entry
        _CU_CACHE_STATS["misses"] += 1
    version = cu_seqlens._version                     # read before the copy: the copy is of this version
    entry = _CuEntry(cu_seqlens, version, _check_cu_seqlens(fn, cu_seqlens))   # raises before storing
    with _CU_LOCK:
        _CU_CACHE[key] = entry
        _CU_CACHE.move_to_end(key)
        while len(_CU_CACHE) > _CU_CACHE_SIZE:
            _CU_CACHE.popitem(last=False)
    return entry


def _clear_cu_cache() -> None:
    """Forget every cached cu_seqlens (and the plans and device tensors built from them); reset the counters."""
    with _CU_LOCK:
        _CU_CACHE.clear()
        _CU_CACHE_STATS.update(hits=0, misses=0)


class _VarlenCall:
    """Validated arguments of one varlen call: rank, world, cu (CPU int64) and its cache ``entry``, local
    tokens, scale, window. No device sync when cu_seqlens is cached (``_cu_entry``) and the ranks' check is
    skipped (a world of one, or ``rank_check_scope``)."""

    def __init__(self, fn: str, q, k, v, cu_seqlens, *, group, causal, softmax_scale, window_size, softcap,
                 dropout_p, layout_code: int, extra_fields: Sequence[Tuple[str, float]] = ()):
        _validate.check_qkv(fn, q, k, v, varlen=True)
        self.window = _validate.check_options(fn, window_size=window_size, softcap=softcap, dropout_p=dropout_p)
        self.scale = _validate.resolve_scale(fn, softmax_scale, q.shape[-1])
        self.softcap = float(softcap)
        self.causal = bool(causal)
        self.entry = _cu_entry(fn, cu_seqlens)
        self.cu = self.entry.cu
        self.rank, self.world = group_rank_and_size(group)
        t, h, d = q.shape[-3:]                        # (T, H, D) or HF's packed row (1, T, H, D)
        self.local = t
        fields = [("layout", layout_code), ("local_tokens", t), ("nheads", h), ("nheads_k", k.shape[-2]),
                  ("headdim", d), ("dtype", _validate.dtype_code(q.dtype)), ("causal", int(self.causal)),
                  ("softmax_scale", self.scale), ("softcap", self.softcap), ("window_left", self.window[0]),
                  ("window_right", self.window[1]), ("cu_seqlens length", self.cu.numel()),
                  ("cu_seqlens[-1]", self.entry.total), ("cu_seqlens fingerprint", self.entry.fingerprint),
                  *extra_fields]
        if self.world > 1:
            _validate.check_ranks_agree(fn, group, fields, q.device)
        # Checked after the ranks agreed on the shapes, so that every rank raises (none waits in a collective).
        if self.local == 0:
            raise _validate.RingInputError(
                f"{fn}: q has 0 local tokens (shape {tuple(q.shape)}); every rank must hold at least one token "
                f"of the packed sequence (shard it with ring_kernels.shard(x, dim=0, cu_seqlens=..., layout=...))")
        total = self.local * self.world
        if self.entry.total != total:
            raise _validate.RingInputError(
                f"{fn}: cu_seqlens[-1]={self.entry.total} but the group holds {self.world} ranks x {self.local} "
                f"local tokens = {total}; cu_seqlens must be the cumulative lengths of the whole (global) packed "
                f"sequence, identical on every rank, and every rank must hold the same number of tokens")


def _check_zigzag_documents(fn: str, cu: torch.Tensor, world: int) -> None:
    lengths = cu[1:] - cu[:-1]
    bad = torch.nonzero(lengths % (2 * world) != 0).flatten()
    if bad.numel():
        d = int(bad[0])
        raise _validate.RingInputError(
            f"{fn}: document {d} of cu_seqlens (tokens {int(cu[d])}..{int(cu[d + 1])}) has length "
            f"{int(lengths[d])}, not divisible by 2 x world_size = {2 * world} ({bad.numel()} document(s) "
            f"affected); the zigzag layout cuts every document into {2 * world} equal chunks: pad each document "
            f"to a multiple of {2 * world}, or use ring_attn_varlen_func / llama3_attn_varlen_func")


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


def _one_block_per_step(blocks: List[_Block], device) -> Optional[_Block]:
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
    return _Block(slice(q0, q1), slice(k0, k1), mask)


def _batched_steps(steps: List[List[_Block]], device) -> Optional[List[List[_Block]]]:
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


Steps = List[List[_Block]]


class _RingPrepared:
    """The host plan of one ring/zigzag varlen call (cached per cu_seqlens: ``_CuEntry.get``).

    ``steps``: the per-document blocks of every ring step; ``kind``: their most general mask kind; ``sizes``:
    every block's (query rows, key rows), for ``varlen_kernel_for``; ``local``: tokens per rank. Filled on
    first use: the ring engine's contribution plan (``ring._plan``) of ``steps``, and per device the varlen
    fast path's batched steps (one block per step, index/cumulative-length tensors already on the device)
    with their own plan -- so a repeated call plans nothing and copies nothing to the device.
    """

    def __init__(self, steps: Steps, kind: str, local: int):
        self.steps, self.kind, self.local = steps, kind, local
        self.sizes = [(b.q_rows.stop - b.q_rows.start, b.kv_rows.stop - b.kv_rows.start)
                      for step in steps for b in step]
        self._plan: Optional[_Plan] = None
        self._batched: Dict[torch.device, Optional[Tuple[Steps, _Plan]]] = {}

    def per_block(self) -> Tuple[Steps, _Plan]:
        """The per-document steps and their contribution plan."""
        if self._plan is None:
            self._plan = _plan(self.steps, self.local, self.local)
        return self.steps, self._plan

    def batched(self, device: torch.device) -> Optional[Tuple[Steps, _Plan]]:
        """Every step as one ``_StepMask`` block on ``device`` and their plan, or None (cannot be batched)."""
        if device not in self._batched:
            steps = _batched_steps(self.steps, device)
            self._batched[device] = None if steps is None else (steps, _plan(steps, self.local, self.local))
        return self._batched[device]


def _ring_prepared(call: _VarlenCall) -> _RingPrepared:
    key = ("ring", call.rank, call.world, call.local, call.causal, call.window)
    return call.entry.get(key, lambda: _RingPrepared(
        *_ring_varlen_steps(call.cu, call.rank, call.world, call.local, call.causal, call.window), call.local))


def _zigzag_prepared(fn: str, call: _VarlenCall) -> _RingPrepared:
    # The documents' check is cached only once it passed (a failing one raises again on every call).
    call.entry.get(("zigzag documents", call.world), lambda: _check_zigzag_documents(fn, call.cu, call.world))
    key = ("zigzag", call.rank, call.world, call.local, call.causal, call.window)
    return call.entry.get(key, lambda: _RingPrepared(
        *_zigzag_varlen_steps(call.cu, call.rank, call.world, call.causal, call.window), call.local))


def _run_ring_varlen(q, k, v, call: _VarlenCall, prepared: _RingPrepared, backend: str, group):
    """Pick the backend for the most general block kind and run the ring engine on batch 1 (plans from
    ``prepared``: the engine's ``_RingConfig.plan`` is passed in, not recomputed)."""
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
    cfg = _RingConfig(steps, chosen, call.scale, call.softcap, group, call.rank, call.world, plan=plan)
    if q.dim() == 4:                                  # a packed row (1, T, H, D) is the engine's own layout
        return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), cfg)
    out = _RingAttention.apply(q.contiguous().unsqueeze(0), k.contiguous().unsqueeze(0),
                               v.contiguous().unsqueeze(0), cfg)
    return out.squeeze(0)


def ring_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=False, softmax_scale=None, backend="auto",
                          window_size=(-1, -1), softcap=0.0, dropout_p=0.0):
    """Ring attention over packed documents sharded contiguously (layout ``"contiguous"``).

    q: (T_local, H, D); k, v: (T_local, Hk, D), H % Hk == 0 — or all three as HF's packed row (1, T_local, H|Hk,
    D), used as is (no view); rank r holds packed tokens [r*T_local, (r+1)*T_local) of the global sequence
    described by ``cu_seqlens`` (int32 (num_docs + 1,), identical on every rank; documents may cross rank
    boundaries). Returns out (T_local, H, D), or (1, T_local, H, D) for 4-D q, in q's dtype; differentiable.
    ``window_size`` (left, right) and ``softcap`` follow flash-attn; ``dropout_p`` must be 0.
    """
    fn = "ring_attn_varlen_func"
    call = _VarlenCall(fn, q, k, v, cu_seqlens, group=group, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, dropout_p=dropout_p, layout_code=10)
    return _run_ring_varlen(q, k, v, call, _ring_prepared(call), backend, group)


def zigzag_ring_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=True, softmax_scale=None,
                                 backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0):
    """Causal ring attention over packed documents in the varlen ``"zigzag"`` layout.

    Every document of the global ``cu_seqlens`` is cut into 2N chunks; rank r holds chunk r then chunk 2N-1-r
    of each document, documents in order (``ring_kernels.shard(x, layout="zigzag", dim=0, cu_seqlens=...)``).
    q: (T_local, H, D); k, v: (T_local, Hk, D) — or all three 4-D with batch 1 (HF's packed row, no view);
    out has q's shape. Each document length must be divisible by 2N.
    ``causal=False`` raises (use ``ring_attn_varlen_func``).
    """
    fn = "zigzag_ring_attn_varlen_func"
    _validate.require_causal(fn, causal, alternative="ring_attn_varlen_func")
    call = _VarlenCall(fn, q, k, v, cu_seqlens, group=group, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, dropout_p=dropout_p, layout_code=11)
    return _run_ring_varlen(q, k, v, call, _zigzag_prepared(fn, call), backend, group)
