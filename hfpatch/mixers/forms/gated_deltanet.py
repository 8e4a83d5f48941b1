"""CP forms of the Gated DeltaNet forwards that pick their kernels in ``__init__`` as instance attributes.

``Qwen3NextGatedDeltaNet`` of transformers 5.0 stores its kernels on the instance (``self.causal_conv1d_fn``:
causal-conv1d's function or None, then ``nn.Conv1d`` on the whole sequence; ``self.chunk_gated_delta_rule``:
flash-linear-attention's or HF's ``torch_chunk_gated_delta_rule``), so there is no module-level name for hfpatch
to rebind. ``qwen3_next_forward_instance_kernels`` is that forward without a cache, its two sequence parts
called through this module's ``causal_conv1d`` and ``chunk_gated_delta_rule`` (which the registry entry binds to
the ``causal_conv1d`` and ``chunk_gated_delta_rule`` kinds, ``hfpatch.mixers.kinds.conv`` and
``hfpatch.mixers.kinds.delta_rule``); each of them runs the instance's own kernel (its ``implementation``
argument), so the computation is the one the module would do on the whole sequence.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON
from hfpatch.mixers.kinds import conv

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "qwen3_next_forward_instance_kernels"]


def causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, implementation: Optional[Callable] = None) -> torch.Tensor:
    """Causal depthwise convolution: x (B, C, L), weight (C, K) -> (B, C, L). ``implementation`` (causal-conv1d's
    ``causal_conv1d_fn``) is called as HF 5.0 calls it (``x=``, ``seq_idx=None``); without one, ``F.conv1d`` with
    K-1 zeros of left padding, the first L outputs kept (``nn.Conv1d(padding=K-1)``), then ``activation``
    ("silu" or None)."""
    if implementation is not None:
        return implementation(x=hidden_states, weight=weight, bias=bias, activation=activation, seq_idx=None)
    return conv.causal_conv1d(hidden_states, weight, bias, activation)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, implementation: Callable, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False):
    """The chunked gated delta rule computed by ``implementation`` (HF's ``torch_chunk_gated_delta_rule`` or
    flash-linear-attention's ``chunk_gated_delta_rule``), called as HF 5.0 calls it: query, key (B, L, H, dk),
    value (B, L, H, dv), g, beta (B, L, H) -> (out (B, L, H, dv), final state (B, H, dk, dv) or None)."""
    return implementation(query, key, value, g=g, beta=beta, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def qwen3_next_forward_instance_kernels(module, hidden_states: torch.Tensor, cache_params=None, cache_position=None,
                                        attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Qwen3NextGatedDeltaNet.forward`` (transformers 5.0) without a cache: the same padding mask, projections,
    gates, head repetition, gated norm and output projection; the convolution and the delta rule through this
    module's ``causal_conv1d`` and ``chunk_gated_delta_rule`` with the instance's kernels. Returns (B, L, hidden)."""
    if cache_params is not None:
        raise UnsupportedArgument("cache_params", cache_params, CACHE_REASON, CACHE_FIX)
    modeling = sys.modules[type(module).__module__]
    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)

    projected_states_qkvz = module.in_proj_qkvz(hidden_states)
    projected_states_ba = module.in_proj_ba(hidden_states)
    query, key, value, z, b, a = module.fix_query_key_value_ordering(projected_states_qkvz, projected_states_ba)
    query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
    mixed_qkv = torch.cat((query, key, value), dim=-1).transpose(1, 2)

    # Read from this module's globals at call time: install_mixers rebinds the names to their CP wrappers.
    weight = module.conv1d.weight.squeeze(1)
    if module.causal_conv1d_fn is not None:
        mixed_qkv = causal_conv1d(mixed_qkv, weight, module.conv1d.bias, activation=module.activation,
                                  implementation=module.causal_conv1d_fn)
    else:  # HF applies silu after nn.Conv1d whatever the configured activation
        mixed_qkv = causal_conv1d(mixed_qkv, weight, module.conv1d.bias, activation="silu")

    mixed_qkv = mixed_qkv.transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(query.shape[0], query.shape[1], -1, module.head_k_dim)
    key = key.reshape(key.shape[0], key.shape[1], -1, module.head_k_dim)
    value = value.reshape(value.shape[0], value.shape[1], -1, module.head_v_dim)

    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    if module.num_v_heads // module.num_k_heads > 1:
        query = query.repeat_interleave(module.num_v_heads // module.num_k_heads, dim=2)
        key = key.repeat_interleave(module.num_v_heads // module.num_k_heads, dim=2)

    core_attn_out, _ = chunk_gated_delta_rule(query, key, value, g, beta, module.chunk_gated_delta_rule,
                                              initial_state=None, output_final_state=False,
                                              use_qk_l2norm_in_kernel=True)

    z_shape_og = z.shape
    core_attn_out = module.norm(core_attn_out.reshape(-1, core_attn_out.shape[-1]), z.reshape(-1, z.shape[-1]))
    core_attn_out = core_attn_out.reshape(z_shape_og)
    core_attn_out = core_attn_out.reshape(core_attn_out.shape[0], core_attn_out.shape[1], -1)
    return module.out_proj(core_attn_out)
