"""How a global sequence is split over the ranks of a context-parallel group, and back.

Layouts (N = group size, r = this rank; every rank holds the same number of tokens):

- ``"contiguous"`` (ring, llama3): rank r holds tokens ``[r*L, (r+1)*L)`` with ``L = S / N``.
- ``"zigzag"``: the sequence is cut into 2N chunks; rank r holds chunk r then chunk 2N-1-r, so that every
  rank does the same causal work.
- ``"stripe"``: token t lives on rank ``t mod N`` (in increasing order of t).

Varlen (``cu_seqlens`` given: int cumulative lengths of the *global* packed sequence, identical on all ranks):
``"contiguous"`` splits the packed token stream (documents may cross rank boundaries); ``"zigzag"`` splits
*each document* into 2N chunks, and rank r holds, document after document, chunk r then chunk 2N-1-r of it
(so each document length must be divisible by 2N, and the local cu_seqlens are ``cu_seqlens // N``).
``"stripe"`` has no varlen form.

``shard`` and ``unshard`` are differentiable: ``shard`` is an index selection, and ``unshard``'s backward sums
the gradient of the gathered tensor over the ranks (a reduce-scatter), the adjoint of a gather.
Without an initialised process group (and ``group=None``) the world has size 1 and both are the identity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .errors import RingInputError

__all__ = ["LAYOUTS", "LocalVarlen", "shard", "unshard", "local_positions", "rank_positions", "local_varlen",
           "check_zigzag_documents"]

LAYOUTS = ("contiguous", "zigzag", "stripe")
_VARLEN_LAYOUTS = ("contiguous", "zigzag")


# --------------------------------------------------------------------------------------------- group


def _rank_and_size(group) -> Tuple[int, int]:
    """(rank, world size) in ``group``; no process group at all (and group None) is a world of one."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


# ---------------------------------------------------------------------------------------- validation


def _check_layout(layout, *, varlen: bool) -> None:
    allowed = _VARLEN_LAYOUTS if varlen else LAYOUTS
    if layout not in allowed:
        what = "with cu_seqlens (varlen)" if varlen else ""
        hint = " (stripe has no varlen form: use 'contiguous' or 'zigzag')" if varlen and layout == "stripe" else ""
        raise ValueError(f"layout={layout!r} is not supported {what}; expected one of {allowed}{hint}")


