"""Lightning attention (MiniMax's linear attention with a per-head scalar decay) under CP.

Per head the state S is (dk, dv); each token decays it by ``exp(-s)`` (``s``: the head's slope rate) and adds
``k_t v_t^T``; the output is ``o_t = q_t S_t``. From a state S0 entering a segment of n tokens:
``S_end = exp(-s n) S0 + F`` and ``o_t = o0_t + exp(-s (t + 1)) q_t S0`` (t = 0 .. n-1 inside the segment), with F
and o0 the zero-start final state and outputs. The transition is a scalar per head known from the segment's
length, so only F travels: (B, H, dk, dv) in fp32 per segment.

``lightning_attention`` is the block algorithm HF's ``MiniMaxLightningAttention.forward`` computes inline (blocks
of ``block_size`` tokens: the intra-block part with the decay mask, the inter-block part from the carried state),
with an initial state. HF has no kernel name for it: MiniMax's CP forms (``hfpatch.mixers.forms.lightning``) call
it by name, so that under CP the kernel's wrapper (``hfpatch.mixers.install``) runs ``LightningAttention.run_cp``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON, KernelCall, SequenceKernel
from hfpatch.mixers.segments import SegmentPlan, map_segments

__all__ = ["LightningAttention", "lightning_attention"]


def lightning_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slope_rate: torch.Tensor,
                        block_size: int, initial_state: Optional[torch.Tensor] = None,
                        output_final_state: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Decayed linear attention: q, k (B, H, L, dk), v (B, H, L, dv), ``slope_rate`` (H, 1, 1) -> output
    (B, H, L, dv) and, with ``output_final_state``, the state after the last token (B, H, dk, dv). Computed in the
    input dtype, in blocks of ``block_size`` tokens, from ``initial_state`` (zeros when None)."""
    batch, heads, length, _ = query.shape
    state = (torch.zeros(batch, heads, key.shape[-1], value.shape[-1], dtype=value.dtype, device=value.device)
             if initial_state is None else initial_state.to(value.dtype))
    # The decays in fp32, then in the input dtype (HF builds its decay buffers so).
    slope = slope_rate.float()
    steps = torch.arange(1, block_size + 1, device=query.device, dtype=torch.float32)
    outputs = []
    for start in range(0, length, block_size):
        n = min(block_size, length - start)
        q, k, v = (x[:, :, start:start + n] for x in (query, key, value))
        query_decay = torch.exp(-slope * steps[:n, None]).to(q.dtype)                 # (H, n, 1)
        key_decay = torch.exp(-slope * (n - steps[:n, None])).to(q.dtype)             # (H, n, 1)
        gap = (steps[:n, None] - steps[None, :n])[None, None] * slope                  # (1, H, n, n)
        diagonal_decay = torch.exp(torch.where(gap >= 0, -gap, float("-inf"))).to(q.dtype)
        intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * diagonal_decay, v)
        outputs.append(torch.matmul(q * query_decay, state) + intra)
        state = state * torch.exp(-slope_rate * n) + torch.matmul((k * key_decay).transpose(-1, -2), v)
    return torch.cat(outputs, dim=-2), (state if output_final_state else None)


class LightningAttention(SequenceKernel):
    """``lightning_attention(query, key, value (B, H, L, d), slope_rate (H, 1, 1), block_size, initial_state,
    output_final_state) -> (out (B, H, L, dv), state)``."""

    role = "lightning_attention"
    token_args = {"query": 2, "key": 2, "value": 2}
    output_token_dim = 2

    def check(self, call: KernelCall) -> None:
        if call.arg("initial_state") is not None:
            raise UnsupportedArgument("initial_state", call.arg("initial_state"), CACHE_REASON, CACHE_FIX)
        if call.arg("output_final_state"):
            raise UnsupportedArgument("output_final_state", True, CACHE_REASON, CACHE_FIX)

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> Tuple[torch.Tensor, None]:
        names = ("query", "key", "value")
        parts = list(zip(*[plan.split(call.arg(n), dim=2) for n in names]))
        value, slope = call.arg("value"), call.arg("slope_rate").float()
        dk, dv = call.arg("key").shape[-1], value.shape[-1]

        def summarise(q, k, v):
            return call.original_with(query=q, key=k, value=v, initial_state=None, output_final_state=True)

        summaries = map_segments(summarise, parts)

        def compose(state, summary, segment):
            return torch.exp(-slope * segment.length) * state + summary[0]

        initial = torch.zeros(value.shape[0], value.shape[1], dk, dv, dtype=torch.float32, device=value.device)
        entering = plan.exchange([final.float() for _, final in summaries], compose, initial)
        outputs = []
        for (out0, _), state, (q, _, _) in zip(summaries, entering, parts):
            steps = torch.arange(1, q.shape[2] + 1, device=q.device, dtype=torch.float32)
            reads = q.float() * torch.exp(-slope * steps[:, None])                    # (B, H, n, dk)
            outputs.append((out0.float() + torch.matmul(reads, state)).to(out0.dtype))
        return plan.join(outputs, dim=2), None

