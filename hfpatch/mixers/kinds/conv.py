"""Short causal depthwise convolution (HF's ``causal_conv1d_fn``: LFM2's ShortConv, and the convolution in front
of every Gated DeltaNet / Mamba mixer) under CP.

The convolution's state is its window: the last K-1 inputs before a token (zeros before the first token). Each
segment's summary is its own last K-1 inputs (zero-padded on the left when the segment is shorter); composing in
global order, the window entering a segment is the last K-1 entries of (window before, that segment's inputs).
Each segment is then convolved with its entering window prepended, and the first K-1 outputs dropped: exactly
what HF does when it continues from a cached window (``update_conv_state`` + ``causal_conv1d_fn`` + keep the
last ``seq_len`` outputs), so any implementation HF picked (causal-conv1d on CUDA, the torch fallback) computes it.

Shapes: ``hidden_states`` (B, C, L_local), ``weight`` (C, K). Travels per segment: (B, C, K-1) in the input dtype.

``causal_conv1d`` is the convolution in torch, for the CP forms of mixers whose release convolves inline with an
``nn.Conv1d`` (padding K-1, the outputs past L dropped): the same ``F.conv1d`` call, so the same numbers.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import PACKING_KWARGS, KernelCall, SequenceKernel
from hfpatch.mixers.segments import SegmentPlan, map_segments

__all__ = ["CausalConv1d", "causal_conv1d"]


def causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, **kwargs) -> torch.Tensor:
    """Causal depthwise convolution: x (B, C, L), weight (C, K), bias (C,) or None -> (B, C, L); output t reads
    inputs t-K+1 .. t, zeros before the first token (``nn.Conv1d(C, C, K, groups=C, padding=K-1)(x)[..., :L]``);
    ``activation``: None or "silu". ``kwargs`` (packing metadata) are refused by the kind under CP, not read here."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    length = hidden_states.shape[-1]
    out = F.conv1d(hidden_states, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=hidden_states.shape[1])[..., :length]
    return F.silu(out) if activation == "silu" else out


def _tail(x: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` tokens of x (B, C, L), zero-padded on the left when L < width: (B, C, width)."""
    if x.shape[-1] >= width:
        return x[..., x.shape[-1] - width:]
    return torch.cat([x.new_zeros(*x.shape[:-1], width - x.shape[-1]), x], dim=-1)


class CausalConv1d(SequenceKernel):
    """``causal_conv1d_fn(hidden_states (B, C, L), weight (C, K), bias, activation, **kwargs) -> (B, C, L)``."""

    role = "causal_conv1d"
    token_args = {"hidden_states": 2}
    output_token_dim = 2

    def check(self, call: KernelCall) -> None:
        for name in PACKING_KWARGS:
            if call.arg(name) is not None:
                raise UnsupportedArgument(
                    name, call.arg(name),
                    "packing metadata passed to a causal convolution under CP: hfpatch's mixer exchange runs the "
                    "documents of a packed row as one sequence, like HF's torch path.",
                    "pass packed documents as position_ids only (shard_inputs), not cu_seq_lens_* / seq_idx.",
                )

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> torch.Tensor:
        x, weight = call.arg("hidden_states"), call.arg("weight")
        width = weight.shape[-1] - 1
        if width == 0:  # a pointwise convolution carries nothing along the sequence
            return call.original_with()
        parts = plan.split(x, dim=2)
        tails = [_tail(p, width) for p in parts]

        def compose(window, summary, segment):
            keep = min(segment.length, width)
            return torch.cat([window, summary[0][..., width - keep:]], dim=-1)[..., -width:]

        entering = plan.exchange(tails, compose, x.new_zeros(x.shape[0], x.shape[1], width))

        def convolve(window, part):
            return call.original_with(hidden_states=torch.cat([window, part], dim=-1))[..., width:]

        return plan.join(map_segments(convolve, list(zip(entering, parts))), dim=2)
