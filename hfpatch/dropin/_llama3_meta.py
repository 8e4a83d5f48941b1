"""ring-flash-attn's per-rank llama3 metadata, and the GLOBAL cu_seqlens that ``ring_kernels`` needs instead.

ring-flash-attn's ``llama3_flash_attn_varlen_func`` is told about the documents through per-rank metadata made by
``llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size)``: this rank's slice of the packed
row [r*L, (r+1)*L) (L = T / N) cut at document boundaries (``cu_seqlens_q``), the keys it needs
(``cu_seqlens_k`` over ``local_k_slice`` of the all-gathered keys) and their longest lengths.
``ring_kernels.llama3_attn_varlen_func`` takes the global ``cu_seqlens`` (identical on every rank) instead. So:

- ``prepare`` returns the same five values as ring-flash-attn's function, and remembers the global cu_seqlens
  against the returned ``cu_seqlens_q`` tensor (by identity and version);
- ``global_cu_seqlens`` finds them again for that tensor; for metadata prepared elsewhere it rebuilds them
  from every rank's slice (one small all-gather, cached per tensor): rank r knows the document starts inside
  its slice (``r*L + cu_seqlens_q[1:-1]``) and where its first document starts (``local_k_slice.start``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__: list = []

_REMEMBERED = 64  # metadata of this many recent steps (a step prepares once and is called once per layer)
_cache: "OrderedDict[int, Tuple[torch.Tensor, int, torch.Tensor]]" = OrderedDict()


def check_cu_seqlens(fn: str, name: str, cu_seqlens) -> torch.Tensor:
    """``cu_seqlens`` as a CPU int64 tensor (num_docs + 1,), starting at 0 and non-decreasing."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a 1-D integer torch.Tensor (int32), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(f"{fn}: {name} has dtype {cu_seqlens.dtype} and shape {tuple(cu_seqlens.shape)}; expected "
                         f"a 1-D integer tensor [0, len_0, len_0 + len_1, ...] of cumulative document lengths")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{fn}: {name}={cu.tolist()[:16]} must start at 0 and be non-decreasing")
    return cu


def remember(cu_q: torch.Tensor, cu_global: torch.Tensor) -> None:
    _cache[id(cu_q)] = (cu_q, cu_q._version, cu_global)  # holds cu_q: its id cannot be reused while cached
    _cache.move_to_end(id(cu_q))
    while len(_cache) > _REMEMBERED:
        _cache.popitem(last=False)


def _lookup(cu_q: torch.Tensor) -> Optional[torch.Tensor]:
    hit = _cache.get(id(cu_q))
    if hit is not None and hit[0] is cu_q and hit[1] == cu_q._version:
        return hit[2]
    return None


def prepare(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int):
    """ring-flash-attn's ``llama3_flash_attn_prepare_cu_seqlens``: the metadata of ``rank`` for the contiguous
    split of the packed row described by the GLOBAL ``cu_seqlens`` over ``world_size`` ranks.

    Returns ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``: int32 tensors on
    ``cu_seqlens``'s device, two ints, and the ``slice`` of the all-gathered keys this rank's queries need
    (from the start of its first document to the end of its slice when causal, else to the end of its last
    document).
    """
    fn = "llama3_flash_attn_prepare_cu_seqlens"
    cu = check_cu_seqlens(fn, "cu_seqlens", cu_seqlens)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: {name}={value!r} must be an int")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{fn}: rank={rank} must be in [0, world_size={world_size})")
    total = int(cu[-1])
    if total % world_size:
        raise ValueError(f"{fn}: the packed row has {total} tokens (cu_seqlens[-1]), not divisible by "
                         f"world_size={world_size}; pad the row to a multiple of {world_size}")
    local = total // world_size
    q0, q1 = rank * local, (rank + 1) * local
    first = int(torch.searchsorted(cu, q0, right=True)) - 1          # the document holding token q0
    last = int(torch.searchsorted(cu, q1, right=False))              # first boundary at or after q1
    bounds = cu[first:last + 1]
    cu_q = (bounds - q0).clamp(0, local)
    k_start, k_end = int(bounds[0]), (q1 if causal else int(bounds[-1]))
    cu_k = bounds - k_start
    cu_k[-1] = k_end - k_start
    out_q, out_k = (t.to(torch.int32).to(cu_seqlens.device) for t in (cu_q, cu_k))
    remember(out_q, cu.to(torch.int32))
    return (out_q, out_k, int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max()),
            slice(k_start, k_end))


def global_cu_seqlens(cu_seqlens_q: torch.Tensor, local_k_slice, local_tokens: int, group) -> torch.Tensor:
    """The GLOBAL int32 cu_seqlens behind this rank's llama3 metadata (see the module docstring)."""
    fn = "llama3_flash_attn_varlen_func"
    found = _lookup(cu_seqlens_q) if isinstance(cu_seqlens_q, torch.Tensor) else None
    if found is not None:
        return found
    cu_q = check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q)
    if int(cu_q[-1]) != local_tokens:
        raise ValueError(f"{fn}: cu_seqlens_q[-1]={int(cu_q[-1])} but q holds {local_tokens} local tokens; pass "
                         f"the cu_seqlens_q returned by llama3_flash_attn_prepare_cu_seqlens for this rank")
    if not isinstance(local_k_slice, slice) or not isinstance(local_k_slice.start, int):
        raise TypeError(f"{fn}: local_k_slice={local_k_slice!r} must be the slice returned by "
                        f"llama3_flash_attn_prepare_cu_seqlens")
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    starts = {local_k_slice.start, *(rank * local_tokens + int(b) for b in cu_q[1:-1])}
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, sorted(starts), group=group)
    else:
        gathered = [sorted(starts)]
    every = sorted({0, world * local_tokens}.union(*map(set, gathered)))
    result = torch.tensor(every, dtype=torch.int32)
    remember(cu_seqlens_q, result)
    return result
