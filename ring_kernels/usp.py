"""USP: Ulysses within groups of consecutive ranks x a ring variant across them (a 2-D split of the sequence).

The N = U x R ranks of ``group`` form a grid: rank g of ``group`` is rank g % U of the ``ulysses_group`` of
ranks [g - g % U, g - g % U + U) (U consecutive ranks) and rank g // U of the ``ring_group`` of ranks g % U,
U + g % U, ..., (R-1)U + g % U. With 4 ranks and U = R = 2: the Ulysses groups {0, 1}, {2, 3}, the rings {0, 2},
{1, 3}; consecutive ranks share a node, where an all-to-all is cheap, and the rings go across.
``build_usp_groups(group, U, R)`` makes the two subgroups (``UspGroups``: the groups and this rank's grid; the
caller keeps them as long as ``group``); a call given them (``groups=``) uses that grid as built. Subgroups the
caller made itself (``ulysses_group=``, ``ring_group=``) are checked to be this grid of ``group`` (host metadata,
once per three groups).

Sharding: the inputs are sharded over the whole ``group`` in the ring variant's layout (``usp_layout``), exactly
as for a ring variant over N ranks -- ``ring_kernels.shard(x, group, layout=usp_layout(ring_variant))`` -- so
whatever else is sharded along the sequence (positions, labels, state-passing mixers) needs no layout of its own.
Ulysses group r (ring rank r) holds, together:

- ``"contiguous"`` (``ring``, ``llama3``): contiguous chunk r of R, its ranks' pieces in rank order;
- ``"zigzag"``: of the 2N chunks, rank g holds g and 2N-1-g, so group r holds chunks [rU, rU+U) and
  [2N-rU-U, 2N-rU) -- exactly chunks r and 2R-1-r of the zigzag over R, once the pieces are put in order (the
  fronts ascending, then the backs ascending: Ulysses rank u's back chunk is 2N-1-(rU+u), so they arrive in
  descending order). Packed documents: the same within every document (each a multiple of 2N tokens).

A stripe over N is not a stripe over R (group r holds the tokens t with t mod N in [rU, rU+U)): refused.

One call: Ulysses' all-to-all over ``ulysses_group`` (``ulysses.head_parallel``) gathers ring rank r's shard of
the ring layout over R, in that shard's local order (the copy that unpacks the receive buffer permutes the rows),
for H/U query heads; the ring variant runs over ``ring_group`` on those heads; the inverse all-to-all returns out
in the caller's shard order. H must divide by U; K/V heads are replicated as in Ulysses where Hk does not. A sink
is split by heads over the Ulysses group and by queries over the ring: the sum of the sink gradient over all
ranks is the whole gradient.

Refused by name: ``ring_variant="stripe"``, ``causal=False`` with ``zigzag`` (use ``ring``), a zigzag shard of
odd length or documents that do not divide by 2N, subgroups that are not this grid of ``group``, and everything
the ring variant itself refuses.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import validation
from .documents import VarlenCall
from .entry import KernelCall
from .layout import check_zigzag_documents, rank_positions
from .llama3 import llama3_attn_varlen_func
from .ring import ring_attn_func
from .ulysses import (ExchangeIndices, HeadExchange, cached_indices, check_heads, check_zigzag_length,
                      exchange_indices, head_parallel)
from .validation import LayoutCode, RingInputError
from .varlen import ring_attn_varlen_func, zigzag_ring_attn_varlen_func
from .zigzag import zigzag_ring_attn_func

__all__ = ["usp_attn_func", "usp_attn_varlen_func", "usp_layout", "build_usp_groups", "UspGroups", "UspGrid",
           "usp_grid", "RING_VARIANTS", "VARLEN_RING_VARIANTS"]

# ring_variant -> (the ring function, the layout of the inputs over the whole group and of the ring shards over
# the ring group, the layout field of the ranks' agreement check)
RING_VARIANTS: Dict[str, Tuple[Callable, str, LayoutCode]] = {
    "ring": (ring_attn_func, "contiguous", LayoutCode.USP_RING),
    "zigzag": (zigzag_ring_attn_func, "zigzag", LayoutCode.USP_ZIGZAG),
}
VARLEN_RING_VARIANTS: Dict[str, Tuple[Callable, str, LayoutCode]] = {
    "ring": (ring_attn_varlen_func, "contiguous", LayoutCode.USP_RING_VARLEN),
    "zigzag": (zigzag_ring_attn_varlen_func, "zigzag", LayoutCode.USP_ZIGZAG_VARLEN),
    "llama3": (llama3_attn_varlen_func, "contiguous", LayoutCode.USP_LLAMA3_VARLEN),
}
_CAUSAL_ONLY = ("zigzag",)


def _variant(fn: str, ring_variant, varlen: bool) -> Tuple[Callable, str, LayoutCode]:
    table = VARLEN_RING_VARIANTS if varlen else RING_VARIANTS
    if ring_variant == "stripe":
        raise RingInputError(
            f"{fn}: ring_variant='stripe' cannot run across Ulysses groups: a stripe over the whole group is not a "
            f"stripe over the ring group (Ulysses group r holds the tokens t with t mod N in [rU, rU+U), a stripe "
            f"over the ring would be t mod R == r); use ring_variant='zigzag' (balanced causal work) or 'ring', "
            f"or ulysses_attn_func(layout='stripe') without a ring", argument="ring_variant", value=ring_variant)
    if ring_variant not in table:
        other = RING_VARIANTS if varlen else VARLEN_RING_VARIANTS
        hint = (f" ({ring_variant!r} exists only {'without' if varlen else 'with'} cu_seqlens)"
                if ring_variant in other else "")
        raise RingInputError(f"{fn}: ring_variant={ring_variant!r} is not one of {tuple(table)}{hint}",
                             argument="ring_variant", value=ring_variant)
    return table[ring_variant]


def usp_layout(ring_variant: str, *, varlen: bool = False) -> str:
    """The layout the inputs of ``ring_variant`` are sharded in over the whole group (``ring_kernels.shard``'s
    ``layout``): ``"contiguous"`` for ``ring`` and ``llama3``, ``"zigzag"`` for ``zigzag``."""
    return _variant("usp_layout", ring_variant, varlen)[1]


# ---------------------------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class UspGrid:
    """This rank's place in the grid of ``group``: rank ``rank`` of ``world`` = ``ring_rank`` x ``ulysses`` +
    ``ulysses_rank``; ``ulysses`` (U) ranks per Ulysses group, ``ring`` (R) per ring group."""

    world: int
    rank: int
    ulysses: int
    ulysses_rank: int
    ring: int
    ring_rank: int


_GRIDS: "OrderedDict[tuple, UspGrid]" = OrderedDict()   # (group, ulysses_group, ring_group) -> grid
_GRIDS_SIZE = 16
_LOCK = threading.Lock()


def _members(fn: str, name: str, sub, group, group_name: str) -> list:
    """The ranks of ``group`` that ``sub`` holds, in ``sub``'s rank order."""
    ranks = sorted(dist.get_process_group_ranks(sub), key=lambda g: dist.get_group_rank(sub, g))
    try:
        return [dist.get_group_rank(group, g) for g in ranks]
    except (ValueError, RuntimeError) as exc:
        raise RingInputError(
            f"{fn}: {name} holds the global ranks {ranks}, not all of which are in {group_name} (global ranks "
            f"{dist.get_process_group_ranks(group)}); make {name} from ranks of {group_name}",
            argument=name, value=ranks) from exc


