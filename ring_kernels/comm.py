"""Point-to-point ring exchange: send tensors to the next rank while receiving from the previous one
(or, with ``reverse=True``, to the previous rank while receiving from the next).

Ring variants (batch and varlen) move K/V blocks forward around the ring (r -> r+1); the backward visits the
blocks in reverse order, so its K/V blocks and the dK/dV partial sums one step behind them travel the other
way (r -> r-1). Each ``RingExchange`` owns one in-flight exchange at a time; use two objects (e.g. one for
K/V, one for dK/dV) to have both in flight. Every rank must start exchanges in the same order (NCCL matches
point-to-point operations by issue order).

    ex = RingExchange(group)
    ex.start([k, v], [k_next, v_next])   # non-blocking: k -> rank+1, k_next <- rank-1
    ...compute on k, v...
    ex.wait()                            # k_next/v_next are filled; k/v may be overwritten again

    back = RingExchange(group, tag=1, reverse=True)
    back.start([dk, dv], [dk_in, dv_in]) # dk -> rank-1, dk_in <- rank+1
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["RingExchange", "group_rank_and_size"]


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple:
    """(rank, world_size) in ``group``; ``(0, 1)`` when torch.distributed is not initialised and group is None."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class RingExchange:
    """Non-blocking send of a list of tensors to the next rank and receive of as many from the previous
    (``reverse=True``: send to the previous rank, receive from the next).

    ``tag`` separates independent exchanges between the same pair of ranks on backends that honour tags (gloo);
    NCCL ignores tags and relies on every rank issuing the exchanges in the same order.
    ``next_rank``/``prev_rank`` are the ring neighbours (global ranks) whatever the direction;
    ``send_rank``/``recv_rank`` are the peers of this exchange's direction.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, tag: int = 0, reverse: bool = False):
        if not isinstance(reverse, bool):
            raise TypeError(f"RingExchange: reverse={reverse!r} must be a bool (True: send to the previous rank "
                            f"and receive from the next; False, the default: the other way)")
        self.group = group
        self.tag = tag
        self.reverse = reverse
        self.rank, self.world_size = group_rank_and_size(group)
        self.next_rank = self._global((self.rank + 1) % self.world_size)
        self.prev_rank = self._global((self.rank - 1) % self.world_size)
        self.send_rank, self.recv_rank = ((self.prev_rank, self.next_rank) if reverse
                                          else (self.next_rank, self.prev_rank))
        self._requests: List = []

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> None:
        """Begin sending ``send[i]`` to ``send_rank`` and receiving into ``recv[i]`` from ``recv_rank`` (the
        next and the previous rank; the other way round when ``reverse``).

        ``recv[i]`` must have the shape/dtype of what ``recv_rank`` sends as its ``send[i]``; tensors must be
        contiguous. Neither may be touched until ``wait()`` returns.
        """
        if self._requests:
            raise RuntimeError("RingExchange.start: the previous exchange was not waited for")
        if len(send) != len(recv):
            raise ValueError(f"RingExchange.start: {len(send)} tensors to send but {len(recv)} receive buffers")
        if self.world_size == 1:
            for s, r in zip(send, recv):   # a ring of one: what we send comes straight back
                r.copy_(s)
            return
        ops = []
        for s, r in zip(send, recv):
            if not (s.is_contiguous() and r.is_contiguous()):
                raise ValueError("RingExchange.start: tensors must be contiguous")
            ops.append(dist.P2POp(dist.isend, s, self.send_rank, self.group, self.tag))
            ops.append(dist.P2POp(dist.irecv, r, self.recv_rank, self.group, self.tag))
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        """Block until the current exchange completed (on CUDA: until the current stream is ordered after it)."""
        for req in self._requests:
            req.wait()
        self._requests = []

    @property
    def in_flight(self) -> bool:
        return bool(self._requests)
