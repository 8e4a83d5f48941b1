"""Activation checkpointing that keeps each ring call's output, so that the recomputation skips the ring forward.

    keeper = OutputKeeper(budget_bytes=8 << 30)              # kept outputs alive at once: at most 8 GiB
    checkpoint_fn = keeping(torch.utils.checkpoint.checkpoint, keeper)
    out = checkpoint_fn(layer, hidden, use_reentrant=False)   # what torch's checkpoint does, ring outputs kept

``keeping(checkpoint_fn, keeper)`` wraps any checkpoint function that runs its ``function`` once in the forward
and again to recompute it in backward (torch's ``checkpoint`` in both modes, HF's ``gradient_checkpointing_func``,
the ``checkpoint_fn`` of torch's ``checkpoint_wrapper``). Each call opens a *region* around ``function``:

- the first run (the forward): every ring call inside (each kernel's autograd function: ring, zigzag, stripe,
  their varlen forms, llama3, Ulysses and USP's head split) computes as usual and offers its merged ``out`` and
  ``lse`` (after a sink is folded in) to the region; the keeper keeps them while the kept bytes alive in all
  regions stay within its budget, and records a gap otherwise;
- every later run (a recomputation): the i-th ring call takes the i-th kept pair instead of running the ring
  forward and its communication; a gap runs the forward again, as under plain checkpointing.

Every kernel makes this handshake through ``kept_forward``. A ring call that took a kept pair builds the same
autograd node as one that computed it, from the same tensors, so its gradients are bitwise those of plain
checkpointing. Only the K/V block the forward ended on is not kept: that call's backward fetches it again, one
K/V hop (r -> r-1) before its first step, instead of holding it (the size of the local k + v) from forward to
backward.

Cost: ``out`` (the query's shape and dtype) and ``lse`` (fp32, batch x heads x local tokens) per kept call. A
pair is released when the recomputation takes it, or when its region is freed (the autograd graph holding the
region is gone: a forward under ``no_grad``, a backward that never ran, a recomputation that stopped early).

``OutputKeeper(budget_bytes="auto")`` (CUDA): the first training step keeps nothing and samples the device's peak
as each region runs, forward and recomputation: what the process must hold (``cuda_memory_stats``: its tensors'
peak under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, else the allocator's peak reservation, since its
fragments cannot take a kept output) plus the memory held outside the allocator. From the next forward on,
the budget is ``(1 - headroom)`` of the device's memory minus that peak, minus what the memory allocated at the
start of a forward grew since the first (optimizer states appear after the first step), re-evaluated at the start
of every forward. When that is less than one call's pair, nothing is kept and the keeper warns once
(``ring_kernels.checkpointing`` logger), naming the numbers.

Counters (``OutputKeeper.stats()``): ``kept`` pairs, ``replayed`` (recomputations that skipped the ring),
``gaps`` (calls over budget), ``released_unused`` (kept pairs never taken), ``live_bytes``, ``peak_bytes``,
``budget_bytes``.
"""
from __future__ import annotations

import contextvars
import logging
import os
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from .errors import RingInputError
from .merge import fold_sink

__all__ = ["OutputKeeper", "keeping", "checkpoint", "current_region", "kept_forward", "KeptForward",
           "KeptOutputMismatch", "CompiledRegionError"]

logger = logging.getLogger(__name__)

Budget = Union[int, float, str, None]
_REGION: contextvars.ContextVar[Optional["_Region"]] = contextvars.ContextVar("ring_kernels_keep_region",
                                                                             default=None)


class KeptOutputMismatch(RingInputError):
    """A recomputation made ring calls that differ from its forward's (another shape, or more calls)."""


class CompiledRegionError(RingInputError):
    """A kept checkpoint function traced by torch.compile: its regions are Python state a graph cannot carry."""


def _pair_bytes(out: torch.Tensor, lse: torch.Tensor) -> int:
    return out.numel() * out.element_size() + lse.numel() * lse.element_size()


