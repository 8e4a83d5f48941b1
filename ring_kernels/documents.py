"""Packed documents: the planning shared by the varlen ring layouts (``varlen``) and llama3 (``llama3``).

A packed sequence holds documents back to back; ``cu_seqlens`` (int, (num_docs + 1,)) are the cumulative
lengths of the *global* packed sequence, identical on every rank. A token attends only to tokens of its own
document (causally when ``causal=True``, within ``window_size`` when given).

- ``classify``: the kind (EMPTY, FULL, aligned CAUSAL, GENERAL) and mask of a range of queries against a range
  of keys of one document, from the range ends only (no dense mask); ``StepBuilder`` collects such blocks and
  their most general kind; ``documents_overlapping``: which documents touch a token range.
- ``VarlenCall``: the validated arguments of one varlen call (shapes, options, the ranks' agreement, and
  cu_seqlens against the group's token count), with ``entry``: the host cache of its cu_seqlens.

Host cache of cu_seqlens: hfpatch calls the varlen functions once per attention layer with THE SAME
cu_seqlens tensor for every layer of a step. Copying it to the host (and planning from it) on every call costs
a device->host copy that waits for every queued kernel. The cache keeps, per cu_seqlens object, its validated
CPU copy and everything planned from it (``CuEntry.get``), so a repeated call does no copy and no planning.
``clear_cu_cache()`` forgets it all.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import validation
from .backends import CAUSAL, EMPTY, FULL, GENERAL
from .backends.base import BlockMask
from .comm import group_rank_and_size
from .engine import Block
from .entry import KernelCall

__all__ = ["FULL_MASK", "classify", "StepBuilder", "documents_overlapping", "CuEntry", "cu_entry", "VarlenCall",
           "clear_cu_cache"]

FULL_MASK = BlockMask()
_KIND_ORDER = {EMPTY: 0, FULL: 1, CAUSAL: 2, GENERAL: 3}
_UNBOUNDED = float("inf")


# ------------------------------------------------------------------------------------- classification


def classify(qa: int, qb: int, ka: int, kb: int, causal: bool, window: Tuple[int, int]) -> Tuple[str, BlockMask]:
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
        return EMPTY, FULL_MASK
    if kb - 1 <= qa + right and ka >= qb - 1 - left:
        return FULL, FULL_MASK
    if causal and qa == ka and qb == kb and left >= qb - qa - 1:
        return CAUSAL, BlockMask(causal=True, q_start=qa, k_start=ka)
    return GENERAL, BlockMask(causal=causal, q_start=qa, k_start=ka, window=window)


class StepBuilder:
    """Collects the blocks of one ring step and the most general mask kind over all steps."""

    def __init__(self):
        self.kind = EMPTY

    def keep(self, kind: str) -> bool:
        """Record a block's kind; False for an EMPTY block, which is skipped."""
        if _KIND_ORDER[kind] > _KIND_ORDER[self.kind]:
            self.kind = kind
        return kind != EMPTY

    def add(self, blocks: List[Block], kind: str, mask: BlockMask, q_rows: slice, kv_rows: slice) -> None:
        if q_rows.stop > q_rows.start and kv_rows.stop > kv_rows.start and self.keep(kind):
            blocks.append(Block(q_rows, kv_rows, mask))



def documents_overlapping(cu: torch.Tensor, start: int, end: int) -> range:
    """Indices of the documents with at least one token in [start, end) of the packed stream."""
    if end <= start:
        return range(0)
    first = int(torch.searchsorted(cu, torch.tensor(start), right=True)) - 1
    last = int(torch.searchsorted(cu, torch.tensor(end - 1), right=True)) - 1
    return range(first, last + 1)


# ---------------------------------------------------------------------------------------- validation


