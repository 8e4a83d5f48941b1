"""The prologue of every public kernel: its arguments checked, its group resolved, the ranks' agreement.

    call = KernelCall(fn, q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                      softcap=softcap, dropout_p=dropout_p, sink=sink)    # local checks, no communication
    ...the kernel's own checks of its arguments (its layout, its ring variant, its groups)...
    call.agree_batch(group, q, k, layout_code)      # rank and world, then one all_gather of the call's metadata

``KernelCall`` checks, in this order, q, k and v (``validation.check_qkv``), window, softcap and dropout, the
softmax scale, and the sink. ``agree_batch`` (batch kernels) resolves the group (``comm.group_rank_and_size``),
refuses an empty batch or shard, and runs ``validation.check_ranks_agree`` over ``fields`` where the group has
more than one rank. ``documents.VarlenCall`` is the same prologue for packed documents, with the cu_seqlens
checks in its second step. Every error is a ``RingInputError`` (or a ``TypeError`` for a non-tensor) naming
``fn``, the public function the caller called.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from . import validation
from .comm import group_rank_and_size
from .errors import RingInputError

__all__ = ["KernelCall"]

Field = Tuple[str, float]


class KernelCall:
    """The validated arguments of one call of the public function ``fn``: ``window`` (left, right) ints,
    ``scale``, ``softcap`` (floats), ``causal`` (bool), ``has_sink``; ``rank`` and ``world`` in the call's
    group, set by the second step (``agree_batch``, or ``VarlenCall``'s own; 0 and 1 until then).

    q: (B, S, H, D), k, v: (B, S, Hk, D); with ``varlen``: (T, H, D), (T, Hk, D), or all three as one packed row
    (1, T, H|Hk, D)."""

    def __init__(self, fn: str, q, k, v, *, causal, softmax_scale, window_size, softcap, dropout_p, sink,
                 varlen: bool = False):
        validation.check_qkv(fn, q, k, v, varlen=varlen)
        self.window = validation.check_options(fn, window_size=window_size, softcap=softcap, dropout_p=dropout_p)
        self.scale = validation.resolve_scale(fn, softmax_scale, q.shape[-1])
        validation.check_sink(fn, sink, q.shape[-2], q.device)
        self.fn = fn
        self.softcap = float(softcap)
        self.causal = bool(causal)
        self.has_sink = sink is not None
        self.rank, self.world = 0, 1

    def fields(self, layout_code: int, q: torch.Tensor, k: torch.Tensor, shape: Sequence[Field],
               tail: Sequence[Field] = ()) -> List[Field]:
        """What every rank must pass alike: the kernel (``layout_code``, a ``validation.LayoutCode``), the
        local ``shape`` (name, size) pairs, heads, head dim, dtype and options, then ``tail``."""
        return [("layout", layout_code), *shape, ("nheads", q.shape[-2]), ("nheads_k", k.shape[-2]),
                ("headdim", q.shape[-1]), ("dtype", validation.dtype_code(q.dtype)), ("causal", int(self.causal)),
                ("softmax_scale", self.scale), ("softcap", self.softcap), ("window_left", self.window[0]),
                ("window_right", self.window[1]), *tail]

    def agree(self, group, fields: Sequence[Field], device: torch.device) -> None:
        """Every rank of ``group`` passed the same ``fields`` (one all_gather; none in a world of one)."""
        if self.world > 1:
            validation.check_ranks_agree(self.fn, group, fields, device)

    def agree_batch(self, group, q: torch.Tensor, k: torch.Tensor, layout_code: int,
                    ranks: Optional[Tuple[int, int]] = None) -> None:
        """The second step of a batch kernel: ``rank`` and ``world`` in ``group`` (``ranks`` where the caller
        resolved them, e.g. USP's grid), a batch and shard of at least one row and token, then the ranks'
        agreement on the call's metadata."""
        self.rank, self.world = ranks if ranks is not None else group_rank_and_size(group)
        b, s = q.shape[0], q.shape[1]
        if s == 0 or b == 0:
            raise RingInputError(
                f"{self.fn}: q has shape {tuple(q.shape)}; batch and seqlen_local must be >= 1 on every rank",
                argument="q", value=tuple(q.shape))
        shape = [("batch", b), ("seqlen_local", s)]
        self.agree(group, self.fields(layout_code, q, k, shape, [("sink", int(self.has_sink))]), q.device)