class OutputKeeper:
    """Decides which ring outputs are kept, and counts them.

    ``budget_bytes``: the most kept bytes alive at once over every region: an int (bytes), ``None`` (no limit),
    or ``"auto"`` (CUDA only: what fits, module docstring; ``headroom`` is the share of the device's memory it
    leaves free). ``memory_stats``: for ``"auto"``, a function returning
    ``(peak bytes held, allocated bytes, device bytes)`` (default: ``torch.cuda`` on ``device``, the current
    CUDA device when None).
    """

    def __init__(self, budget_bytes: Budget = None, *, headroom: float = 0.10, device=None,
                 memory_stats: Optional[Callable[[], Tuple[int, int, int]]] = None) -> None:
        if not 0.0 <= headroom < 1.0:
            raise RingInputError(f"OutputKeeper: headroom={headroom!r} must be in [0, 1): the share of the "
                                 "device's memory left free, e.g. 0.10")
        self.auto = budget_bytes == "auto"
        if self.auto:
            if memory_stats is None:
                if not torch.cuda.is_available():
                    raise RingInputError(
                        "OutputKeeper(budget_bytes='auto') measures CUDA memory, and no CUDA device is available; "
                        "pass a number of bytes, or None to keep every output")
                memory_stats = cuda_memory_stats(device)
            self.budget_bytes: Optional[int] = 0          # the calibration step keeps nothing
        elif budget_bytes is None:
            self.budget_bytes = None
        elif isinstance(budget_bytes, (int, float)) and not isinstance(budget_bytes, bool) and budget_bytes >= 0:
            self.budget_bytes = int(budget_bytes)
        else:
            raise RingInputError(f"OutputKeeper: budget_bytes={budget_bytes!r} must be a number of bytes >= 0, "
                                 "None (no limit) or 'auto' (what fits on the CUDA device)")
        self.headroom = headroom
        self._memory_stats = memory_stats
        self._calibrated = not self.auto
        self._measured_peak = 0         # "auto": the device's peak seen while nothing was kept
        self._first_base: Optional[int] = None   # "auto": bytes allocated when the first forward began
        self._backward_since_offer = False       # a recomputation ran since the last offer: the next one opens a forward
        self._warned = False
        self.counts: Dict[str, int] = dict(kept=0, replayed=0, gaps=0, released_unused=0)
        self.live_bytes = 0
        self.peak_bytes = 0

    # -------------------------------------------------------------------------------------------- budget
    def _sample_peak(self) -> None:
        """``"auto"`` before calibration: note the device's peak so far (a region ran, forward or recomputation)."""
        if self.auto and not self._calibrated:
            self._measured_peak = max(self._measured_peak, self._memory_stats()[0])

    def _forward_begins(self) -> None:
        """``"auto"``: the first offer of a forward. Calibrate after a measured step; re-evaluate the budget."""
        peak, allocated, total = self._memory_stats()
        allocated -= self.live_bytes     # kept pairs of a backward that has not run are not the model's growth
        if self._first_base is None:
            self._first_base = allocated
            return                       # the measured step: keeps nothing
        if not self._calibrated:
            self._measured_peak = max(self._measured_peak, peak)
            self._calibrated = True
        growth = max(0, allocated - self._first_base)
        budget = max(0, int((1.0 - self.headroom) * total) - self._measured_peak - growth)
        if budget != self.budget_bytes:
            logger.info("ring_kernels.checkpointing: budget %.2f GiB for kept ring outputs (peak %.2f GiB without "
                        "them, %.2f GiB allocated since, of %.2f GiB; %.0f%% left free)", budget / 2**30,
                        self._measured_peak / 2**30, growth / 2**30, total / 2**30, 100 * self.headroom)
        self.budget_bytes = budget

    def _admit(self, nbytes: int) -> bool:
        if self.auto and (self._first_base is None or self._backward_since_offer):
            self._forward_begins()
        self._backward_since_offer = False
        if self.budget_bytes is None or self.live_bytes + nbytes <= self.budget_bytes:
            return True
        if self._calibrated and self.budget_bytes < nbytes and not self._warned:
            self._warned = True
            logger.warning(
                "ring_kernels.checkpointing: nothing fits: one ring output takes %.3f GiB and the budget is %.3f GiB%s; "
                "every recomputation runs the ring forward again, as plain checkpointing does", nbytes / 2**30,
                self.budget_bytes / 2**30,
                " (the device's memory less its headroom, the peak measured without kept outputs and the growth "
                "since)" if self.auto else "")
            if self.auto and not expandable_segments():
                logger.warning("ring_kernels.checkpointing: the peak counts the caching allocator's whole reserve; "
                               "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it counts only live tensors, "
                               "and more outputs fit")
        return False

    def _take_bytes(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, nbytes: int, used: bool) -> None:
        self.live_bytes -= nbytes
        if not used:
            self.counts["released_unused"] += 1

    def stats(self) -> Dict[str, Any]:
        """The counters (module docstring), and the budget in force (None: no limit)."""
        return dict(self.counts, live_bytes=self.live_bytes, peak_bytes=self.peak_bytes,
                    budget_bytes=self.budget_bytes, calibrated=self._calibrated)

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / 2**30:.2f} GiB"
        return (f"<OutputKeeper budget {budget}{' (auto)' if self.auto else ''}, kept {self.counts['kept']}, "
                f"replayed {self.counts['replayed']}, gaps {self.counts['gaps']}>")


