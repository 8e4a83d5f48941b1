"""The RG-LRU's scan (RecurrentGemma's real-gated linear recurrent unit) under CP.

The RG-LRU's scan is a diagonal linear recurrence over the width W: ``h_t = a_t * h_{t-1} + x_t``, with ``a_t``
zeroed where a document starts (``reset``: position id 0, so packed documents given by position_ids restart the
state, as in HF). From a state h0 entering a segment: ``h_t = h0_t + A_t * h0`` with ``A_t`` the running product
of the gates and h0_t the zero-start outputs; the segment's transition is the product over all its tokens. Per
segment (transition, zero-start final state) travels: 2 x (B, W) in fp32.

``linear_recurrence`` is that scan token by token, as HF's ``RecurrentGemmaRglru._rnn_scan`` computes it inline;
HF has no kernel name for it: the Griffin CP forms (``hfpatch.mixers.forms.griffin``) call it by name, so that
under CP the kernel's wrapper runs ``DiagonalRecurrence.run_cp``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON, KernelCall, SequenceKernel
from hfpatch.mixers.segments import SegmentPlan, map_segments

__all__ = ["DiagonalRecurrence", "linear_recurrence"]


def linear_recurrence(hidden_states: torch.Tensor, recurrent_gate: torch.Tensor, reset: torch.Tensor,
                      recurrent_states: Optional[torch.Tensor] = None,
                      acc_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """``h_t = (a_t * ~reset_t) * h_{t-1} + x_t``: x, a (B, L, W), reset (B, L, 1) bool, ``recurrent_states``
    (B, W) or None (zeros) -> (outputs (B, L, W) in x's dtype, final state (B, W) in ``acc_dtype``).
    Accumulates in ``acc_dtype`` token by token, as HF's ``RecurrentGemmaRglru._rnn_scan``."""
    gate = (recurrent_gate * ~reset).to(acc_dtype)
    state = (torch.zeros(hidden_states[:, 0].shape, dtype=acc_dtype, device=hidden_states.device)
             if recurrent_states is None else recurrent_states.to(acc_dtype))
    outputs = []
    for t in range(hidden_states.shape[1]):
        state = gate[:, t] * state + hidden_states[:, t].to(acc_dtype)
        outputs.append(state.to(hidden_states.dtype))
    return torch.stack(outputs, dim=1), state


class DiagonalRecurrence(SequenceKernel):
    """``linear_recurrence(hidden_states, recurrent_gate (B, L, W), reset (B, L, 1), recurrent_states,
    acc_dtype) -> (out (B, L, W), final state (B, W))``."""

    role = "diagonal_recurrence"
    token_args = {"hidden_states": 1, "recurrent_gate": 1, "reset": 1}
    output_token_dim = 1

    def check(self, call: KernelCall) -> None:
        if call.arg("recurrent_states") is not None:
            raise UnsupportedArgument("recurrent_states", call.arg("recurrent_states"), CACHE_REASON, CACHE_FIX)

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> Tuple[torch.Tensor, None]:
        names = ("hidden_states", "recurrent_gate", "reset")
        parts = list(zip(*[plan.split(call.arg(n), dim=1) for n in names]))
        acc = call.arg("acc_dtype")

        def summarise(x, a, reset):
            out0, final0 = call.original_with(hidden_states=x, recurrent_gate=a, reset=reset, recurrent_states=None)
            running = torch.cumprod((a * ~reset).to(acc), dim=1)                  # (B, n, W): A_t
            return out0, final0, running

        summaries = map_segments(summarise, parts)

        def compose(state, summary, segment):
            transition, final = summary
            return transition * state + final

        x = call.arg("hidden_states")
        initial = torch.zeros(x.shape[0], x.shape[2], dtype=acc, device=x.device)
        entering = plan.exchange([(running[:, -1], final0) for _, final0, running in summaries], compose, initial)
        outputs = [(out0.to(acc) + running * state[:, None]).to(out0.dtype)
                   for (out0, _, running), state in zip(summaries, entering)]
        return plan.join(outputs, dim=1), None

