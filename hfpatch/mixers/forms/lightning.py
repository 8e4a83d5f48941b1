"""The CP forms of MiniMax's lightning attention (``MiniMaxLightningAttention.forward``), one per way the releases
write it. Every release computes the recurrence inline, so the registry replaces ``forward`` by the form of its
release: the same projections, padding mask, norm, output gate and output projection, the recurrence computed by
``lightning_attention`` (``hfpatch.mixers.kinds.lightning``) read from this module's globals, which
``install_mixers`` rebinds to the lightning kind's CP wrapper.

- ``minimax_lightning_forward``: 5.19 - 5.23, the padding mask on the activated qkv;
- ``minimax_lightning_forward_cache``: 5.24, the same with the cache argument named ``cache``;
- ``minimax_lightning_forward_value_mask``: 4.53 - 5.0, the padding mask on the values.
"""
from __future__ import annotations

import sys
from typing import Tuple

import torch
import torch.nn.functional as F

from hfpatch.mixers.kernel import refuse_cache
from hfpatch.mixers.kinds.lightning import lightning_attention

__all__ = ["lightning_attention", "minimax_lightning_forward", "minimax_lightning_forward_cache",
           "minimax_lightning_forward_value_mask"]


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
