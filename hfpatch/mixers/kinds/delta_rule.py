"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5 text and MoE; HF's ``chunk_gated_delta_rule``) under
CP.

Per value head the state S is (dk, dv) and each token updates it affinely:
``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, output ``o_t = S_t^T q_t`` (q scaled and, with
``use_qk_l2norm_in_kernel``, q and k normalised inside the kernel). Over a segment from an entering state S0:
``S_end = P S0 + F`` and ``o_t = o0_t + S0^T W_t`` with P (dk, dk), W_t = P_t^T q_t (dk,), F and o0 the zero-start
final state and outputs. Every column of S evolves on its own, so ONE call of the original kernel with the values
widened to [0 | v] (dk + dv) and the initial state [I | 0] returns [W | o0] as output and [P | F] as final state.

Per segment, (P, F) travels: (B, Hv, dk, dk + dv) in fp32. The composition in global order is
``S <- P S + F``; each segment's output is then corrected by ``S0^T W_t`` (an einsum, no second kernel call).
"""
from __future__ import annotations

from typing import Tuple

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON, KernelCall, SequenceKernel
from hfpatch.mixers.segments import SegmentPlan, map_segments

__all__ = ["GatedDeltaRule"]


class GatedDeltaRule(SequenceKernel):
    """``chunk_gated_delta_rule(query, key (B, L, Hk, dk), value (B, L, Hv, dv), g, beta (B, L, Hv), ...,
    initial_state, output_final_state, use_qk_l2norm_in_kernel, **kwargs) -> (out (B, L, Hv, dv), state)``."""

    role = "chunk_gated_delta_rule"
    token_args = {"query": 1, "key": 1, "value": 1, "g": 1, "beta": 1}
    output_token_dim = 1

    def check(self, call: KernelCall) -> None:
        if call.arg("initial_state") is not None:
            raise UnsupportedArgument("initial_state", call.arg("initial_state"), CACHE_REASON, CACHE_FIX)
        if call.arg("output_final_state"):
            raise UnsupportedArgument("output_final_state", True, CACHE_REASON, CACHE_FIX)
        if call.arg("cu_seqlens") is not None:
            raise UnsupportedArgument(
                "cu_seq_lens_q", call.arg("cu_seqlens"),
                "document boundaries passed to the gated delta rule (HF hands cu_seq_lens_q to the kernel, which "
                "resets the state at each document with flash-linear-attention and refuses without it): hfpatch's "
                "mixer exchange does not reset states at document starts yet.",
                "pass packed documents as position_ids only (shard_inputs), not cu_seq_lens_*.",
            )

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> Tuple[torch.Tensor, None]:
        names = ("query", "key", "value", "g", "beta")
        parts = list(zip(*[plan.split(call.arg(n), dim=1) for n in names]))
        value = call.arg("value")
        dk, dv = call.arg("key").shape[-1], value.shape[-1]

        def summarise(q, k, v, g, beta):
            batch, length, heads = v.shape[:3]
            widened = torch.cat([v.new_zeros(batch, length, heads, dk), v], dim=-1)
            identity = torch.eye(dk, dtype=torch.float32, device=v.device).expand(batch, heads, dk, dk)
            initial = torch.cat([identity, identity.new_zeros(batch, heads, dk, dv)], dim=-1)
            out, final = call.original_with(query=q, key=k, value=widened, g=g, beta=beta, initial_state=initial,
                                            output_final_state=True)
            return out[..., :dk], out[..., dk:], final[..., :dk].float(), final[..., dk:].float()

        summaries = map_segments(summarise, parts)

        def compose(state, summary, segment):
            transition, final = summary
            return transition @ state + final

        batch, heads = value.shape[0], value.shape[2]
        entering = plan.exchange([(s[2], s[3]) for s in summaries], compose,
                                 torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=value.device))
        outputs = [(out0.float() + torch.einsum("blhk,bhkv->blhv", reads.float(), state)).to(out0.dtype)
                   for (reads, out0, _, _), state in zip(summaries, entering)]
        return plan.join(outputs, dim=1), None
