"""Mamba's (v1) selective scan (HF's ``mamba_selective_scan``, i.e. mamba-ssm's ``selective_scan_fn`` or its torch
fallback: Jamba, Zamba) under CP.

Per channel d the state h is (d_state N,) and every token decays it ELEMENTWISE:
``h_t = exp(A dt_t) * h_{t-1} + dt_t x_t B_t``, output ``y_t = (h_t . C_t + D x_t) * silu(z_t)`` (dt after
``delta_bias`` and softplus; A (D, N); B, C (N,) per token, shared by the channels). Over a segment entered with
state h0: ``h_end = exp(A S_L) * h0 + F`` and ``y_t = (y0_t + (exp(A S_t) * h0) . C_t) * silu(z_t)``, with S_t the
cumulative dt from the segment's start, y0 the zero-start ungated output and F the zero-start final state.

y0 comes from the original kernel (``z=None``); F and the correction are computed here in fp32, in token chunks
under activation checkpointing (memory O(chunk), not O(L * D * N)): mamba-ssm's ``selective_scan_fn`` gives no
gradient through its returned last state. F uses the decay AFTER each token, an exclusive reverse cumulative sum,
so that long segments keep fp32 precision. The composition in global order is ``h <- exp(A S_L) * h + F``.

Travels per segment: S_L (B, D) and F (B, D, N), in fp32.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import (CACHE_FIX, CACHE_REASON, KernelCall, SequenceKernel, discretised_dt,
                                   refuse_packing)
from hfpatch.mixers.segments import SegmentPlan, map_segments

__all__ = ["SelectiveScan", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 1 << 24
"""Elements of the (B, D, chunk, N) decay tensor computed at once for F and the correction."""


def _final_piece(A, after, u, B):
    """sum over the chunk's tokens of exp(A * decay after t) * u_t * B_t: (B, D, N)."""
    return torch.einsum("bdqn,bdq,bnq->bdn", torch.exp(A[None, :, None, :] * after[..., None]), u, B)


def _read_piece(A, since, C, state):
    """(exp(A * decay since the segment's start) * state) . C_t for the chunk's tokens: (B, D, Q)."""
    return torch.einsum("bdqn,bnq,bdn->bdq", torch.exp(A[None, :, None, :] * since[..., None]), C, state)


def _chunked(piece: Callable, A: torch.Tensor, tokens: list, extra: tuple = (), *, reduce: bool) -> torch.Tensor:
    """``piece(A, *chunks of tokens, *extra)`` over token chunks of the (B, *, L) tensors ``tokens``: summed
    (``reduce``) or joined along L. Each chunk is checkpointed when gradients are on, so that only its inputs are
    kept for the backward."""
    batch, channels, length = tokens[0].shape
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * channels * A.shape[-1]))
    results = []
    for start in range(0, length, chunk):
        args = (A, *[t[..., start:start + chunk] for t in tokens], *extra)
        results.append(checkpoint(piece, *args, use_reentrant=False) if torch.is_grad_enabled() else piece(*args))
    if len(results) == 1:
        return results[0]
    return torch.stack(results).sum(dim=0) if reduce else torch.cat(results, dim=-1)


class SelectiveScan(SequenceKernel):
    """``mamba_selective_scan(hidden_states (B, D, L), dt (B, D, L), A (D, N), B, C (B, N, L), D, z (B, D, L),
    delta_bias (D,), delta_softplus, return_last_state, use_mambapy, use_associative_scan, **kwargs)
    -> (B, D, L)``."""

    role = "selective_scan"
    token_args = {"hidden_states": 2, "dt": 2, "B": 2, "C": 2, "z": 2}
    output_token_dim = 2

    def check(self, call: KernelCall) -> None:
        if call.arg("return_last_state"):
            raise UnsupportedArgument("return_last_state", True, CACHE_REASON, CACHE_FIX)
        for name in ("B", "C"):
            if call.arg(name).dim() != 3:
                raise UnsupportedArgument(
                    name, call.arg(name),
                    f"the selective scan's {name} of shape {tuple(call.arg(name).shape)}: hfpatch's CP form takes "
                    f"{name} shared by every channel, (batch, d_state, tokens), the shape HF's mixers pass.",
                    "train this model without CP.",
                )
        refuse_packing(call, "mamba_selective_scan")

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> torch.Tensor:
        names = ("hidden_states", "dt", "B", "C")
        parts = list(zip(*[plan.split(call.arg(n), dim=2) for n in names]))
        x, A, z = call.arg("hidden_states"), call.arg("A").float(), call.arg("z")
        bias = call.arg("delta_bias")
        bias = None if bias is None else bias[:, None]

        def zero_start(x, dt, B, C):
            return call.original_with(hidden_states=x, dt=dt, B=B, C=C, z=None, return_last_state=False)

        runs = map_segments(zero_start, parts)
        steps = [discretised_dt(dt, bias, call.arg("delta_softplus")) for _, dt, _, _ in parts]
        since = [step.cumsum(dim=-1) for step in steps]  # decay through token t, from the segment's start
        summaries = []
        for (xs, _, B, _), step, total in zip(parts, steps, since):
            after = step.flip(-1).cumsum(dim=-1).flip(-1) - step  # decay after token t, to the segment's end
            final = _chunked(_final_piece, A, [after, step * xs.float(), B.float()], reduce=True)
            summaries.append((total[..., -1], final))

        def compose(state, summary, segment):
            total, final = summary
            return torch.exp(A * total[..., None]) * state + final

        entering = plan.exchange(summaries, compose,
                                 torch.zeros(x.shape[0], x.shape[1], A.shape[-1], dtype=torch.float32,
                                             device=x.device))
        gates = plan.split(z, dim=2) if z is not None else [None] * len(parts)
        outputs = []
        for out0, (_, _, _, C), total, state, gate in zip(runs, parts, since, entering, gates):
            y = out0.float() + _chunked(_read_piece, A, [total, C.float()], (state,), reduce=False)
            if gate is not None:
                y = y * F.silu(gate.float())
            outputs.append(y.to(out0.dtype))
        return plan.join(outputs, dim=2)
