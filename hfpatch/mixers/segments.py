"""Where this rank's tokens lie in the global sequence, and the exchange of per-segment state summaries.

A *segment* is a maximal run of tokens that are consecutive both in this rank's local tensor and in the global
sequence: one per rank for the contiguous layout (ring, llama3), two per rank for zigzag (chunks r and 2N-1-r),
two per document and rank for zigzag varlen. The stripe layout (one token per segment) is refused: its summaries
would be as large as the sequence.

``SegmentPlan.exchange`` is the one collective of a sequence mixer under CP. Every rank summarises each of its
segments as if it started from a zero state (kind-specific: a state transition and a zero-start final state, a
convolution's last inputs, ...); one differentiable all-gather gives every rank every segment's summary; each rank
then folds the summaries in GLOBAL order with the kind's ``compose`` to get the state entering each of its own
segments. Its backward is one all-reduce of the gathered summaries' gradient (each rank keeps its own rows), so
gradients flow from every rank's outputs back into the segments that produced the states they read.

Shapes: summaries are tensors (or tuples of tensors) of the same shapes for every segment, e.g. (B, H, dk, dv);
what travels is ``world_size x segments_per_rank`` of them, never anything of the sequence's length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hfpatch.errors import UnsupportedArgument

__all__ = ["Segment", "SegmentPlan", "segments_of_layout", "all_gather_differentiable", "map_segments"]

Summary = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Segment:
    """``length`` tokens held by ``rank`` at local offset ``local_start`` and global offset ``global_start``;
    ``local_index``: its place among that rank's segments in local order."""

    rank: int
    local_index: int
    local_start: int
    length: int
    global_start: int


def segments_of_layout(layout: str, world_size: int, seq_local: int,
                       cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[Segment, ...]:
    """Every rank's segments, sorted by global offset, for a row of ``seq_local * world_size`` tokens split by
    ``layout`` ("contiguous" | "zigzag"; ``cu_seqlens``: global int cumulative document lengths of a packed row,
    zigzag varlen splitting each document). Agrees with ``ring_kernels.layout.local_positions``."""
    if layout == "stripe":
        raise UnsupportedArgument(
            "kernel", "stripe",
            "the stripe layout gives every rank one token per global run, so a sequence mixer's state summaries "
            "would be as long as the sequence.",
            "use kernel='zigzag' (the default for batches) or 'ring' / 'llama3' for models with sequence mixers.",
        )
    pieces: list[tuple[int, int, int, int]] = []  # (rank, local_start, length, global_start)
    if layout == "contiguous":
        pieces = [(r, 0, seq_local, r * seq_local) for r in range(world_size)]
    elif layout == "zigzag" and cu_seqlens is None:
        chunk = seq_local // 2
        for r in range(world_size):
            pieces += [(r, 0, chunk, r * chunk), (r, chunk, chunk, (2 * world_size - 1 - r) * chunk)]
    elif layout == "zigzag":
        cu = [int(c) for c in cu_seqlens.detach().to("cpu", torch.int64).tolist()]
        for start, end in zip(cu[:-1], cu[1:]):
            chunk = (end - start) // (2 * world_size)
            if chunk == 0:
                continue
            local = start // world_size  # every document contributes (end - start) / N tokens to every rank
            for r in range(world_size):
                pieces += [(r, local, chunk, start + r * chunk),
                           (r, local + chunk, chunk, start + (2 * world_size - 1 - r) * chunk)]
    else:
        raise ValueError(f"layout={layout!r}: expected 'contiguous', 'zigzag' or 'stripe'")
    counters = [0] * world_size
    segments = []
    for rank, local_start, length, global_start in sorted(pieces, key=lambda p: (p[0], p[1])):
        segments.append(Segment(rank, counters[rank], local_start, length, global_start))
        counters[rank] += 1
    return tuple(sorted(segments, key=lambda s: s.global_start))


class _AllGather(torch.autograd.Function):
    """(R, F) on every rank -> (world, R, F); backward: the gradient summed over ranks, this rank's rows."""

    @staticmethod
    def forward(ctx, x, group, rank, world_size):
        ctx.group, ctx.rank = group, rank
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class _Tie(torch.autograd.Function):
    """``state`` unchanged; its backward also gives ``anchor`` a zero gradient, so that a rank whose outputs read
    no other rank's summary (rank 0 of the contiguous layout) still runs the all-gather's backward collective."""

    @staticmethod
    def forward(ctx, state, anchor):
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return state.view_as(state)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)