def _check_cu_type(fn: str, cu_seqlens) -> None:
    """A 1-D integer tensor (metadata only: no device sync)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: cu_seqlens must be a 1-D int32 torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise validation.RingInputError(
            f"{fn}: cu_seqlens has dtype {cu_seqlens.dtype} and shape {tuple(cu_seqlens.shape)}; expected a 1-D "
            f"integer tensor (int32) of cumulative document lengths starting at 0")


def _check_cu_seqlens(fn: str, cu_seqlens) -> torch.Tensor:
    """cu_seqlens as a CPU int64 tensor (num_docs + 1,), starting at 0, non-decreasing.
    On CUDA the copy waits for every queued kernel: call through ``cu_entry``, which does it once per tensor."""
    _check_cu_type(fn, cu_seqlens)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise validation.RingInputError(
            f"{fn}: cu_seqlens={cu.tolist()[:16]}{'...' if cu.numel() > 16 else ''} must start at 0 and be "
            f"non-decreasing (cumulative lengths of the global packed sequence)")
    return cu


def _cu_fingerprint(cu: torch.Tensor) -> float:
    """A number that differs when two ranks pass different cu_seqlens (exact in float64 for realistic sizes)."""
    weights = torch.arange(1, cu.numel() + 1, dtype=torch.int64)
    return float(int((cu * weights).sum()) % (1 << 52))


# ------------------------------------------------------------------------------ host cache of cu_seqlens
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
CU_CACHE: "OrderedDict[int, CuEntry]" = OrderedDict()
CU_CACHE_STATS = {"hits": 0, "misses": 0}   # counted for tests and benchmarks
# Guards the LRU bookkeeping (two threads calling at once must not evict under each other); plans are computed
# outside it (a racing duplicate computes the same value twice, harmlessly).
_CU_LOCK = threading.Lock()


class CuEntry:
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


def cu_entry(fn: str, cu_seqlens) -> CuEntry:
    """The cache entry of ``cu_seqlens`` (validated once per object and version; errors as ``_check_cu_seqlens``).
    A hit reads tensor metadata only: no device->host copy, no ``.item()``."""
    _check_cu_type(fn, cu_seqlens)
    if cu_seqlens.is_inference():                     # no version counter: an in-place write would go unseen
        CU_CACHE_STATS["misses"] += 1
        return CuEntry(cu_seqlens, None, _check_cu_seqlens(fn, cu_seqlens))
    key = id(cu_seqlens)
    with _CU_LOCK:
        entry = CU_CACHE.get(key)
        if entry is not None and entry.matches(cu_seqlens):
            CU_CACHE.move_to_end(key)
            CU_CACHE_STATS["hits"] += 1
            return entry
        CU_CACHE_STATS["misses"] += 1
    version = cu_seqlens._version                     # read before the copy: the copy is of this version
    entry = CuEntry(cu_seqlens, version, _check_cu_seqlens(fn, cu_seqlens))   # raises before storing
    with _CU_LOCK:
        CU_CACHE[key] = entry
        CU_CACHE.move_to_end(key)
        while len(CU_CACHE) > _CU_CACHE_SIZE:
            CU_CACHE.popitem(last=False)
    return entry


def clear_cu_cache() -> None:
    """Forget every cached cu_seqlens (and the plans and device tensors built from them); reset the counters."""
    with _CU_LOCK:
        CU_CACHE.clear()
        CU_CACHE_STATS.update(hits=0, misses=0)


class VarlenCall(KernelCall):
    """Validated arguments of one varlen call (``entry.KernelCall``'s prologue, cu_seqlens in its second step):
    rank, world, cu (CPU int64) and its cache ``entry``, local tokens, scale, window. No device sync when
    cu_seqlens is cached (``cu_entry``) and the ranks' check is skipped (a world of one, or ``rank_check_scope``)."""

    def __init__(self, fn: str, q, k, v, cu_seqlens, *, group, causal, softmax_scale, window_size, softcap,
                 dropout_p, sink, layout_code: int, extra_fields: Sequence[Tuple[str, float]] = ()):
        super().__init__(fn, q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                         softcap=softcap, dropout_p=dropout_p, sink=sink, varlen=True)
        self.entry = cu_entry(fn, cu_seqlens)
        self.cu = self.entry.cu
        self.rank, self.world = group_rank_and_size(group)
        self.local = q.shape[-3]                      # (T, H, D) or HF's packed row (1, T, H, D)
        tail = [("cu_seqlens length", self.cu.numel()), ("cu_seqlens[-1]", self.entry.total),
                ("cu_seqlens fingerprint", self.entry.fingerprint), ("sink", int(self.has_sink)), *extra_fields]
        self.agree(group, self.fields(layout_code, q, k, [("local_tokens", self.local)], tail), q.device)
        # Checked after the ranks agreed on the shapes, so that every rank raises (none waits in a collective).
        if self.local == 0:
            raise validation.RingInputError(
                f"{fn}: q has 0 local tokens (shape {tuple(q.shape)}); every rank must hold at least one token "
                f"of the packed sequence (shard it with ring_kernels.shard(x, dim=0, cu_seqlens=..., layout=...))")
        total = self.local * self.world
        if self.entry.total != total:
            raise validation.RingInputError(
                f"{fn}: cu_seqlens[-1]={self.entry.total} but the group holds {self.world} ranks x {self.local} "
                f"local tokens = {total}; cu_seqlens must be the cumulative lengths of the whole (global) packed "
                f"sequence, identical on every rank, and every rank must hold the same number of tokens")
