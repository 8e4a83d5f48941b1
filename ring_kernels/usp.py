"""USP: Ulysses within a group of ranks x a ring variant across such groups (a 2-D split of the sequence).

The ranks form a grid of ``ring_group``s (R ranks each) x ``ulysses_group``s (U ranks each): every rank is in
one group of each kind, and its two groups share no other rank. With 4 ranks and U = R = 2, say, the Ulysses
groups {0, 1}, {2, 3} and the ring groups {0, 2}, {1, 3}; put the Ulysses groups where an all-to-all is cheap
(one node), the rings across.

Sharding (``usp_shard`` / ``usp_unshard``): the global sequence is first split over the *ring* group in the ring
variant's layout (``usp_layout``: ``"contiguous"`` for ``ring`` and ``llama3``, ``"zigzag"``, ``"stripe"``), then
each ring shard contiguously over the *Ulysses* group. The rank at ring rank i and Ulysses rank u holds

    shard(shard(x, ring_group, layout=usp_layout(ring_variant)), ulysses_group, layout="contiguous")

i.e. piece u of U (consecutive, in local order) of ring shard i. Global length L: R x U x S_local tokens (zigzag:
L divisible by 2R, and S_local x U even). Packed documents: the ring layout's varlen form over the ring group
(``cu_seqlens`` as for the ring variant), then the same contiguous split of each ring shard's tokens.

One call: Ulysses' all-to-all over ``ulysses_group`` (``ulysses.head_parallel``) gathers this rank's whole ring
shard -- in the ring layout's order already, since the split inside it was contiguous: no permutation -- for
H/U query heads; the ring variant runs over ``ring_group`` on those heads; the inverse all-to-all returns out
to the caller's shard. H must divide by U; K/V heads are replicated as in Ulysses where Hk does not. A sink
is split by heads over the Ulysses group and by queries over the ring: the sum of the sink gradient over all
ranks is the whole gradient.

Refused by name: ``causal=False`` with ``zigzag`` or ``stripe`` (use ``ring``), a zigzag ring shard of odd
length, groups that are not two axes of a grid, and everything the ring variant itself refuses.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import validation
from .comm import group_rank_and_size
from .documents import cu_entry
from .layout import shard, unshard
from .llama3 import llama3_attn_varlen_func
from .ring import ring_attn_func
from .stripe import stripe_attn_func
from .ulysses import check_heads, head_exchange, head_parallel
from .validation import LayoutCode, RingInputError
from .varlen import ring_attn_varlen_func, zigzag_ring_attn_varlen_func
from .zigzag import zigzag_ring_attn_func

__all__ = ["usp_attn_func", "usp_attn_varlen_func", "usp_layout", "usp_shard", "usp_unshard", "RING_VARIANTS",
           "VARLEN_RING_VARIANTS"]

# ring_variant -> (the ring function, its layout over the ring group, the layout field of the ranks' agreement check)
RING_VARIANTS: Dict[str, Tuple[Callable, str, LayoutCode]] = {
    "ring": (ring_attn_func, "contiguous", LayoutCode.USP_RING),
    "zigzag": (zigzag_ring_attn_func, "zigzag", LayoutCode.USP_ZIGZAG),
    "stripe": (stripe_attn_func, "stripe", LayoutCode.USP_STRIPE),
}
VARLEN_RING_VARIANTS: Dict[str, Tuple[Callable, str, LayoutCode]] = {
    "ring": (ring_attn_varlen_func, "contiguous", LayoutCode.USP_RING_VARLEN),
    "zigzag": (zigzag_ring_attn_varlen_func, "zigzag", LayoutCode.USP_ZIGZAG_VARLEN),
    "llama3": (llama3_attn_varlen_func, "contiguous", LayoutCode.USP_LLAMA3_VARLEN),
}
_CAUSAL_ONLY = ("zigzag", "stripe")


def _variant(fn: str, ring_variant, varlen: bool) -> Tuple[Callable, str, LayoutCode]:
    table = VARLEN_RING_VARIANTS if varlen else RING_VARIANTS
    if ring_variant not in table:
        other = RING_VARIANTS if varlen else VARLEN_RING_VARIANTS
        hint = (f" ({ring_variant!r} exists only {'without' if varlen else 'with'} cu_seqlens)"
                if ring_variant in other else "")
        raise RingInputError(f"{fn}: ring_variant={ring_variant!r} is not one of {tuple(table)}{hint}",
                             argument="ring_variant", value=ring_variant)
    return table[ring_variant]


def usp_layout(ring_variant: str, *, varlen: bool = False) -> str:
    """The layout over the ring group of ``ring_variant`` (the split within the Ulysses group is contiguous)."""
    return _variant("usp_layout", ring_variant, varlen)[1]


def usp_shard(x: torch.Tensor, *, ulysses_group, ring_group, ring_variant: str = "zigzag", dim: int = 1,
              cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's part of the global ``x`` along ``dim`` for USP (module docstring); varlen: pass the global
    ``cu_seqlens`` and the token dimension (``dim=0`` for (T, H, D))."""
    layout = usp_layout(ring_variant, varlen=cu_seqlens is not None)
    part = shard(x, ring_group, layout=layout, dim=dim, cu_seqlens=cu_seqlens)
    return shard(part, ulysses_group, layout="contiguous", dim=dim)


