"""Each row rounded once: how the contributions of several blocks to the same rows combine, and the folds.

A ring variant computes a query row's output from several blocks (one per K/V block that row sees), and a
K/V row's gradient from several blocks too. The rule every variant follows: every value is rounded to its
output dtype exactly once, and fp32 intermediates exist only where a value receives >= 3 contributions.

``plan_rows`` counts, from the row ranges of the contributors alone and in the order they come, how many
contributions each row range gets, and says for every contribution what it does (``Part.action``): the first
stays in (or is copied to) the result buffer -- a first contributor covering every row can *be* the result
(``RowPlan.adopt``: no copy); a row's last contribution merges (or adds) straight into the result with fp32
math; only rows with >= 3 contributions use an fp32 accumulator (``RowPlan.accumulates``), opened by their
second contribution and closed by the last, with the cast fused. ``fold_outputs`` applies a plan to attention
outputs (LSE merge, ``merge.merge_``), ``fold_grads`` to gradients (sums, ``merge.add_``).

Shapes: outputs and gradients (B, S, H, D); lse (B, H, S) fp32. Views are fine (llama3 passes head slices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .merge import add_, merge_

__all__ = ["FIRST", "LAST_OF_TWO", "OPEN", "MIDDLE", "CLOSE", "Part", "RowPlan", "row_bounds", "plan_rows",
           "adoptable", "fold_outputs", "fold_grads", "accumulator"]


# What one contribution (a block's rows) does, given how many the rows got before it (i) and get in all (n).
FIRST = "first"              # i = 1: becomes the holder (the result buffer), or is it (adopted, no copy)
LAST_OF_TWO = "last_of_two"  # i = 2 = n: result = holder (+) block, one rounding, no fp32 buffer
OPEN = "open"                # i = 2 < n: fp32 accumulator = holder (+) block
MIDDLE = "middle"            # 2 < i < n: accumulator (+)= block
CLOSE = "close"              # i = n > 2: result = accumulator (+) block, cast fused


def _action(i: int, n: int) -> str:
    if i == 1:
        return FIRST
    if n == 2:
        return LAST_OF_TWO
    return OPEN if i == 2 else (MIDDLE if i < n else CLOSE)


@dataclass(frozen=True)
class Part:
    """Rows ``rows`` of the local tensor receive rows ``block_rows`` of one block's result, by ``action``."""

    rows: slice
    block_rows: slice
    action: str


@dataclass(frozen=True)
class RowPlan:
    """How the contributions of a sequence of row ranges combine over n rows.

    ``parts[i]``: the parts of contributor i, in order. ``untouched``: row ranges no contributor reaches (zero
    them, or pass the holder through). ``adopt``: the first contributor covers every row and is the first of
    all, so its tensor can be the result. ``accumulates``: some rows get >= 3 contributions (an fp32 buffer).
    """

    parts: Tuple[Tuple[Part, ...], ...]
    untouched: Tuple[slice, ...]
    adopt: bool
    accumulates: bool


def row_bounds(rows: slice, n: int) -> Tuple[int, int]:
    start, stop, step = rows.indices(n)
    assert step == 1, f"block rows {rows} must be a unit-step slice"
    return start, max(start, stop)


