"""Mamba2's state-space duality scan (SSD: HF's ``mamba2_chunk_scan``, i.e. mamba-ssm's
``mamba_chunk_scan_combined`` or its torch fallback) under CP.

Per head the state h is (head_dim P, d_state N) and every token updates it with a SCALAR decay:
``h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t^T``, output ``y_t = h_t C_t + D x_t`` (dt after ``dt_bias``, softplus
and the ``dt_limit`` clamp; B and C shared by the heads of a group). Over a segment entered with state h0:
``h_end = exp(A S_L) h0 + F`` and ``y_t = y0_t + exp(A S_t) h0 C_t``, with ``S_t`` the cumulative dt from the
segment's start, F and y0 the zero-start final state and outputs. So each segment is run ONCE by the original
kernel from a zero state with ``return_final_states=True`` (giving y0 and F, with gradients, on either
implementation); the transition is the per-head scalar ``exp(A S_L)``; the composition in global order is
``h <- T h + F``; the correction ``exp(A S_t) (h0 C_t)`` is one einsum per segment (no second kernel call).

Travels per segment: T (B, H) and F (B, H, P, N), in fp32.

The fused kernel HF's Mamba2 mixers try first is declined under CP (``fused_ssd``): they then call this one.
"""
from __future__ import annotations

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import (CACHE_FIX, CACHE_REASON, KernelCall, SequenceKernel, discretised_dt,
                                   refuse_packing)
from hfpatch.mixers.segments import SegmentPlan, map_segments

__all__ = ["SSDChunkScan"]


class SSDChunkScan(SequenceKernel):
    """``mamba2_chunk_scan(hidden_states (B, L, H, P), dt (B, L, H), A (H,), B, C (B, L, G, N), chunk_size,
    D, dt_bias, initial_states, dt_softplus, dt_limit, return_final_states, **kwargs) -> (B, L, H, P)``."""

    role = "ssd_chunk_scan"
    token_args = {"hidden_states": 1, "dt": 1, "B": 1, "C": 1}
    output_token_dim = 1

    def check(self, call: KernelCall) -> None:
        if call.arg("initial_states") is not None:
            raise UnsupportedArgument("initial_states", call.arg("initial_states"), CACHE_REASON, CACHE_FIX)
        if call.arg("return_final_states"):
            raise UnsupportedArgument("return_final_states", True, CACHE_REASON, CACHE_FIX)
        if call.arg("z") is not None:
            raise UnsupportedArgument(
                "z", call.arg("z"),
                "a gate passed into the Mamba2 scan: mamba-ssm applies it inside the kernel, HF's torch path "
                "ignores it, so the model's result depends on the implementation; hfpatch's registry knows only "
                "mixers that gate outside the scan (z=None).",
                "gate outside the scan, or train this model without CP.",
            )
        refuse_packing(call, "mamba2_chunk_scan")

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> torch.Tensor:
        names = ("hidden_states", "dt", "B", "C")
        parts = list(zip(*[plan.split(call.arg(n), dim=1) for n in names]))
        x, A = call.arg("hidden_states"), call.arg("A").float()
        batch, _, heads, head_dim = x.shape
        state_size = call.arg("B").shape[-1]

        def zero_start(x, dt, B, C):
            out, final = call.original_with(hidden_states=x, dt=dt, B=B, C=C, return_final_states=True)
            return out, final.float()

        runs = map_segments(zero_start, parts)
        # log of the decay from each segment's start through token t: A * (cumulative dt), (B, L_seg, H)
        log_decay = [A * discretised_dt(dt, call.arg("dt_bias"), call.arg("dt_softplus"),
                                        call.arg("dt_limit")).cumsum(dim=1) for _, dt, _, _ in parts]
        summaries = [(decay[:, -1].exp(), final) for decay, (_, final) in zip(log_decay, runs)]

        def compose(state, summary, segment):
            transition, final = summary
            return transition[..., None, None] * state + final

        entering = plan.exchange(summaries, compose,
                                 torch.zeros(batch, heads, head_dim, state_size, dtype=torch.float32,
                                             device=x.device))
        outputs = []
        for (out0, _), decay, (_, _, _, C), state in zip(runs, log_decay, parts, entering):
            groups = C.shape[2]
            per_group = state.view(batch, groups, heads // groups, head_dim, state_size)
            read = torch.einsum("blgn,bgkpn->blgkp", C.float(), per_group).reshape(batch, -1, heads, head_dim)
            outputs.append((out0.float() + read * decay.exp()[..., None]).to(out0.dtype))
        return plan.join(outputs, dim=1)