def check_cu_seqlens(cu_seqlens) -> torch.Tensor:
    """Validate and return ``cu_seqlens`` as a CPU int64 tensor of shape (num_docs + 1,)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"cu_seqlens must be a 1-D integer torch.Tensor (e.g. torch.int32), got {type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor of cumulative lengths starting at 0, got dtype "
            f"{cu_seqlens.dtype} and shape {tuple(cu_seqlens.shape)}"
        )
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        doc = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing; document {doc} has length {int(lengths[doc])} "
            f"(cu_seqlens[{doc}]={int(cu[doc])}, cu_seqlens[{doc + 1}]={int(cu[doc + 1])})"
        )
    return cu


def _check_divisible(total: int, parts: int, *, layout: str, what: str) -> None:
    if total % parts != 0:
        raise ValueError(
            f"{what} = {total} cannot be split by layout={layout!r} over the group: it must be divisible by "
            f"{parts}; pad the sequence to a multiple of {parts}"
        )


def check_zigzag_documents(cu: torch.Tensor, world_size: int, *, instead: str, fn: str = "") -> None:
    """The zigzag rule for packed documents, for every caller (``shard``, the zigzag varlen kernels, Ulysses and
    USP): every document of ``cu`` (CPU int64 cumulative lengths) splits into 2 x ``world_size`` equal chunks.
    ``RingInputError`` (a ``ValueError``; argument ``cu_seqlens``, value the first bad length) otherwise, naming
    ``fn`` (the function called, when there is one) and, as the other fix than padding, ``instead``."""
    lengths = cu[1:] - cu[:-1]
    parts = 2 * world_size
    bad = torch.nonzero(lengths % parts != 0).flatten()
    if bad.numel():
        doc = int(bad[0])
        where = f"{fn}: " if fn else ""
        raise RingInputError(
            f"{where}document {doc} of cu_seqlens (tokens {int(cu[doc])}..{int(cu[doc + 1])}) has length "
            f"{int(lengths[doc])}, not divisible by 2 x world_size = {parts} ({bad.numel()} document(s) affected); "
            f"layout='zigzag' cuts every document into {parts} equal chunks: pad each document to a multiple of "
            f"{parts}, or {instead}", argument="cu_seqlens", value=int(lengths[doc]))


# ----------------------------------------------------------------------------------------- positions


def _zigzag_positions(length: int, rank: int, world_size: int, offset: int = 0) -> torch.Tensor:
    """Positions ``offset + ...`` of chunks ``rank`` and ``2N-1-rank`` of a sequence of ``length`` tokens."""
    chunk = length // (2 * world_size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * world_size - 1 - rank) * chunk, (2 * world_size - rank) * chunk)
    return torch.cat([first, second]) + offset


def _positions(total: int, rank: int, world_size: int, layout: str, cu: Optional[torch.Tensor]) -> torch.Tensor:
    """Global (packed) positions held by ``rank``, in local order: LongTensor (total // world_size,).

    ``cu`` is a validated int64 cu_seqlens (varlen) or None. Validates divisibility.
    """
    _check_layout(layout, varlen=cu is not None)
    if cu is not None and int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens[-1] = {int(cu[-1])} must equal the global token count {total} "
            f"(cu_seqlens are the cumulative lengths of the whole packed sequence, identical on every rank)"
        )
    if world_size == 1:  # a world of one holds everything, whatever the layout could split
        return torch.arange(total)
    if layout == "contiguous":
        _check_divisible(total, world_size, layout=layout, what="the global sequence length")
        local = total // world_size
        return torch.arange(rank * local, (rank + 1) * local)
    if layout == "stripe":
        _check_divisible(total, world_size, layout=layout, what="the global sequence length")
        return torch.arange(rank, total, world_size)
    if cu is None:
        _check_divisible(total, 2 * world_size, layout=layout, what="the global sequence length")
        return _zigzag_positions(total, rank, world_size)
    check_zigzag_documents(cu, world_size, instead="shard with layout='contiguous' (ring_attn_varlen_func, "
                                                    "llama3_attn_varlen_func)")
    pieces = [
        _zigzag_positions(int(cu[d + 1] - cu[d]), rank, world_size, offset=int(cu[d])) for d in range(cu.numel() - 1)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def local_positions(
    seqlen_global: int, group=None, *, layout: str, cu_seqlens: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Global positions this rank holds, in local order: LongTensor (seqlen_global // N,) on the CPU.

    ``shard(x, layout=..., dim=d)`` equals ``x.index_select(d, local_positions(x.size(d), layout=...))``.
    For varlen these index the packed token stream (see ``local_varlen`` for positions within documents).
    """
    if isinstance(seqlen_global, bool) or not isinstance(seqlen_global, int) or seqlen_global < 0:
        raise TypeError(f"seqlen_global must be a non-negative int, got {seqlen_global!r}")
    rank, world_size = _rank_and_size(group)
    cu = check_cu_seqlens(cu_seqlens) if cu_seqlens is not None else None
    return _positions(seqlen_global, rank, world_size, layout, cu)


def rank_positions(seqlen_global: int, rank: int, world_size: int, *, layout: str,
                   cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Global positions rank ``rank`` of ``world_size`` holds, in its local order: LongTensor
    (seqlen_global // world_size,) on the CPU. ``local_positions`` for any rank, no process group needed (a
    caller that regathers every rank's part, as Ulysses' all-to-all does, needs all of them)."""
    if isinstance(seqlen_global, bool) or not isinstance(seqlen_global, int) or seqlen_global < 0:
        raise TypeError(f"seqlen_global must be a non-negative int, got {seqlen_global!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} is not a rank of a group of world_size={world_size!r}")
    cu = check_cu_seqlens(cu_seqlens) if cu_seqlens is not None else None
    return _positions(seqlen_global, rank, world_size, layout, cu)


@dataclass(frozen=True)
class LocalVarlen:
    """What one rank holds of a packed varlen sequence (all tensors on the CPU, T_local = T // N tokens).

    positions:     LongTensor (T_local,)  index of each local token in the global packed stream
    doc_ids:       LongTensor (T_local,)  document of each local token
    doc_positions: LongTensor (T_local,)  position of each local token inside its document (RoPE position ids)
    cu_seqlens:    IntTensor (num_docs + 1,) int32, cumulative *local* token counts per global document
                   (a document this rank holds nothing of has length 0 here)
    max_seqlen:    int, the longest local document part
    """

    positions: torch.Tensor
    doc_ids: torch.Tensor
    doc_positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def rank_varlen(cu: torch.Tensor, rank: int, world_size: int, layout: str) -> LocalVarlen:
    """``local_varlen`` for any rank, no process group needed; ``cu`` as ``check_cu_seqlens`` returns it."""
    positions = _positions(int(cu[-1]), rank, world_size, layout, cu)
    # right=True: a token at a document's first position belongs to that document even after empty ones.
    doc_ids = torch.searchsorted(cu, positions, right=True) - 1
    doc_positions = positions - cu[doc_ids]
    counts = torch.bincount(doc_ids, minlength=cu.numel() - 1)
    local_cu = torch.zeros(cu.numel(), dtype=torch.int32)
    local_cu[1:] = torch.cumsum(counts, 0).to(torch.int32)
    max_seqlen = int(counts.max()) if counts.numel() else 0
    return LocalVarlen(positions, doc_ids, doc_positions, local_cu, max_seqlen)


def local_varlen(cu_seqlens: torch.Tensor, group=None, *, layout: str) -> LocalVarlen:
    """Describe this rank's part of the packed sequence with global ``cu_seqlens`` (see ``LocalVarlen``)."""
    rank, world_size = _rank_and_size(group)
    return rank_varlen(check_cu_seqlens(cu_seqlens), rank, world_size, layout)


# --------------------------------------------------------------------------------------- shard/unshard


def _check_tensor_dim(x, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is not a dimension of {name} with shape {tuple(x.shape)}")
    return dim % x.dim()


def _check_varlen_length(cu: torch.Tensor, length: int, dim: int, shape, name: str) -> None:
    if int(cu[-1]) != length:
        raise ValueError(
            f"cu_seqlens[-1] = {int(cu[-1])} must equal the global token count along dim={dim} of {name} "
            f"(size {length}, shape {tuple(shape)}); varlen tensors are (tokens, nheads, headdim): pass dim=0"
        )


def shard(x: torch.Tensor, group=None, *, layout: str, dim: int = 1, cu_seqlens: Optional[torch.Tensor] = None):
    """This rank's part of the global tensor ``x`` along ``dim`` (e.g. (B, S, H, D) -> (B, S/N, H, D)).

    For varlen pass the global ``cu_seqlens`` and the token dimension (``dim=0`` for (T, H, D)).
    """
    dim = _check_tensor_dim(x, dim, "x")
    rank, world_size = _rank_and_size(group)
    cu = check_cu_seqlens(cu_seqlens) if cu_seqlens is not None else None
    if cu is not None:
        _check_varlen_length(cu, x.size(dim), dim, x.shape, "x")
    positions = _positions(x.size(dim), rank, world_size, layout, cu)
    if world_size == 1:
        return x
    return x.index_select(dim, positions.to(x.device))


def _gather_along(x_local: torch.Tensor, dim: int, group, world_size: int) -> torch.Tensor:
    """All ranks' ``x_local`` concatenated along ``dim`` in rank order (no autograd)."""
    parts: List[torch.Tensor] = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter_along(x_full: torch.Tensor, dim: int, group, world_size: int) -> torch.Tensor:
    """Sum over ranks of ``x_full``, then this rank's chunk along ``dim`` (rank-order chunks)."""
    chunks = [c.contiguous() for c in x_full.chunk(world_size, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _Unshard(torch.autograd.Function):
    """Gather local parts into the global tensor; backward: sum the gradient over ranks, keep our part."""

    @staticmethod
    def forward(ctx, x_local, dim, group, world_size, order, inverse):
        ctx.dim, ctx.group, ctx.world_size = dim, group, world_size
        ctx.order = order
        stacked = _gather_along(x_local, dim, group, world_size)  # rank-major order
        return stacked.index_select(dim, inverse.to(stacked.device))

    @staticmethod
    def backward(ctx, grad_full):
        rank_major = grad_full.index_select(ctx.dim, ctx.order.to(grad_full.device))
        grad_local = _reduce_scatter_along(rank_major, ctx.dim, ctx.group, ctx.world_size)
        return grad_local, None, None, None, None, None


def unshard(
    x_local: torch.Tensor, group=None, *, layout: str, dim: int = 1, cu_seqlens: Optional[torch.Tensor] = None
):
    """Gather every rank's part along ``dim`` back into the global tensor (inverse of ``shard``).

    Collective: every rank of ``group`` must call it with a tensor of the same shape. Differentiable (the
    backward sums over ranks, see the module docstring).
    """
    dim = _check_tensor_dim(x_local, dim, "x_local")
    rank, world_size = _rank_and_size(group)
    total = x_local.size(dim) * world_size
    cu = check_cu_seqlens(cu_seqlens) if cu_seqlens is not None else None
    if cu is not None and int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens[-1] = {int(cu[-1])} must equal the global token count: {world_size} ranks x "
            f"{x_local.size(dim)} local tokens along dim={dim} of x_local (shape {tuple(x_local.shape)}) = {total}"
            f"; varlen tensors are (tokens, nheads, headdim): pass dim=0"
        )
    # order[i] = global position of the i-th row of the rank-major concatenation.
    order = torch.cat([_positions(total, r, world_size, layout, cu) for r in range(world_size)])
    if world_size == 1:
        return x_local
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total)
    return _Unshard.apply(x_local, dim, group, world_size, order, inverse)