def _make_grid(fn: str, group, ulysses_group, ring_group) -> UspGrid:
    world, ulysses, ring = (dist.get_world_size(g) for g in (group, ulysses_group, ring_group))
    if ulysses * ring != world:
        raise RingInputError(
            f"{fn}: ulysses_group has {ulysses} ranks and ring_group {ring}, {ulysses} x {ring} = {ulysses * ring}, "
            f"but group has {world}; USP splits the group into a grid of Ulysses groups x ring groups: make "
            f"ulysses_group of U consecutive ranks and ring_group of the other {world} / U (U x R = {world})",
            argument="ring_group", value=ring)
    rank = dist.get_rank(group)
    first = rank - rank % ulysses
    for name, sub, want in (("ulysses_group", ulysses_group, list(range(first, first + ulysses))),
                            ("ring_group", ring_group, list(range(rank % ulysses, world, ulysses)))):
        found = _members(fn, name, sub, group, "group")
        if found != want:
            raise RingInputError(
                f"{fn}: {name} holds the ranks {found} of group (in its rank order) but rank {rank} of a "
                f"{ulysses} x {ring} grid belongs to the {name} of ranks {want}: Ulysses groups are {ulysses} "
                f"consecutive ranks of group, ring groups take one rank of each (4 ranks, 2 x 2: ulysses [0, 1], "
                f"[2, 3]; ring [0, 2], [1, 3]); the inputs are sharded by rank of group, so another grid would "
                f"gather the wrong tokens", argument=name, value=found)
    return UspGrid(world, rank, ulysses, rank % ulysses, ring, rank // ulysses)


def usp_grid(fn: str, group, ulysses_group, ring_group) -> UspGrid:
    """This rank's ``UspGrid``, after checking that ``ulysses_group`` x ``ring_group`` is the grid of ``group``
    (module docstring; ``RingInputError`` naming the group that is not). Host metadata only, once per three
    groups. None for a group: the default group; no process group at all: a grid of one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return UspGrid(1, 0, 1, 0, 1, 0)
    world_group = dist.group.WORLD
    key = tuple(world_group if g is None else g for g in (group, ulysses_group, ring_group))
    with _LOCK:
        found = _GRIDS.get(key)
    if found is None:
        found = _make_grid(fn, *key)              # raises before storing
        with _LOCK:
            _GRIDS[key] = found
            while len(_GRIDS) > _GRIDS_SIZE:
                _GRIDS.popitem(last=False)
    return found


@dataclass(frozen=True)
class UspGroups:
    """A USP grid of process groups: ``group`` (the parent, N = U x R ranks), this rank's ``ulysses_group`` (U
    consecutive ranks of it) and ``ring_group`` (one rank of each Ulysses group), and this rank's place in them,
    ``grid``. Made by ``build_usp_groups``, so the grid is right by construction: a USP call given one
    (``groups=``) uses it without checking the groups again."""

    group: object
    ulysses_group: object
    ring_group: object
    grid: UspGrid

    @property
    def ulysses(self) -> int:
        """U, the ranks of each Ulysses group."""
        return self.grid.ulysses

    @property
    def ring(self) -> int:
        """R, the ranks of each ring group."""
        return self.grid.ring


def _check_degrees(fn: str, ulysses, ring, world: int) -> None:
    """``ulysses`` x ``ring`` is a grid of the ``world`` ranks: two ints >= 1 whose product is ``world``."""
    ints = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (ulysses, ring))
    if not ints or ulysses * ring != world:
        grids = [f"{u} x {world // u}" for u in range(1, world + 1) if world % u == 0]
        raise RingInputError(
            f"{fn}: ulysses={ulysses!r} x ring={ring!r} is not a grid of the group's {world} ranks; USP splits "
            f"the group into Ulysses groups of U ranks x ring groups of R ranks, U x R = {world}: one of "
            f"{', '.join(grids)}", argument="ulysses", value=(ulysses, ring))


def build_usp_groups(group, ulysses: int, ring: int, *, backend: Optional[str] = None) -> UspGroups:
    """New process groups for USP over ``group`` (None: the default group) of N = ``ulysses`` x ``ring`` ranks:
    this rank's Ulysses group (U consecutive ranks of ``group``) and ring group (one rank of each Ulysses group,
    ranks u, U + u, ...), both on ``backend`` (default: ``group``'s), and this rank's grid.

    Collective: every rank of ``group`` calls it, in the same order as any other group it makes; only the members
    of each new group take part in making it (``use_local_synchronization``), the Ulysses group first. Every call
    makes new groups: the caller keeps them as long as ``group``. Without a process group: a grid of one rank,
    no groups. ``RingInputError`` when U x R is not the group's size, naming the grids that are."""
    fn = "build_usp_groups"
    if not (dist.is_available() and dist.is_initialized()):
        _check_degrees(fn, ulysses, ring, 1)
        return UspGroups(None, None, None, UspGrid(1, 0, 1, 0, 1, 0))
    parent = dist.group.WORLD if group is None else group
    ranks = dist.get_process_group_ranks(parent)              # global ranks, in the rank order of ``parent``
    world, rank = len(ranks), dist.get_rank(parent)
    _check_degrees(fn, ulysses, ring, world)
    if rank < 0:
        raise RingInputError(f"{fn}: this process (global rank {dist.get_rank()}) is not in group (global ranks "
                             f"{ranks}); only the ranks of group call it", argument="group", value=ranks)
    backend = backend or dist.get_backend(parent)
    first = rank - rank % ulysses
    ulysses_group = dist.new_group([ranks[g] for g in range(first, first + ulysses)], backend=backend,
                                   use_local_synchronization=True)
    ring_group = dist.new_group([ranks[g] for g in range(rank % ulysses, world, ulysses)], backend=backend,
                                use_local_synchronization=True)
    grid = UspGrid(world, rank, ulysses, rank % ulysses, ring, rank // ulysses)
    return UspGroups(parent, ulysses_group, ring_group, grid)


def _ring_order(layout: str, grid: UspGrid, seqlen: int, cu: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``order[u * seqlen + s]``: the place, in ring rank r's shard of ``layout`` over the R ring ranks, of the
    s-th local token of Ulysses rank u of group r (``exchange_indices``' order; module docstring)."""
    total = grid.world * seqlen
    shard = rank_positions(total, grid.ring_rank, grid.ring, layout=layout, cu_seqlens=cu)
    place = torch.full((total,), -1, dtype=torch.long)
    place[shard] = torch.arange(shard.numel())
    first = grid.ring_rank * grid.ulysses
    pieces = torch.cat([rank_positions(total, first + u, grid.world, layout=layout, cu_seqlens=cu)
                        for u in range(grid.ulysses)])
    order = place[pieces]
    assert bool((order >= 0).all()), (layout, grid)   # the Ulysses group holds exactly the ring shard
    return order


def _batch_indices(layout: str, grid: UspGrid, batch: int, seqlen: int) -> ExchangeIndices:
    return cached_indices(("usp", layout, grid, batch, seqlen),
                          lambda: exchange_indices(_ring_order(layout, grid, seqlen), grid.ulysses, batch, seqlen))


def _exchange(ulysses_group, grid: UspGrid, indices: Optional[ExchangeIndices], batch: int, seqlen: int,
              device: torch.device) -> HeadExchange:
    if grid.ulysses == 1:
        return HeadExchange(ulysses_group, 0, 1, batch, seqlen)
    gather, scatter = indices.on(device)
    return HeadExchange(ulysses_group, grid.ulysses_rank, grid.ulysses, batch, seqlen, gather, scatter)


# ---------------------------------------------------------------------------------------------- calls


def _check_common(fn: str, causal, ring_variant, group, ulysses_group, ring_group, groups) -> UspGroups:
    """The checks of both front ends after q, k, v and the options: the call's groups and this rank's grid
    (``groups`` as built, or the three groups given, checked by ``usp_grid``)."""
    if ring_variant in _CAUSAL_ONLY:
        validation.require_causal(fn, causal, alternative="ring_variant='ring' (inputs sharded 'contiguous')")
    if groups is None:
        return UspGroups(group, ulysses_group, ring_group, usp_grid(fn, group, ulysses_group, ring_group))
    if not isinstance(groups, UspGroups):
        raise TypeError(f"{fn}: groups must be the UspGroups of ring_kernels.build_usp_groups, got "
                        f"{type(groups).__name__}")
    if ulysses_group is not None or ring_group is not None or (group is not None and group is not groups.group):
        raise RingInputError(
            f"{fn}: groups= carries group, ulysses_group and ring_group, and other groups were passed beside it; "
            f"pass groups alone (or the three groups without it)", argument="groups", value=groups)
    return groups


def _ring_call(ring_fn: Callable, ring_group, **options) -> Callable:
    def attend(qh, kh, vh, sink_h, *extra):
        return ring_fn(qh, kh, vh, *extra, group=ring_group, sink=sink_h, **options)
    return attend


def usp_attn_func(q, k, v, *, ulysses_group=None, ring_group=None, group=None, groups=None, ring_variant="zigzag",
                  causal=True, softmax_scale=None, backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0,
                  sink=None):
    """Attention over a sequence sharded over ``group`` in ``usp_layout(ring_variant)``, by Ulysses over
    ``ulysses_group`` x ``ring_variant`` over ``ring_group`` (the grid of ``group``: module docstring).

    q: (B, S_local, H, D); k, v: (B, S_local, Hk, D), H % Hk == 0 and H % U == 0 (U: the size of
    ``ulysses_group``); rank g holds ``ring_kernels.shard(x, group, layout=usp_layout(ring_variant))``.
    ``group``: the whole group of N = U x R ranks (None: the default group). ``groups``: instead of the three, the
    ``UspGroups`` of ``build_usp_groups`` (its grid is not checked again). Without a process group all groups
    are None: a world of one. ``ring_variant``: ``"zigzag"`` (default; causal only; S_local even) or ``"ring"``
    (contiguous). Returns out (B, S_local, H, D) in q's dtype, in the same shard order; differentiable in q, k,
    v and sink. ``causal``, ``softmax_scale``, ``backend``, ``window_size``, ``softcap``, ``dropout_p`` (must be
    0), ``sink`` (H,): as the ring variant's (``ring_attn_func``).
    """
    fn = "usp_attn_func"
    ring_fn, layout, code = _variant(fn, ring_variant, varlen=False)
    call = KernelCall(fn, q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                      softcap=softcap, dropout_p=dropout_p, sink=sink)
    grids = _check_common(fn, causal, ring_variant, group, ulysses_group, ring_group, groups)
    grid = grids.grid
    call.agree_batch(grids.group, q, k, code, ranks=(grid.rank, grid.world))
    b, s, h = q.shape[:3]
    check_heads(fn, h, grid.ulysses, "ulysses_group")
    if layout == "zigzag" and grid.world > 1:
        check_zigzag_length(fn, s)
    attend = _ring_call(ring_fn, grids.ring_group, causal=causal, softmax_scale=softmax_scale, backend=backend,
                        window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    indices = _batch_indices(layout, grid, b, s) if grid.ulysses > 1 else None
    return head_parallel(q, k, v, sink, _exchange(grids.ulysses_group, grid, indices, b, s, q.device), attend)


def usp_attn_varlen_func(q, k, v, cu_seqlens, *, ulysses_group=None, ring_group=None, group=None, groups=None,
                         ring_variant="zigzag", causal=True, softmax_scale=None, backend="auto", window_size=(-1, -1),
                         softcap=0.0, dropout_p=0.0, sink=None):
    """Attention over packed documents sharded over ``group`` in ``usp_layout(ring_variant, varlen=True)``, by
    Ulysses over ``ulysses_group`` x ``ring_variant`` over ``ring_group`` (the grid of ``group``).

    q: (T_local, H, D); k, v: (T_local, Hk, D) -- or all three as HF's packed row (1, T_local, H|Hk, D); rank g
    holds ``ring_kernels.shard(x, group, layout=usp_layout(ring_variant, varlen=True), dim=0,
    cu_seqlens=cu_seqlens)``. ``cu_seqlens``: the cumulative lengths of the global packed sequence (identical on
    every rank), as for the ring variant. ``ring_variant``: ``"zigzag"`` (default; causal only; every document
    length divisible by 2N), ``"ring"`` or ``"llama3"`` (both contiguous). Returns out of q's shape and dtype;
    differentiable. Groups (or ``groups``) and options as ``usp_attn_func``.
    """
    fn = "usp_attn_varlen_func"
    ring_fn, layout, code = _variant(fn, ring_variant, varlen=True)
    grids = _check_common(fn, causal, ring_variant, group, ulysses_group, ring_group, groups)
    grid = grids.grid
    call = VarlenCall(fn, q, k, v, cu_seqlens, group=grids.group, causal=causal, softmax_scale=softmax_scale,
                      window_size=window_size, softcap=softcap, dropout_p=dropout_p, sink=sink, layout_code=code)
    check_heads(fn, q.shape[-2], grid.ulysses, "ulysses_group")
    if layout == "zigzag" and grid.world > 1:
        # Cached only once it passed (a failing check raises again on every call).
        instead = "use ring_variant='ring' or 'llama3' (inputs sharded 'contiguous')"
        call.entry.get(("usp zigzag documents", grid.world),
                       lambda: check_zigzag_documents(call.cu, grid.world, fn=fn, instead=instead))
    indices = None
    if grid.ulysses > 1:
        indices = call.entry.get(("usp", layout, grid, call.local), lambda: exchange_indices(
            _ring_order(layout, grid, call.local, call.cu), grid.ulysses, 1, call.local))
    attend = _ring_call(ring_fn, grids.ring_group, causal=causal, softmax_scale=softmax_scale, backend=backend,
                        window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    ex = _exchange(grids.ulysses_group, grid, indices, 1, call.local, q.device)
    with_cu = lambda qh, kh, vh, sink_h: attend(qh, kh, vh, sink_h, cu_seqlens)  # noqa: E731
    if q.dim() == 4:                                  # HF's packed row: the ring variant takes it as is
        return head_parallel(q, k, v, sink, ex, with_cu)
    return head_parallel(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), sink, ex, with_cu).squeeze(0)