def usp_unshard(x_local: torch.Tensor, *, ulysses_group, ring_group, ring_variant: str = "zigzag", dim: int = 1,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The global tensor from every rank's part (``usp_shard``'s inverse; collective over both groups,
    differentiable as ``ring_kernels.unshard``)."""
    layout = usp_layout(ring_variant, varlen=cu_seqlens is not None)
    part = unshard(x_local, ulysses_group, layout="contiguous", dim=dim)
    return unshard(part, ring_group, layout=layout, dim=dim, cu_seqlens=cu_seqlens)


def _check_grid(fn: str, ulysses_group, ring_group) -> None:
    """The two groups meet in this rank only (a grid); host metadata only."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.group.WORLD
    ulysses = set(dist.get_process_group_ranks(ulysses_group or world))
    ring = set(dist.get_process_group_ranks(ring_group or world))
    if ulysses & ring != {dist.get_rank()}:
        raise RingInputError(
            f"{fn}: ulysses_group (ranks {sorted(ulysses)}) and ring_group (ranks {sorted(ring)}) share the ranks "
            f"{sorted(ulysses & ring)}; they must be the two axes of a grid, meeting in this rank "
            f"({dist.get_rank()}) only (e.g. 4 ranks: ulysses groups [0, 1], [2, 3], ring groups [0, 2], [1, 3])",
            argument="ring_group", value=sorted(ring))


def _check_common(fn: str, causal, ring_variant, ulysses_group, ring_group) -> Tuple[int, int]:
    """The checks of both front ends after q, k, v and the options: (Ulysses rank, Ulysses world)."""
    if ring_variant in _CAUSAL_ONLY:
        validation.require_causal(fn, causal, alternative="ring_variant='ring'")
    _check_grid(fn, ulysses_group, ring_group)
    return group_rank_and_size(ulysses_group)


def _ring_call(ring_fn: Callable, ring_group, **options) -> Callable:
    def attend(qh, kh, vh, sink_h, *extra):
        return ring_fn(qh, kh, vh, *extra, group=ring_group, sink=sink_h, **options)
    return attend