def all_gather_differentiable(x: torch.Tensor, group, rank: int, world_size: int) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: (world, *x.shape). Collective; differentiable (the backward is
    one all-reduce of the gradient, then this rank's slice)."""
    return _AllGather.apply(x, group, rank, world_size)


def _as_tuple(summary: Summary) -> Tuple[torch.Tensor, ...]:
    return summary if isinstance(summary, tuple) else (summary,)


def map_segments(fn: Callable[..., Any], parts: Sequence[Sequence[torch.Tensor]]) -> list:
    """``[fn(*p) for p in parts]``, computed in ONE call of ``fn`` when every segment's tensors have the same
    shapes (zigzag, contiguous): the segments are concatenated along dim 0 (the batch) and the results split back.
    ``fn`` returns a tensor or a tuple of tensors (or None entries), each with the batch as dim 0."""
    if len(parts) > 1 and all(all(a.shape == b.shape for a, b in zip(p, parts[0])) for p in parts[1:]):
        batch = parts[0][0].shape[0]
        result = fn(*[torch.cat(column, dim=0) for column in zip(*parts)])
        single = not isinstance(result, tuple)
        columns = [r.split(batch, dim=0) if r is not None else [None] * len(parts)
                   for r in ((result,) if single else result)]
        rows = list(zip(*columns))
        return [row[0] if single else tuple(row) for row in rows]
    return [fn(*p) for p in parts]


class SegmentPlan:
    """This step's segments for one (batch, local length), and the exchange of summaries over the group.

    ``segments``: every rank's segments in global order. ``local``: this rank's, in local order.
    """

    def __init__(self, segments: Tuple[Segment, ...], *, rank: int, world_size: int, group: Any,
                 layout: str, cu_seqlens: Optional[torch.Tensor] = None) -> None:
        self.segments = segments
        self.rank, self.world_size, self.group = rank, world_size, group
        self.layout, self.cu_seqlens = layout, cu_seqlens
        self.local = tuple(sorted((s for s in segments if s.rank == rank), key=lambda s: s.local_index))
        self.per_rank = max(sum(1 for s in segments if s.rank == r) for r in range(world_size))

    def split(self, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        """This rank's segments of ``x`` along its token dimension ``dim``, in local order."""
        return [x.narrow(dim, s.local_start, s.length) for s in self.local]

    def join(self, parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of ``split``."""
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)

    def exchange(self, summaries: Sequence[Summary], compose: Callable[[Any, Tuple[torch.Tensor, ...], Segment], Any],
                 initial: Any) -> list:
        """The state entering each of this rank's segments (local order).

        summaries: one per local segment (local order): a tensor or tuple of tensors, same shapes and dtype for
                   every segment and rank (the segment's zero-start summary).
        compose:   ``(state entering a segment, that segment's summary as a tuple, the Segment) -> state leaving
                   it``; applied in global order from ``initial`` (a tensor: the state before the first token).
        One all-gather; differentiable through the summaries, ``compose`` and ``initial``.
        """
        rows = [_as_tuple(s) for s in summaries]
        shapes = [t.shape for t in rows[0]]
        flat = torch.stack([torch.cat([t.reshape(-1) for t in row]) for row in rows])
        if flat.shape[0] < self.per_rank:  # equal shapes for the all-gather: pad with rows nobody reads
            flat = torch.cat([flat, flat.new_zeros(self.per_rank - flat.shape[0], flat.shape[1])])
        gathered = all_gather_differentiable(flat, self.group, self.rank, self.world_size)
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        entering: dict[int, Any] = {}
        # Every rank's outputs depend on the gathered tensor, so every rank joins its backward all-reduce.
        state = _Tie.apply(initial, gathered) if torch.is_grad_enabled() and gathered.requires_grad else initial
        last = max(s.global_start for s in self.local)
        for segment in self.segments:
            if segment.rank == self.rank:
                entering[segment.local_index] = state
            if segment.global_start >= last:
                break
            row = gathered[segment.rank, segment.local_index]
            summary = tuple(piece.reshape(shape) for piece, shape in zip(row.split(sizes), shapes))
            state = compose(state, summary, segment)
        return [entering[s.local_index] for s in self.local]