def expandable_segments() -> bool:
    """Whether CUDA's caching allocator grows its segments in place (``expandable_segments:True`` in
    ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``), so that freed memory stays usable by any size."""
    settings = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return any(item.replace(" ", "").lower() == "expandable_segments:true" for item in settings.split(","))


def cuda_memory_stats(device) -> Callable[[], Tuple[int, int, int]]:
    """The device's (peak, allocated, total) for ``"auto"``; the peak is what the process must hold.

    With expandable segments the allocator reuses freed memory for any size, so the peak is its tensors' peak
    (``max_memory_allocated``). Without them its reserve fragments: a large request can fail with gigabytes
    reserved but split (17.8 GiB at 128k tokens per GPU on the 8B), so the peak is the allocator's peak reservation
    (``max_memory_reserved``), which is conservative. Either way plus the memory outside the allocator (the CUDA
    context, communication buffers) at the time of asking."""
    expandable = expandable_segments()

    def stats() -> Tuple[int, int, int]:
        index = torch.cuda.current_device() if device is None else torch.device(device).index
        free, total = torch.cuda.mem_get_info(index)
        outside = max(0, total - free - torch.cuda.memory_reserved(index))
        peak = torch.cuda.max_memory_allocated(index) if expandable else torch.cuda.max_memory_reserved(index)
        return peak + outside, torch.cuda.memory_allocated(index), total
    return stats


class _Pairs:
    """A region's kept pairs, released through the keeper when taken or when the region is freed."""

    def __init__(self, keeper: OutputKeeper) -> None:
        self.keeper = keeper
        self.items: List[Optional[Tuple[torch.Tensor, torch.Tensor, int]]] = []

    def release_all(self) -> None:
        for i, item in enumerate(self.items):
            if item is not None:
                self.items[i] = None
                self.keeper._release(item[2], used=False)


