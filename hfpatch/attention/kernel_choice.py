"""Which ring_kernels function computes a call: the one place the kernel is decided.

A step is split one way (``plan_step``: the token split of ``shard_inputs``, or the contiguous split of inputs the
user split) and each call runs one kernel on that split (``choose``):

- a pinned ring variant on its split; "auto" without a calibrated machine: ``plan_step``'s ring variant (zigzag for
  batch rows, llama3 for packed rows);
- "auto" on a calibrated machine (``RingContext.machine``): the kernel ring_kernels' cost model predicts fastest
  for the call's shape (``auto_kernel``), among those that compute on the step's split (``CANDIDATES``): on zigzag
  batch rows the zigzag ring, Ulysses or USP; on contiguous packed rows llama3, the contiguous ring, Ulysses or USP.
  It chooses once per step and call shape; non-causal or windowed calls, and splits the user made, keep
  ``plan_step``'s kernel (the model is calibrated on causal calls without a window). Every decision, with its
  predictions, is kept on the context (``auto_choices``, ``Patch.layout_choices``);
- full attention (non-causal, no window) does not depend on where the keys sit: the contiguous ring computes it on
  any split (the zigzag and stripe rings are causal-only), also as USP's ring;
- "ulysses" and "usp:UxR" split the query heads too, on the same splits; USP runs the ring variant of its split
  across its Ulysses groups (``USP_RING``).

``FUNCTIONS`` names the ring_kernels function of each (kernel, packed) pair; ``Kernel`` is the decision.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from hfpatch.attention.context import (AUTO, HEAD_KERNELS, HeadSplit, RingContext, StepState, usp_degrees,
                                       usp_grids)
from hfpatch.errors import UnsupportedArgument
from ring_kernels import layout_costs
from ring_kernels.layout_costs import ONE_SPLIT, CallShape, LayoutChoice

__all__ = ["plan_step", "Kernel", "choose", "FUNCTIONS", "USP_RING", "AutoChoice", "auto_kernel", "record",
           "CANDIDATES", "KERNEL_OF", "KEPT_DECISIONS"]

# (kernel, packed) -> the ring_kernels function that runs it. llama3 is varlen-only (a batch row runs the ring);
# stripe has no varlen form.
FUNCTIONS: Dict[Tuple[str, bool], str] = {
    ("zigzag", False): "zigzag_ring_attn_func", ("stripe", False): "stripe_attn_func",
    ("ring", False): "ring_attn_func", ("llama3", False): "ring_attn_func",
    ("zigzag", True): "zigzag_ring_attn_varlen_func", ("ring", True): "ring_attn_varlen_func",
    ("llama3", True): "llama3_attn_varlen_func",
    ("ulysses", False): "ulysses_attn_func", ("ulysses", True): "ulysses_attn_varlen_func",
    ("usp", False): "usp_attn_func", ("usp", True): "usp_attn_varlen_func",
}
# The ring variant USP runs across its Ulysses groups, by the step's (layout, packed): the choice of the ring
# variants themselves (zigzag on shard_inputs' zigzag batches, the contiguous ring on batches the user split,
# llama3 on packed rows; a pinned zigzag layout keeps the zigzag ring). A stripe over N is none over R.
USP_RING = {("zigzag", False): "zigzag", ("contiguous", False): "ring", ("contiguous", True): "llama3",
            ("zigzag", True): "zigzag"}
# Decisions kept per context (``record``): (kernel, shape) pairs, the least recently decided dropped beyond this.
KEPT_DECISIONS = 64
# the cost model's kernel -> the step kernel that runs it
KERNEL_OF = {"zigzag": "zigzag", "ulysses": "ulysses", "usp": "usp", "llama3": "llama3", "ring_varlen": "ring",
             "ulysses_varlen": "ulysses", "usp_varlen": "usp"}
# (the step's layout, packed) -> the cost model's kernels that compute on it: shard_inputs' splits (zigzag batch
# rows, contiguous packed rows), ``ring_kernels.layout_costs.ONE_SPLIT``.
CANDIDATES: Dict[Tuple[str, bool], Tuple[str, ...]] = {("zigzag", False): ONE_SPLIT[False],
                                                       ("contiguous", True): ONE_SPLIT[True]}


def plan_step(variant: str, *, packed: bool, source: str = "shard_inputs") -> Tuple[str, str]:
    """(kernel, layout) for a step. ``source`` != "shard_inputs" means the user split the inputs themselves:
    the only split we can assume is contiguous.

    batch:  auto/zigzag -> zigzag; stripe -> stripe; ring/llama3 -> ring (contiguous; llama3 is varlen-only).
    packed: zigzag (pinned) -> zigzag varlen; ring (pinned) -> ring varlen; auto/llama3/stripe -> llama3
            (stripe has no varlen form).
    head-parallel: "ulysses" -> ulysses, "usp:UxR" -> usp, on zigzag batches (the layout that balances the ring's
            causal work across USP's Ulysses groups), and contiguous packed rows (each document whole where it can
            be: no padding to 2N per document) or inputs the user split.
    """
    head = "usp" if usp_degrees(variant) is not None else "ulysses" if variant == "ulysses" else None
    if head is not None:
        return head, "zigzag" if source == "shard_inputs" and not packed else "contiguous"
    if source != "shard_inputs":
        if packed:
            return ("ring", "contiguous") if variant == "ring" else ("llama3", "contiguous")
        return "ring", "contiguous"
    if packed:
        if variant == "zigzag":
            return "zigzag", "zigzag"
        if variant == "ring":
            return "ring", "contiguous"
        return "llama3", "contiguous"
    if variant in (AUTO, "zigzag"):
        return "zigzag", "zigzag"
    if variant == "stripe":
        return "stripe", "stripe"
    return "ring", "contiguous"


@dataclass(frozen=True)
class Kernel:
    """The decision for one call: ``function``, the ring_kernels function that runs it (``FUNCTIONS``); ``step``,
    the step it runs on (auto's pick is a copy of the step with its kernel); ``heads``, the ``HeadSplit`` of a
    head-parallel kernel (None for a ring variant); ``ring_variant``, the ring USP runs across its Ulysses groups
    (None otherwise)."""

    function: str
    step: StepState
    heads: Optional[HeadSplit] = None
    ring_variant: Optional[str] = None


def choose(step: StepState, causal: bool, window: Tuple[int, int], nheads: int, kv_heads: int, head_dim: int,
           ctx: RingContext) -> Kernel:
    """The kernel of a call on ``step`` (module docstring): ``window`` is flash-attn's ``window_size`` of the call.
    ``UnsupportedArgument`` when the context's head-parallel kernel cannot compute it (query heads that do not
    divide by the Ulysses degree; a split USP's ring cannot run on)."""
    heads = ctx.heads
    if ctx.variant == AUTO:
        step, picked = auto_kernel(step, causal, window, nheads, kv_heads, head_dim, ctx)
        heads = picked or heads
    full = not causal and window == (-1, -1)
    if step.kernel in HEAD_KERNELS:
        return _head_kernel(step, causal, window, ctx, nheads, heads)
    kernel = "ring" if full and not step.packed else step.kernel
    return Kernel(FUNCTIONS[kernel, step.packed], step)


def _head_kernel(step: StepState, causal: bool, window: Tuple[int, int], ctx: RingContext, nheads: int,
                 heads: Optional[HeadSplit]) -> Kernel:
    """Ulysses on the step's layout, or USP with the ring variant of ``USP_RING`` across its Ulysses groups; every
    refusal by name first."""
    if heads is None:
        raise RuntimeError(f"this step runs the {step.kernel!r} kernel but the RingContext has no HeadSplit (variant "
                           f"{ctx.variant!r}); make the context with RingContext.for_group(group, kernel=...)")
    if nheads % heads.ulysses:
        _refuse_heads(nheads, ctx, heads.ulysses)
    function = FUNCTIONS[step.kernel, step.packed]
    if step.kernel == "ulysses":
        return Kernel(function, step, heads)
    ring_variant = USP_RING.get((step.layout, step.packed))
    if ring_variant is None:
        raise UnsupportedArgument(
            "layout", step.layout,
            f"kernel {ctx.variant!r} cannot run on this step's {step.layout!r} layout: USP gathers the pieces of "
            f"{heads.ulysses} consecutive ranks, and a stripe over the {ctx.world_size} ranks is no stripe over "
            f"the {heads.ring} ring ranks.",
            "let shard_inputs split the inputs (zigzag), split them contiguously, or use kernel='ulysses'.")
    if not step.packed and not causal and window == (-1, -1):
        ring_variant = "ring"
    if ring_variant == "zigzag" and not causal:
        raise UnsupportedArgument(
            "is_causal", False,
            f"kernel {ctx.variant!r} runs the zigzag ring across its Ulysses groups on this step's zigzag layout, "
            f"and the zigzag ring computes causal attention only; this call is non-causal with a sliding window "
            f"{window}.",
            "kernel='ulysses' (every mask on every layout), or split the inputs contiguously yourself (then the "
            "contiguous ring runs across the Ulysses groups).")
    return Kernel(function, step, heads, ring_variant)


def _refuse_heads(nheads: int, ctx: RingContext, degree: int) -> None:
    world = ctx.world_size
    usable = [g for g in usp_grids(world) if nheads % usp_degrees(g)[0] == 0]
    raise UnsupportedArgument(
        "query", f"{nheads} heads",
        f"{nheads} query heads do not divide by the Ulysses degree {degree}: kernel {ctx.variant!r} gives each of "
        f"the {degree} ranks of a Ulysses group {nheads} / {degree} of the heads.",
        (f"kernel={usable[0]!r} (Ulysses groups whose size divides {nheads}: {', '.join(usable)}), or " if usable
         else "") + "a ring variant (kernel='auto'), which splits only the sequence.")



# -------------------------------------------------------------------------------------------- auto


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


def _shape(step: Any, nheads: int, kv_heads: int, head_dim: int, world: int) -> CallShape:
    if step.packed:
        cu = step.cu_seqlens.tolist()
        return CallShape.documents(nheads, kv_heads, head_dim, [b - a for a, b in zip(cu, cu[1:])], world)
    return CallShape.batch(nheads, kv_heads, head_dim, step.batch_size, step.seq_len_global, world)


def _feasible(layout: str, nheads: int, ctx: Any) -> Optional[str]:
    """None when ``layout`` can compute a call of ``nheads`` query heads on ``ctx``, else why not."""
    kernel = KERNEL_OF[layout]
    if kernel not in HEAD_KERNELS:
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