def usp_attn_func(q, k, v, *, ulysses_group, ring_group, ring_variant="zigzag", causal=True, softmax_scale=None,
                  backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0, sink=None):
    """Attention over a sequence sharded by ``usp_shard`` on the grid ``ulysses_group`` x ``ring_group``.

    q: (B, S_local, H, D); k, v: (B, S_local, Hk, D), H % Hk == 0 and H % U == 0 (U: the size of
    ``ulysses_group``). ``ring_variant``: ``"zigzag"`` (default; causal only), ``"stripe"`` (causal only) or
    ``"ring"``. Returns out (B, S_local, H, D) in q's dtype, in the same shard order; differentiable in q, k, v
    and sink. ``causal``, ``softmax_scale``, ``backend``, ``window_size``, ``softcap``, ``dropout_p`` (must be
    0), ``sink`` (H,): as the ring variant's (``ring_attn_func``).
    """
    fn = "usp_attn_func"
    ring_fn, _, code = _variant(fn, ring_variant, varlen=False)
    validation.check_qkv(fn, q, k, v)
    window = validation.check_options(fn, window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    scale = validation.resolve_scale(fn, softmax_scale, q.shape[-1])
    b, s, h, d = q.shape
    validation.check_sink(fn, sink, h, q.device)
    _, world = _check_common(fn, causal, ring_variant, ulysses_group, ring_group)
    if s == 0 or b == 0:
        raise RingInputError(f"{fn}: q has shape {tuple(q.shape)}; batch and seqlen_local must be >= 1 on every rank",
                             argument="q", value=tuple(q.shape))
    fields = [("layout", code), ("batch", b), ("seqlen_local", s), ("nheads", h), ("nheads_k", k.shape[2]),
              ("headdim", d), ("dtype", validation.dtype_code(q.dtype)), ("causal", int(bool(causal))),
              ("softmax_scale", scale), ("softcap", float(softcap)), ("window_left", window[0]),
              ("window_right", window[1]), ("sink", int(sink is not None))]
    if world > 1:
        validation.check_ranks_agree(fn, ulysses_group, fields, q.device)
    check_heads(fn, h, world, "ulysses_group")
    if ring_variant == "zigzag" and (world * s) % 2:
        raise RingInputError(
            f"{fn}: the ring shard has {world} x {s} = {world * s} tokens (ulysses_group size x seqlen_local); the "
            f"zigzag layout needs an even number (two chunks per ring rank): pad the global length to a multiple "
            f"of 2 x the number of ranks", argument="q", value=tuple(q.shape))
    attend = _ring_call(ring_fn, ring_group, causal=causal, softmax_scale=softmax_scale, backend=backend,
                        window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    return head_parallel(q, k, v, sink, head_exchange(ulysses_group, "contiguous", b, s, q.device), attend)


def usp_attn_varlen_func(q, k, v, cu_seqlens, *, ulysses_group, ring_group, ring_variant="zigzag", causal=True,
                         softmax_scale=None, backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0,
                         sink=None):
    """Attention over packed documents sharded by ``usp_shard(..., dim=0, cu_seqlens=cu_seqlens)``.

    q: (T_local, H, D); k, v: (T_local, Hk, D) -- or all three as HF's packed row (1, T_local, H|Hk, D).
    ``cu_seqlens``: the cumulative lengths of the global packed sequence (identical on every rank), as for the
    ring variant. ``ring_variant``: ``"zigzag"`` (default; causal only; every document length divisible by 2R),
    ``"ring"`` or ``"llama3"``. Returns out of q's shape and dtype; differentiable. Options as
    ``usp_attn_func``.
    """
    fn = "usp_attn_varlen_func"
    ring_fn, _, code = _variant(fn, ring_variant, varlen=True)
    validation.check_qkv(fn, q, k, v, varlen=True)
    window = validation.check_options(fn, window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    scale = validation.resolve_scale(fn, softmax_scale, q.shape[-1])
    t, h, d = q.shape[-3:]
    validation.check_sink(fn, sink, h, q.device)
    _, world = _check_common(fn, causal, ring_variant, ulysses_group, ring_group)
    entry = cu_entry(fn, cu_seqlens)
    fields = [("layout", code), ("local_tokens", t), ("nheads", h), ("nheads_k", k.shape[-2]),
              ("headdim", d), ("dtype", validation.dtype_code(q.dtype)), ("causal", int(bool(causal))),
              ("softmax_scale", scale), ("softcap", float(softcap)), ("window_left", window[0]),
              ("window_right", window[1]), ("cu_seqlens length", entry.cu.numel()),
              ("cu_seqlens[-1]", entry.total), ("cu_seqlens fingerprint", entry.fingerprint),
              ("sink", int(sink is not None))]
    if world > 1:
        validation.check_ranks_agree(fn, ulysses_group, fields, q.device)
    if t == 0:
        raise RingInputError(f"{fn}: q has 0 local tokens (shape {tuple(q.shape)}); every rank must hold at least "
                             f"one token (shard with ring_kernels.usp_shard)", argument="q", value=tuple(q.shape))
    check_heads(fn, h, world, "ulysses_group")
    attend = _ring_call(ring_fn, ring_group, causal=causal, softmax_scale=softmax_scale, backend=backend,
                        window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    ex = head_exchange(ulysses_group, "contiguous", 1, t, q.device)
    with_cu = lambda qh, kh, vh, sink_h: attend(qh, kh, vh, sink_h, cu_seqlens)  # noqa: E731
    if q.dim() == 4:                                  # HF's packed row: the ring variant takes it as is
        return head_parallel(q, k, v, sink, ex, with_cu)
    return head_parallel(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), sink, ex, with_cu).squeeze(0)
