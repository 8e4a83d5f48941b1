"""Lightning attention (MiniMax's linear attention with a per-head scalar decay) under CP.

Per head the state S is (dk, dv); each token decays it by ``exp(-s)`` (``s``: the head's slope rate) and adds
``k_t v_t^T``; the output is ``o_t = q_t S_t``. From a state S0 entering a segment of n tokens:
``S_end = exp(-s n) S0 + F`` and ``o_t = o0_t + exp(-s (t + 1)) q_t S0`` (t = 0 .. n-1 inside the segment), with F
and o0 the zero-start final state and outputs. The transition is a scalar per head known from the segment's
length, so only F travels: (B, H, dk, dv) in fp32 per segment.

``lightning_attention`` is the block algorithm HF's ``MiniMaxLightningAttention.forward`` computes inline (blocks
of ``block_size`` tokens: the intra-block part with the decay mask, the inter-block part from the carried state),
with an initial state. The CP forms are that forward with the recurrence routed through it, one per way the
releases write it (``minimax_lightning_forward``: 5.19 - 5.23, the padding mask on the activated qkv, and
``minimax_lightning_forward_cache``: 5.24, the same with the cache argument named ``cache``;
``minimax_lightning_forward_value_mask``: 4.53 - 5.0, the padding mask on the values), so that under CP the
kernel's wrapper (``hfpatch.mixers.install``) runs ``LightningAttention.run_cp``.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import KernelCall, SequenceKernel
from hfpatch.mixers.segments import SegmentPlan, map_segments

__all__ = ["LightningAttention", "lightning_attention", "minimax_lightning_forward", "minimax_lightning_forward_cache",
           "minimax_lightning_forward_value_mask", "refuse_cache", "CACHE_REASON", "CACHE_FIX"]

CACHE_REASON = ("a recurrent state carried in from a cache (generation) cannot be used with context parallelism, "
                "where every rank holds a slice of one whole sequence.")
CACHE_FIX = "call the model with use_cache=False under CP, or generate without hfpatch (RING_ATTN_SWITCH=0)."


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


def refuse_cache(name: str, cache) -> None:
    """Raise ``UnsupportedArgument`` naming ``name`` when a cache was passed. The error carries the cache's class
    name, not the cache: some releases' cache classes cannot be printed (Lfm2HybridConvCache in 4.54)."""
    if cache is not None:
        raise UnsupportedArgument(name, f"a {type(cache).__name__}", CACHE_REASON, CACHE_FIX)


def _query_key_value(module, qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activated projection qkv (B, L, H * 3 * d) split into q, k, v (B, H, L, d), as HF splits it."""
    batch, length, _ = qkv.shape
    qkv = qkv.reshape(batch, length, module.num_attention_heads, 3 * module.head_dim)
    query, key, value = torch.split(qkv, module.head_dim, dim=3)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _gated_output(module, hidden_states: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """HF's output path: out (B, H, L, d) -> norm, sigmoid output gate, output projection -> (B, L, hidden)."""
    batch, length, _ = hidden_states.shape
    out = out.transpose(1, 2).reshape(batch, length, module.num_attention_heads * module.head_dim)
    out = module.norm(out)
    out = F.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out)


def minimax_lightning_forward(module, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                              past_key_values=None, **kwargs):
    """``MiniMaxLightningAttention.forward`` (transformers 5.19 - 5.23) without a cache, the recurrence computed by
    ``lightning_attention``: the same projections, padding mask (on the activated qkv, by
    ``apply_mask_to_padding_states``), norm, output gate and output projection. Returns (output (B, L, hidden),
    None)."""
    refuse_cache("past_key_values", past_key_values)
    modeling = sys.modules[type(module).__module__]
    qkv = module.act_fn(module.qkv_proj(hidden_states))
    qkv = modeling.apply_mask_to_padding_states(qkv, attention_mask)
    query, key, value = _query_key_value(module, qkv)
    # Read from this module's globals at call time: install_mixers rebinds the name to its CP wrapper.
    out, _ = lightning_attention(query, key, value, module.slope_rate, module.block_size)
    return _gated_output(module, hidden_states, out), None


def minimax_lightning_forward_cache(module, hidden_states: torch.Tensor, position_embeddings=None,
                                    attention_mask=None, cache=None, **kwargs):
    """``MiniMaxLightningAttention.forward`` as transformers 5.24 writes it (5.23's, the cache argument renamed
    ``cache``; ``past_key_values``, the name its decorator still maps to it, is refused too) without a cache:
    ``minimax_lightning_forward``. Returns (output (B, L, hidden), None)."""
    refuse_cache("cache", cache)
    return minimax_lightning_forward(module, hidden_states, position_embeddings, attention_mask, **kwargs)


def minimax_lightning_forward_value_mask(module, hidden_states: torch.Tensor, position_embeddings=None,
                                         attention_mask=None, past_key_value=None, past_key_values=None, **kwargs):
    """``MiniMaxLightningAttention.forward`` as transformers 4.53 - 5.0 write it, without a cache (named
    ``past_key_value`` before 5.0, ``past_key_values`` in 5.0), the recurrence computed by ``lightning_attention``: the
    same projections; the padding mask (the model's 2-D mask, B x L) zeroes the VALUES of masked tokens, as those
    releases do; the same norm, output gate and output projection. Returns (output (B, L, hidden), None)."""
    refuse_cache("past_key_value", past_key_value)
    refuse_cache("past_key_values", past_key_values)
    query, key, value = _query_key_value(module, module.act_fn(module.qkv_proj(hidden_states)))
    if attention_mask is not None:
        attention_mask = attention_mask.to(dtype=torch.bool)
        value = value.masked_fill(~attention_mask.unsqueeze(1).unsqueeze(-1), 0)
    # Read from this module's globals at call time: install_mixers rebinds the name to its CP wrapper.
    out, _ = lightning_attention(query, key, value, module.slope_rate, module.block_size)
    return _gated_output(module, hidden_states, out), None