def plan_rows(ranges: Sequence[Tuple[int, int]], n: int, initial: int = 0) -> RowPlan:
    """Plan contributions over rows [0, n): ``ranges`` are the contributors' (start, stop) in order; every row
    already holds ``initial`` contributions (0, or 1 for a dK/dV partial sum received from the previous rank).
    Pure Python over range ends: O(contributors x elementary segments they cover), no tensor is inspected."""
    cuts = sorted({0, n, *(a for a, _ in ranges), *(b for _, b in ranges)})
    where = {c: i for i, c in enumerate(cuts)}
    total = [initial] * (len(cuts) - 1)
    for a, b in ranges:
        for seg in range(where[a], where[b]):
            total[seg] += 1
    seen = list([initial] * len(total))
    parts = []
    for a, b in ranges:
        mine: List[Part] = []
        for seg in range(where[a], where[b]):
            seen[seg] += 1
            lo, hi, act = cuts[seg], cuts[seg + 1], _action(seen[seg], total[seg])
            if mine and mine[-1].action == act and mine[-1].rows.stop == lo:
                prev = mine[-1]
                mine[-1] = Part(slice(prev.rows.start, hi), slice(prev.block_rows.start, hi - a), act)
            else:
                mine.append(Part(slice(lo, hi), slice(lo - a, hi - a), act))
        parts.append(tuple(mine))
    untouched: List[slice] = []
    for seg, count in enumerate(total):
        if count == initial and cuts[seg + 1] > cuts[seg]:
            if untouched and untouched[-1].stop == cuts[seg]:
                untouched[-1] = slice(untouched[-1].start, cuts[seg + 1])
            else:
                untouched.append(slice(cuts[seg], cuts[seg + 1]))
    adopt = initial == 0 and bool(ranges) and ranges[0] == (0, n)
    return RowPlan(tuple(parts), tuple(untouched), adopt, any(t >= 3 for t in total))




def adoptable(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """A backend's result can become ours (returned, sent, merged into in place) without a copy."""
    return x.dtype == dtype and x.is_contiguous()



def fold_outputs(parts: Sequence[Part], out: torch.Tensor, lse: torch.Tensor, result: torch.Tensor,
                  result_lse: torch.Tensor, acc: Optional[torch.Tensor]) -> None:
    """Fold one block's out (B, Sb, H, D) and lse (B, H, Sb) into ``result`` (B, S, H, D) / ``result_lse``
    (B, H, S), which hold the rows' first contribution; ``acc`` (fp32, like result) for rows with >= 3.
    Views are fine (llama3 passes head slices)."""
    for part in parts:
        r, g, gl = part.rows, out[:, part.block_rows], lse[:, :, part.block_rows]
        held, held_lse = result[:, r], result_lse[:, :, r]
        if part.action == FIRST:
            held.copy_(g)
            held_lse.copy_(gl)
        elif part.action == LAST_OF_TWO:
            merge_(held, held, held_lse, g, gl)
        elif part.action == OPEN:
            assert acc is not None, "rows with >= 3 contributions but no fp32 accumulator was planned"
            merge_(acc[:, r], held, held_lse, g, gl)
        elif part.action == MIDDLE:
            merge_(acc[:, r], acc[:, r], held_lse, g, gl)
        else:
            merge_(held, acc[:, r], held_lse, g, gl)



def fold_grads(parts: Sequence[Part], grad: torch.Tensor, holder: torch.Tensor, result: torch.Tensor,
                acc: torch.Tensor) -> None:
    """Fold one block's gradient (B, Sb, H, D) into ``result`` (the rows' first contribution lives in
    ``holder``; ``acc`` is fp32 for rows with >= 3). Each row is rounded to ``result``'s dtype once."""
    for part in parts:
        r, g = part.rows, grad[:, part.block_rows]
        if part.action == FIRST:
            result[:, r].copy_(g)
        elif part.action == LAST_OF_TWO:
            add_(result[:, r], holder[:, r], g)
        elif part.action == OPEN:
            assert acc is not None, "rows with >= 3 contributions but no fp32 accumulator was planned"
            add_(acc[:, r], holder[:, r], g)
        elif part.action == MIDDLE:
            add_(acc[:, r], acc[:, r], g)
        else:
            add_(result[:, r], acc[:, r], g)


def accumulator(result: torch.Tensor, holder: torch.Tensor,
                 spare: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The fp32 buffer of rows with >= 3 contributions: the result or the holder when fp32, else ``spare``."""
    if result.dtype == torch.float32:
        return result
    if holder.dtype == torch.float32:
        return holder                                 # a received fp32 partial sum: ours to overwrite
    return spare                                      # None when no row needs one (checked where used)

