"""The wall time and the tokens of every optimizer step of a transformers ``Trainer`` (or TRL ``SFTTrainer``), for
the examples' throughput line.

``StepClock.attach(trainer)`` after building the trainer, before ``train()``: it times every optimizer step
(``on_step_begin`` to ``on_step_end``, CUDA synchronized) and counts the tokens of every batch the trainer's data
collator builds (padding excluded where the batch has an attention mask), in the order it builds them; for TRL's
RL trainers, whose collator passes the prompts through and whose tokens are generated inside the step, the tokens
the trainer logs itself (``num_tokens``). The trainer
builds the batches in step order, so optimizer step s (1-based) used batches (s-1)G to sG-1, G being the gradient
accumulation steps. Every rank of a CP group builds the same batches; ``run`` reduces the counts to the global
batch's (a collective: call it on every rank). On CUDA it also resets the peak-memory counters when training begins
(after accelerate prepared the model) and reports each rank's peak allocated and reserved memory, the largest over
the ranks.
"""
from __future__ import annotations

import time
from typing import List, Sequence

import torch
from transformers import PrinterCallback, TrainerCallback

from _report import Run, timed_steps

__all__ = ["StepClock", "train_timed"]


class _CountingCollator:
    """``collator``, recording the tokens of every batch it builds."""

    def __init__(self, collator) -> None:
        self.collator = collator
        self.counts: List[int] = []

    def __call__(self, features):
        batch = self.collator(features)
        if isinstance(batch, list):   # TRL's RL trainers: the prompts; the tokens are generated in the step
            self.counts.append(None)
            return batch
        mask = batch.get("attention_mask")
        self.counts.append(int(mask.sum()) if mask is not None else batch["input_ids"].numel())
        return batch


class StepClock(TrainerCallback):
    """Per optimizer step: ``seconds`` (wall time) and, through the collator, the tokens of its batches."""

    def __init__(self, collator: _CountingCollator, accumulation: int) -> None:
        self.collator = collator
        self.accumulation = accumulation
        self.seconds: List[float] = []
        self._start = 0.0

    @classmethod
    def attach(cls, trainer) -> "StepClock":
        collator = _CountingCollator(trainer.data_collator)
        trainer.data_collator = collator
        clock = cls(collator, trainer.args.gradient_accumulation_steps)
        trainer.add_callback(clock)
        return clock

    def on_train_begin(self, args, state, control, **kwargs):
        if _on_cuda():
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, **kwargs):
        _synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _synchronize()
        self.seconds.append(time.perf_counter() - self._start)

    def run(self, trainer, label: str, losses: Sequence[float], cp_size: int) -> Run:
        """The run's ``Run`` for the report: tokens and time of the timed steps; tokens of the global batches (the
        sum over every rank's batches divided by ``cp_size``, whose ranks built the same ones)."""
        timed, name = timed_steps(len(self.seconds))
        counts = self.collator.counts[timed.start * self.accumulation:timed.stop * self.accumulation]
        device = trainer.accelerator.device
        logged = None in counts   # prompts only: the global tokens from the trainer's own cumulative num_tokens
        tokens = torch.tensor([_logged_tokens(trainer, timed) if logged else float(sum(counts))],
                              dtype=torch.float64, device=device)
        peaks = _peak_memory_gib(device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if not logged:
                torch.distributed.all_reduce(tokens)
            if peaks is not None:
                torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
        allocated, reserved = (None, None) if peaks is None else peaks.tolist()
        return Run(label=label, losses=tuple(losses), tokens=tokens.item() / (1 if logged else cp_size),
                   seconds=sum(self.seconds[timed]), timed=name, processes=trainer.accelerator.num_processes,
                   peak_allocated_gib=allocated, peak_reserved_gib=reserved)


def _logged_tokens(trainer, timed: slice) -> float:
    """The tokens of the optimizer steps ``timed`` (0-based), from the ``num_tokens`` the trainer logs per step
    (cumulative over the whole run, every process's)."""
    totals = [e["num_tokens"] for e in trainer.state.log_history if "loss" in e and "num_tokens" in e]
    return float(totals[timed.stop - 1] - (totals[timed.start - 1] if timed.start > 0 else 0))


def _on_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _synchronize() -> None:
    if _on_cuda():
        torch.cuda.synchronize()


def _peak_memory_gib(device: torch.device):
    """This rank's (max_memory_allocated, max_memory_reserved) in GiB as a float64 tensor on ``device``; None off
    CUDA."""
    if device.type != "cuda" or not _on_cuda():
        return None
    return torch.tensor([torch.cuda.max_memory_allocated(device) / 2 ** 30,
                         torch.cuda.max_memory_reserved(device) / 2 ** 30], dtype=torch.float64, device=device)


def train_timed(trainer, cp_handle, cp_size: int):
    """Train ``trainer`` (its per-step printer removed: the examples print their own lines), timed by a
    ``StepClock``, then remove ``cp_handle`` (None: nothing to remove) whatever happened; returns (the log entry of
    every optimizer step, the run's ``Run``)."""
    trainer.remove_callback(PrinterCallback)
    clock = StepClock.attach(trainer)
    try:
        trainer.train()
    finally:
        if cp_handle is not None:
            cp_handle.remove()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    run = clock.run(trainer, "no CP" if cp_size == 1 else f"cp={cp_size}", [e["loss"] for e in steps], cp_size)
    return steps, run
