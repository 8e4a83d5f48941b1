"""kernel="auto": the kernel of each attention call, chosen by ring_kernels' cost model (``ring_kernels.layout_costs``).

The step's inputs are already split (``shard_inputs``: zigzag for batch rows, contiguous for packed rows); auto
chooses which exact kernel computes on that split:

- zigzag batch rows: the zigzag ring, Ulysses on the zigzag layout, or USP (the zigzag ring across Ulysses groups);
- contiguous packed rows: llama3, the contiguous ring, Ulysses, or USP (llama3 across Ulysses groups).

It chooses once per step and call shape (heads, K/V heads, head dim), and only where the context has a calibrated
machine (``RingContext.machine``, from the CUDA device at ``apply``). Everywhere else -- no calibration for the
device (a CPU group, an uncalibrated GPU), non-causal or windowed calls (the model is calibrated on causal calls
without a window), a layout the user split themselves -- auto runs the ring variant of ``plan_step`` (zigzag for
batch rows, llama3 for packed rows). A candidate that cannot run the call (query heads that do not divide by its
Ulysses degree, no USP grid) is left out with the reason. Every decision, with its predictions, is kept on the
context (``auto_choices``) and shown by ``Patch.layout_choices``.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ring_kernels import layout_costs
from ring_kernels.layout_costs import ONE_SPLIT, CallShape, LayoutChoice

__all__ = ["AutoChoice", "device_machine", "auto_kernel", "record", "CANDIDATES", "KERNEL_OF", "KEPT_DECISIONS"]

# Decisions kept per context (``record``): (kernel, shape) pairs, the least recently decided dropped beyond this.
KEPT_DECISIONS = 64

# cost-model layout -> the step kernel that runs it (hfpatch.attention.semantics' plans)
KERNEL_OF = {"zigzag": "zigzag", "ulysses": "ulysses", "usp": "usp", "llama3": "llama3", "ring_varlen": "ring",
             "ulysses_varlen": "ulysses", "usp_varlen": "usp"}
_HEAD_PARALLEL = ("ulysses", "usp")
# (the step's layout, packed) -> the cost-model layouts that compute on it: shard_inputs' splits (zigzag batch rows,
# contiguous packed rows), ``ring_kernels.layout_costs.ONE_SPLIT``.
CANDIDATES: Dict[Tuple[str, bool], Tuple[str, ...]] = {("zigzag", False): ONE_SPLIT[False],
                                                       ("contiguous", True): ONE_SPLIT[True]}


@dataclass(frozen=True)
class AutoChoice:
    """One decision of kernel="auto" (``Patch.layout_choices``).

    kernel:   the kernel that computed the calls ("zigzag", "llama3", "ring", "ulysses", "usp").
    reason:   why: the cost model's pick and margin, or why the cost model did not choose.
    shape:    the calls it covers (form, tokens per rank, heads).
    layout_choice: the cost model's ``LayoutChoice`` (every prediction and exclusion) of the latest of those
              decisions, or None when it did not run.
    steps:    how many (step, call shape) pairs made this decision (the same kernel for the same ``shape``).
    """

    kernel: str
    reason: str
    shape: str
    layout_choice: Optional[LayoutChoice] = None
    steps: int = 0


def device_machine(group) -> Optional[Tuple[str, str]]:
    """(calibrated machine, note) of this rank's CUDA device when ``group`` exchanges over NCCL; None otherwise
    (no process group, a CPU group, no calibration for the GPU)."""
    if not dist.is_initialized() or not torch.cuda.is_available():
        return None
    if "nccl" not in str(dist.get_backend(group)).lower():
        return None
    return layout_costs.machine_of(torch.cuda.get_device_name(torch.cuda.current_device()))


def _shape(step: Any, nheads: int, kv_heads: int, head_dim: int, world: int) -> CallShape:
    if step.packed:
        cu = step.cu_seqlens.tolist()
        return CallShape.documents(nheads, kv_heads, head_dim, [b - a for a, b in zip(cu, cu[1:])], world)
    return CallShape.batch(nheads, kv_heads, head_dim, step.batch_size, step.seq_len_global, world)


def _feasible(layout: str, nheads: int, ctx: Any) -> Optional[str]:
    """None when ``layout`` can compute a call of ``nheads`` query heads on ``ctx``, else why not."""
    kernel = KERNEL_OF[layout]
    if kernel not in _HEAD_PARALLEL:
        return None
    split = (ctx.auto_heads or {}).get(kernel)
    if split is None:
        return f"no {kernel} groups on this context ({ctx.world_size} ranks)"
    if nheads % split.ulysses:
        return f"{nheads} query heads do not divide by its Ulysses degree {split.ulysses}"
    return None


def _decide(step: Any, causal: bool, window: Tuple[int, int], nheads: int, kv_heads: int, head_dim: int,
            ctx: Any) -> Tuple[str, AutoChoice]:
    """(the step kernel to run, the decision that says why): the cost model's pick, or the step's own kernel."""
    candidates = CANDIDATES.get((step.layout, step.packed))
    shape_text = f"{'packed' if step.packed else 'batch'}, {step.seq_len_local} tokens per rank, H={nheads} " \
                 f"Hk={kv_heads} D={head_dim}"
    if ctx.machine is None:
        why = "no layout-cost calibration for this device (ring_kernels/layout_costs.json)"
    elif candidates is None:
        why = f"the step's {step.layout!r} layout (split by {step.source}) has no calibrated alternatives"
    elif not causal or window != (-1, -1):
        why = "the cost model is calibrated on causal calls without a window"
    else:
        shape = _shape(step, nheads, kv_heads, head_dim, ctx.world_size)
        costs = layout_costs.load(ctx.machine)
        choice = costs.choose(shape, {layout: _feasible(layout, nheads, ctx) for layout in candidates})
        if choice.layout is None:
            return step.kernel, AutoChoice(step.kernel, f"{step.kernel} (plan_step's ring variant): {choice.reason}",
                                           shape_text, choice)
        note = f" ({ctx.machine_note})" if ctx.machine_note else ""
        kernel = KERNEL_OF[choice.layout]
        return kernel, AutoChoice(kernel, choice.reason + note, shape_text, choice)
    return step.kernel, AutoChoice(step.kernel, f"{step.kernel} (plan_step's ring variant): {why}", shape_text)


def record(decisions: "OrderedDict[tuple, AutoChoice]", decision: AutoChoice) -> None:
    """Count ``decision`` in ``decisions`` ((kernel, shape) -> the latest ``AutoChoice`` with its ``steps``),
    keeping at most ``KEPT_DECISIONS`` entries (a run whose shapes keep changing must not grow it without bound)."""
    key = (decision.kernel, decision.shape)
    previous = decisions.pop(key, None)
    decisions[key] = dataclasses.replace(decision, steps=(previous.steps if previous else 0) + 1)
    while len(decisions) > KEPT_DECISIONS:
        decisions.popitem(last=False)


def auto_kernel(step: Any, causal: bool, window: Tuple[int, int], nheads: int, kv_heads: int,
                head_dim: int, ctx: Any) -> Tuple[Any, Optional[Any]]:
    """The step to plan (``step``, or a copy whose kernel is auto's pick: same layout, same per-step caches) and
    the ``HeadSplit`` of a head-parallel pick. Decided once per step and (causal, window, heads, K/V heads, head
    dim), kept on ``step.auto_kernels`` for the step's other layers; each decision is counted on
    ``ctx.auto_choices``."""
    key = (bool(causal), tuple(window), nheads, kv_heads, head_dim)
    found = step.auto_kernels.get(key)
    if found is None:
        kernel, decision = _decide(step, bool(causal), tuple(window), nheads, kv_heads, head_dim, ctx)
        record(ctx.auto_choices, decision)
        found = step.auto_kernels[key] = ((step, None) if kernel == step.kernel else
                                          (dataclasses.replace(step, kernel=kernel), (ctx.auto_heads or {}).get(kernel)))
    return found