class _Region:
    """One call of a kept checkpoint function: records in its first run, replays in the later ones."""

    def __init__(self, keeper: OutputKeeper) -> None:
        self.keeper = keeper
        self.pairs = _Pairs(keeper)
        self.runs = 0
        self.index = 0
        weakref.finalize(self, _Pairs.release_all, self.pairs)

    @property
    def replaying(self) -> bool:
        return self.runs > 1

    def run(self, function: Callable, *args, **kwargs):
        self.runs += 1
        self.index = 0
        token = _REGION.set(self)
        try:
            return function(*args, **kwargs)
        finally:
            _REGION.reset(token)
            if self.replaying:
                self.keeper._backward_since_offer = True
            self.keeper._sample_peak()

    def offer(self, out: torch.Tensor, lse: torch.Tensor) -> bool:
        """The forward's ring call computed ``out``/``lse``: keep them if the budget allows (first run only).
        True when kept: the recomputation will take them (and its ring call then saves stand-ins, see engine)."""
        if self.replaying:
            self.index += 1              # a gap being recomputed: nothing to record
            return False
        nbytes = _pair_bytes(out, lse)
        if not self.keeper._admit(nbytes):
            self.pairs.items.append(None)
            self.keeper.counts["gaps"] += 1
            return False
        self.pairs.items.append((out.detach(), lse.detach(), nbytes))
        self.keeper._take_bytes(nbytes)
        self.keeper.counts["kept"] += 1
        return True

    def take(self, q: torch.Tensor, fn: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """In a recomputation: this call's kept (out, lse), or None (a gap, or the first run: compute)."""
        if not self.replaying:
            return None
        items, i = self.pairs.items, self.index
        if i >= len(items):
            raise KeptOutputMismatch(
                f"{fn}: the recomputation of a checkpointed region made ring call #{i + 1}, but its forward made "
                f"{len(items)}; the region must make the same ring calls each time it runs (no data-dependent "
                "control flow around attention), or be checkpointed without keeping outputs")
        item = items[i]
        if item is None:
            return None                  # offer() moves the index on after the forward is recomputed
        out, lse, nbytes = item
        if out.shape[:-1] != q.shape[:-1] or out.device != q.device or out.dtype != q.dtype:
            raise KeptOutputMismatch(
                f"{fn}: the recomputation's ring call #{i + 1} has queries {tuple(q.shape)} {q.dtype} on {q.device}, "
                f"but the kept output of the forward's call #{i + 1} is {tuple(out.shape)} {out.dtype} on "
                f"{out.device}; the region must make the same ring calls each time it runs")
        items[i] = None
        self.index += 1
        self.keeper._release(nbytes, used=True)
        self.keeper.counts["replayed"] += 1
        return out, lse


def current_region() -> Optional[_Region]:
    """The innermost kept checkpoint region running on this thread, or None."""
    return _REGION.get()


class KeptForward(NamedTuple):
    """One attention forward as ``kept_forward`` ran it: ``out`` (q's shape and dtype) and ``lse`` (fp32), a sink
    folded in; ``extra``: what ``compute`` returned after them (empty on a replay); ``replayed``: the pair was the
    forward's, taken from the region (nothing computed); ``kept``: the region keeps this pair for the recomputation."""

    out: torch.Tensor
    lse: torch.Tensor
    extra: tuple
    replayed: bool
    kept: bool


def kept_forward(q: torch.Tensor, what: str, sink: Optional[torch.Tensor],
                 compute: Callable[[], tuple]) -> KeptForward:
    """The forward of one kernel call under the innermost kept region, the handshake every kernel makes.

    In a recomputation of a region that kept this call's pair: that pair, and ``compute`` is not called.
    Otherwise ``compute()`` -> (out, lse, *extra) runs the forward, ``sink`` (H,) is folded into the finished
    pair (``merge.fold_sink``) and the pair is offered to the region (kept if its budget allows). No region: the
    forward alone. ``what`` names the call in a ``KeptOutputMismatch``."""
    region = current_region()
    taken = region.take(q, what) if region is not None else None
    if taken is not None:
        return KeptForward(taken[0], taken[1], (), True, False)
    out, lse, *extra = compute()
    if sink is not None:
        lse = fold_sink(out, lse, sink)
    kept = region is not None and region.offer(out, lse)
    return KeptForward(out, lse, tuple(extra), False, kept)


@torch.compiler.disable
def _refuse_compiled_region() -> None:
    """Raise ``CompiledRegionError``. Called where Dynamo traces a kept checkpoint function, and hidden from Dynamo,
    so the error is raised when the compiled code runs, never while it is traced: how Dynamo treats an exception
    raised while tracing differs by torch release (propagated, an internal Dynamo error, or swallowed with an eager
    fallback that keeps outputs nobody asked to compile)."""
    raise CompiledRegionError(
        "ring_kernels.checkpointing.keeping: kept ring outputs do not apply under torch.compile (the region "
        "and its counters are Python state a compiled graph cannot carry). Fix: checkpoint with the plain "
        "checkpoint function when compiling")


def keeping(checkpoint_fn: Callable, keeper: OutputKeeper) -> Callable:
    """``checkpoint_fn`` with ring outputs kept by ``keeper`` (module docstring): same arguments, same result."""
    if not isinstance(keeper, OutputKeeper):
        raise TypeError(f"keeping: keeper must be an OutputKeeper, got {type(keeper).__name__}")

    def kept_checkpoint(function, *args, **kwargs):
        if torch.compiler.is_compiling():
            _refuse_compiled_region()
        region = _Region(keeper)
        return checkpoint_fn(lambda *a, **kw: region.run(function, *a, **kw), *args, **kwargs)

    kept_checkpoint.keeper = keeper
    kept_checkpoint.inner = checkpoint_fn
    return kept_checkpoint


def checkpoint(function, *args, keeper: OutputKeeper, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)`` with ring outputs kept by ``keeper``."""
    return keeping(torch.utils.checkpoint.checkpoint, keeper)(function, *args, **kwargs)
