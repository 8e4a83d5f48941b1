"""Overlap evidence: the same ring run with its communication replaced by local copies.

``no_communication(variant)`` patches the one place each variant moves data between ranks:

- ring, zigzag, stripe, ring_varlen, zigzag_varlen: ``ring_kernels.comm.RingExchange.start`` (every transfer of
  the ring engine, either direction: K/V r -> r+1 in the forward; K/V and the dK/dV partial sums r -> r-1 in
  the backward) becomes what a ring of one rank does: copy each send buffer into its receive buffer.
- llama3: the module-level all-to-all ``ring_kernels.llama3.all_to_all_single`` (the K/V rows other ranks read,
  and their gradients back) becomes a copy of as many leading rows of the send buffer as both buffers hold (the
  two differ in size: a rank sends and receives different rows), returning a finished work object.
- ulysses, ulysses_varlen: the all-to-all ``ring_kernels.ulysses.all_to_all_single`` becomes one copy of the
  send buffer into the receive buffer (each rank's slot keeps what was meant for that rank), returning a
  finished work object; usp: both that and the ring's ``RingExchange.start``.

Everything else (the per-block kernels, the LSE merge, the gradient accumulation, buffer management) runs
unchanged, so

    T_ring - T_ring_nocomm  = the communication time the ring failed to hide,
    T_ring_nocomm - T_ideal = the cost of the ring's own work around the kernels (merge, copies, launches).

The outputs of such a run are wrong by design (every rank sees only its own K/V); it is only timed. The
stand-ins count their calls: a run in which none was called bypassed them (it still communicated), and its
time must be discarded — the caller checks ``counter.calls``.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from _runners import USP_RING_VARIANTS as _USP_VARIANTS   # USP variant -> the ring variant across its groups

__all__ = ["no_communication", "nocomm_unavailable_reason", "nothing_to_exchange", "NoCommCounter"]

_RING_EXCHANGE_VARIANTS = frozenset({"ring", "zigzag", "stripe", "ring_varlen", "zigzag_varlen"})
_LLAMA3_COLLECTIVES = ("all_to_all_single",)
_ULYSSES_VARIANTS = frozenset({"ulysses", "ulysses_varlen"})
_ULYSSES_COLLECTIVE = "all_to_all_single"


class NoCommCounter:
    """How many exchanges / collectives the stand-ins replaced."""

    def __init__(self) -> None:
        self.calls = 0


class _Done:
    """A finished work handle (what ``async_op=True`` collectives return), for the stand-ins."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def nothing_to_exchange(variant: str, doc_lengths: Optional[Sequence[int]], world: int) -> bool:
    """True where ``variant`` moves nothing between ranks for these documents (causal, no window), so a run that
    never called the stand-ins did not bypass them: llama3 when its plan has no exchange (no document crosses a
    rank boundary)."""
    if variant != "llama3" or not doc_lengths or world < 2:
        return False
    from ring_kernels.llama3 import llama3_plan

    cu = torch.tensor([0, *itertools.accumulate(doc_lengths)])
    return llama3_plan(cu, 0, world, int(cu[-1]) // world, True, (-1, -1)).exchange is None


def nocomm_unavailable_reason(variant: str) -> Optional[str]:
    """None if ``variant`` can be timed without communication, else why not."""
    if variant in _RING_EXCHANGE_VARIANTS:
        try:
            from ring_kernels.comm import RingExchange
        except ImportError as exc:
            return f"ring_kernels.comm.RingExchange is not importable ({exc})"
        if not callable(getattr(RingExchange, "start", None)):
            return "ring_kernels.comm.RingExchange has no start() to replace"
        return None
    if variant == "llama3":
        try:
            import ring_kernels.llama3 as llama3
        except ImportError as exc:
            return f"ring_kernels.llama3 is not importable ({exc})"
        missing = [n for n in _LLAMA3_COLLECTIVES if not callable(getattr(llama3, n, None))]
        return f"ring_kernels.llama3 has no {missing} to replace" if missing else None
    if variant in _ULYSSES_VARIANTS or variant in _USP_VARIANTS:
        try:
            import ring_kernels.ulysses as ulysses
        except ImportError as exc:
            return f"ring_kernels.ulysses is not importable ({exc})"
        if not callable(getattr(ulysses, _ULYSSES_COLLECTIVE, None)):
            return f"ring_kernels.ulysses has no {_ULYSSES_COLLECTIVE} to replace"
        return nocomm_unavailable_reason(_USP_VARIANTS[variant]) if variant in _USP_VARIANTS else None
    return f"no communication stand-in is known for variant {variant!r}"


def _local_copy(send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> None:
    if len(send) != len(recv):
        raise ValueError(f"RingExchange.start (no-communication stand-in): {len(send)} tensors to send but "
                         f"{len(recv)} receive buffers")
    for s, r in zip(send, recv):
        r.copy_(s)


def _ring_patches(counter: NoCommCounter) -> List[Tuple[object, str, object]]:
    from ring_kernels.comm import RingExchange

    def start_without_communication(self, send, recv):
        counter.calls += 1
        _local_copy(send, recv)

    return [(RingExchange, "start", start_without_communication)]


def _llama3_patches(counter: NoCommCounter) -> List[Tuple[object, str, object]]:
    import ring_kernels.llama3 as llama3

    def all_to_all_without_communication(output, input, output_split_sizes=None, input_split_sizes=None,
                                         group=None, async_op=False):
        counter.calls += 1
        rows = min(output.shape[0], input.shape[0])
        output[:rows].copy_(input[:rows])
        return _Done() if async_op else None

    return [(llama3, "all_to_all_single", all_to_all_without_communication)]


def _ulysses_patches(counter: NoCommCounter) -> List[Tuple[object, str, object]]:
    import ring_kernels.ulysses as ulysses

    def all_to_all_without_communication(output, input, output_split_sizes=None, input_split_sizes=None,
                                         group=None, async_op=False):
        counter.calls += 1
        output.copy_(input)
        return _Done() if async_op else None

    return [(ulysses, _ULYSSES_COLLECTIVE, all_to_all_without_communication)]


def _patches(variant: str, counter: NoCommCounter) -> List[Tuple[object, str, object]]:
    if variant == "llama3":
        return _llama3_patches(counter)
    if variant in _ULYSSES_VARIANTS:
        return _ulysses_patches(counter)
    if variant in _USP_VARIANTS:
        ring = _llama3_patches(counter) if _USP_VARIANTS[variant] == "llama3" else _ring_patches(counter)
        return _ulysses_patches(counter) + ring
    return _ring_patches(counter)


@contextlib.contextmanager
def no_communication(variant: str) -> Iterator[NoCommCounter]:
    """Within the block, ``variant`` copies locally instead of communicating; restored on exit.

    Yields a ``NoCommCounter`` of the replaced calls. Raises ``ValueError`` for a variant without a stand-in
    (see ``nocomm_unavailable_reason``).
    """
    reason = nocomm_unavailable_reason(variant)
    if reason is not None:
        raise ValueError(f"no_communication(variant={variant!r}): {reason}")
    counter = NoCommCounter()
    patches = _patches(variant, counter)
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield counter
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
