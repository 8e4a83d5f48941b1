"""The CP forms of RecurrentGemma's Griffin recurrent block and its RG-LRU, which HF computes inline.

Under CP the registry replaces, on the instance, ``RecurrentGemmaRecurrentBlock.forward`` (by
``griffin_block_forward``: the block's depthwise convolution ``conv_1d`` through ``causal_conv1d``, the
``causal_conv1d`` kind: its window (B, W, K-1) travels) and ``RecurrentGemmaRglru._rnn_scan`` (by ``rglru_scan``:
the scan through ``linear_recurrence``, the ``diagonal_recurrence`` kind); HF's ``RecurrentGemmaRglru.forward``
(its gates) runs as is. Both names are read from this module's globals, which ``install_mixers`` rebinds to the
kinds' CP wrappers.
"""
from __future__ import annotations

from typing import Optional

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON
from hfpatch.mixers.kinds.conv import causal_conv1d
from hfpatch.mixers.kinds.rglru import linear_recurrence

__all__ = ["causal_conv1d", "linear_recurrence", "griffin_block_forward", "rglru_scan"]


def rglru_scan(module, hidden_states: torch.Tensor, recurrent_gate: torch.Tensor, reset: torch.Tensor,
               recurrent_states: Optional[torch.Tensor], acc_dtype: torch.dtype = torch.float32):
    """``RecurrentGemmaRglru._rnn_scan`` (transformers 5.23) through ``linear_recurrence``: (outputs, state)."""
    # Read from this module's globals at call time: install_mixers rebinds the name to its CP wrapper.
    return linear_recurrence(hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)


def griffin_block_forward(module, input_states: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                          use_cache: bool = True, **kwargs):
    """``RecurrentGemmaRecurrentBlock.forward`` (transformers 5.23) without a cache, its convolution computed by
    ``causal_conv1d``: the same branches, gates and projections. Returns (output (B, L, hidden), None)."""
    if use_cache:
        raise UnsupportedArgument("use_cache", use_cache, CACHE_REASON, CACHE_FIX)
    y_branch = module.act_fn(module.linear_y(input_states))
    x_branch = module.linear_x(input_states).transpose(1, 2)
    module.conv1d_state = None
    module.rg_lru.recurrent_states = None
    x_branch = causal_conv1d(x_branch, module.conv_1d.weight[:, 0, :], module.conv_1d.bias)
    x_branch = module.rg_lru(x_branch.transpose(1, 2), position_ids)
    return module.linear_out(x_branch * y_branch), None
