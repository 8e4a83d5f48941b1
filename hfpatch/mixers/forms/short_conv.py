"""LFM2's gated short convolution as releases 4.54 - 5.0 write it (``Lfm2ShortConv``), under CP.

Those releases convolve inline: ``forward`` picks ``cuda_kernels_forward`` (the causal-conv1d package, on CUDA) or
``slow_forward`` (``self.conv``, an ``nn.Conv1d`` with padding K-1, the outputs past L dropped), so there is no
kernel name to rebind. ``lfm2_short_conv_forward`` is ``slow_forward`` without a cache, its convolution computed
by ``causal_conv1d`` (``hfpatch.mixers.kinds.conv``: the same ``F.conv1d``) read from this module's globals, which
``install_mixers`` rebinds to the causal conv kind's CP wrapper: the window (B, C, K-1) travels per segment.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from hfpatch.mixers.kernel import refuse_cache
from hfpatch.mixers.kinds.conv import causal_conv1d

__all__ = ["causal_conv1d", "lfm2_short_conv_forward"]


def lfm2_short_conv_forward(module, hidden_states: torch.Tensor, past_key_value=None,
                            cache_position: Optional[torch.LongTensor] = None,
                            attention_mask: Optional[torch.Tensor] = None, past_key_values=None) -> torch.Tensor:
    """``Lfm2ShortConv.slow_forward`` (transformers 4.54 - 5.0; the cache is ``past_key_value`` before 5.0,
    ``past_key_values`` from 5.0) without a cache: padding mask, in_proj split into gates B, C and input x,
    ``C * conv(B * x)``, out_proj. hidden (B, L, hidden) -> (B, L, hidden)."""
    refuse_cache("past_key_value", past_key_value)
    refuse_cache("past_key_values", past_key_values)
    modeling = sys.modules[type(module).__module__]
    x = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    BCx = module.in_proj(x).transpose(-1, -2)
    B, C, x = BCx.chunk(3, dim=-2)
    Bx = B * x
    # Read from this module's globals at call time: install_mixers rebinds the name to its CP wrapper.
    conv_out = causal_conv1d(Bx, module.conv.weight[:, 0, :], module.conv.bias)
    y = C * conv_out
    y = y.transpose(-1, -2).contiguous()
    return module.out_proj(y)
