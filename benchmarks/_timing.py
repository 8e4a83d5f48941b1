"""Timing and peak memory of one callable, the same way on every rank, reported as the slowest rank.

On CUDA each iteration is bracketed by CUDA events on the current stream (so the time is GPU time, not
Python launch time) and the device is synchronised before the events are read; on CPU ``perf_counter``.
All ranks start each measurement together (a barrier), and per iteration the slowest rank's time is the
step time (``all_reduce(MAX)`` of the per-iteration vector): a ring step is as fast as its slowest rank. Each
rank's own median is kept too (``rank_median_ms``), so that a rank slower than the others is seen, not averaged.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

__all__ = ["Timing", "time_callable", "peak_memory_bytes", "synchronize"]


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over ``iters`` timed calls (after ``warmup`` untimed ones), max over ranks."""

    median_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    iters: int
    warmup: int
    rank_median_ms: Optional[List[float]] = None   # each rank's own median (index = rank); None without a group

    def as_dict(self) -> dict:
        return asdict(self)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_over_ranks(value: float, device: torch.device, group) -> Optional[List[float]]:
    """``value`` of every rank of ``group`` (index = group rank); None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    gather_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([value], dtype=torch.float64, device=gather_device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [float(t.item()) for t in every]


def _max_over_ranks(values: List[float], device: torch.device, group) -> List[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    # NCCL reduces only CUDA tensors; gloo only CPU ones.
    reduce_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=reduce_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _probe_ms(fn: Callable[[], object], device: torch.device, group) -> float:
    """The wall time in ms of one more call of ``fn()``, kept out of the statistics: the slowest rank's, so the same
    on every rank."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return _max_over_ranks([(time.perf_counter() - t0) * 1e3], device, group)[0]


def time_callable(fn: Callable[[], object], *, device: torch.device, warmup: int, iters: int,
                  group=None, min_total_ms: float = 0.0, max_iters: int = 100) -> Timing:
    """Run ``fn()`` ``warmup`` times untimed, then ``iters`` times timed; return the slowest-rank statistics.

    ``min_total_ms`` > 0: ``iters`` is a minimum; one more untimed call measures ``fn`` and the timed calls are
    raised to cover ``min_total_ms`` (at most ``max_iters``), so that a short call is timed over many runs. Every
    rank takes the same count (the probe's slowest rank decides), as collectives inside ``fn`` require."""
    if iters < 1:
        raise ValueError(f"time_callable: iters={iters} must be >= 1")
    if max_iters < iters:
        raise ValueError(f"time_callable: max_iters={max_iters} must be >= iters={iters}")
    for _ in range(warmup):
        fn()
    if min_total_ms > 0:
        probe = _probe_ms(fn, device, group)
        iters = min(max(iters, math.ceil(min_total_ms / max(probe, 1e-3))), max_iters)
    synchronize(device)
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)
    per_iter: List[float] = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        per_iter = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            per_iter.append((time.perf_counter() - t0) * 1e3)
    rank_medians = _gather_over_ranks(statistics.median(per_iter), device, group)
    per_iter = _max_over_ranks(per_iter, device, group)
    return Timing(
        median_ms=statistics.median(per_iter), mean_ms=statistics.fmean(per_iter),
        min_ms=min(per_iter), max_ms=max(per_iter), iters=iters, warmup=warmup, rank_median_ms=rank_medians,
    )


def peak_memory_bytes(fn: Callable[[], object], *, device: torch.device, baseline_bytes: int,
                      group=None) -> Optional[int]:
    """Peak CUDA memory of one ``fn()`` call above ``baseline_bytes``, max over ranks; None off CUDA.

    ``baseline_bytes`` is ``torch.cuda.memory_allocated()`` taken before the case's inputs were created, so
    the number includes the inputs, the outputs, the gradients and every temporary of the call.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline_bytes
    return int(_max_over_ranks([float(peak)], device, group)[0])
