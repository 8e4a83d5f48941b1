"""Overlap evidence: the same ring run with its point-to-point communication replaced by local copies.

``no_communication()`` patches ``ring_kernels.comm.RingExchange.start`` (the one place every P2P ring variant,
batch and varlen, sends K/V and dK/dV) with what a ring of one rank does: copy each send buffer into its
receive buffer on the current stream. Everything else (the per-block kernels, the LSE merge, the gradient
accumulation, the buffer management) runs unchanged, so

    T_ring - T_ring_nocomm  = the communication time the ring failed to hide,
    T_ring_nocomm - T_ideal = the cost of the ring's own work around the kernels (merge, copies, launches).

The outputs of such a run are wrong by design (every rank sees its own K/V N times); it is only timed.
llama3 moves K/V with collectives (all-gather / reduce-scatter), not through ``RingExchange``: it has no
no-communication measurement.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

__all__ = ["NOCOMM_VARIANTS", "no_communication", "nocomm_unavailable_reason", "NoCommCounter"]

NOCOMM_VARIANTS = frozenset({"ring", "zigzag", "stripe", "ring_varlen", "zigzag_varlen"})


def nocomm_unavailable_reason(variant: str) -> Optional[str]:
    """None if ``variant`` can be timed without communication, else why not."""
    if variant not in NOCOMM_VARIANTS:
        return f"{variant} communicates through collectives, not ring_kernels.comm.RingExchange"
    try:
        from ring_kernels.comm import RingExchange
    except ImportError as exc:
        return f"ring_kernels.comm.RingExchange is not importable ({exc})"
    if not callable(getattr(RingExchange, "start", None)):
        return "ring_kernels.comm.RingExchange has no start() to replace"
    return None


class NoCommCounter:
    """How many exchanges the stand-in replaced: zero after a run means the variant bypassed RingExchange
    (it still communicated), so its "no-communication" time would be a lie and is discarded."""

    def __init__(self) -> None:
        self.calls = 0


def _make_local_copy_start(counter: NoCommCounter):
    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> None:
        counter.calls += 1
        _local_copy(send, recv)

    start.__name__ = start.__qualname__ = "start_without_communication"
    return start


def _local_copy(send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> None:
    """Stand-in for ``RingExchange.start``: what a ring of one does, for any ring size."""
    if len(send) != len(recv):
        raise ValueError(f"RingExchange.start (no-communication stand-in): {len(send)} tensors to send but "
                         f"{len(recv)} receive buffers")
    for s, r in zip(send, recv):
        r.copy_(s)


@contextlib.contextmanager
def no_communication() -> Iterator[NoCommCounter]:
    """Within the block, every ``RingExchange`` copies locally instead of sending; restored on exit.

    Yields a ``NoCommCounter`` of the exchanges replaced.
    """
    from ring_kernels.comm import RingExchange

    original = RingExchange.__dict__["start"]
    counter = NoCommCounter()
    RingExchange.start = _make_local_copy_start(counter)
    try:
        yield counter
    finally:
        RingExchange.start = original
