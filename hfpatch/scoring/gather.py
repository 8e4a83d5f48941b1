"""Per-token numbers of this rank's shard -> the whole sequence's, on every rank of the CP group.

One all-gather per quantity, of what each rank holds: one number per token (a log-prob, an entropy, a value),
never the logits. The result is in global token order (the inverse of the step's layout, ``ring_kernels.unshard``).

The gradient: every rank of an RL or preference step computes the same loss from the gathered tensor. The backward
averages the gathered tensor's gradient over the ranks and keeps this rank's tokens (a reduce-scatter, scaled by
1 / group size). When every rank's loss is the same, that is each rank's own gradient of it, so the parameter
gradients SUMMED over the CP group are the gradients of the non-CP loss, as everywhere in hfpatch
(``hfpatch.inputs.reduce_loss``). When the ranks' losses differ, the summed gradients are those of their mean.
"""
from __future__ import annotations

import torch

from hfpatch.attention.context import RingContext
from ring_kernels.layout import unshard

__all__ = ["gather_tokens"]


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x``, whose gradient is multiplied by ``factor`` in the backward (the value is unchanged)."""
    if factor == 1 or not x.requires_grad:
        return x
    return _ScaleGradient.apply(x, factor)


def gather_tokens(ctx: RingContext | None, local: torch.Tensor) -> torch.Tensor:
    """(B, S_local, ...) per-token numbers in the current step's layout -> (B, S, ...) in global token order, the
    same on every rank; the identity without CP (``ctx`` None). Collective: every rank of the group calls it with
    its shard of the same step. Differentiable (module docstring)."""
    if ctx is None:
        return local
    step = ctx.step
    if step is None or local.shape[1] != step.seq_len_local:
        what = "no step" if step is None else f"a step of {step.seq_len_local} local tokens per row"
        raise ValueError(f"gather_tokens: {tuple(local.shape)} per-token numbers, but the patch has {what}; gather "
                         "the outputs of the forward that ran on this step's inputs (patch.shard_inputs).")
    averaged = scale_gradient(local, 1.0 / ctx.world_size)
    return unshard(averaged, ctx.group, layout=step.layout, dim=1, cu_seqlens=step.cu_seqlens)
