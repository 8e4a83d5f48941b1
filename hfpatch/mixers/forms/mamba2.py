"""The CP form of Bamba's Mamba2 mixer where transformers computes it inline (4.48 - 5.0): ``BambaMixer``'s
``forward`` dispatches to ``torch_forward`` (``nn.Conv1d`` over the whole sequence, the SSD scan's chunked "naive"
algorithm in its body) or, on CUDA with causal-conv1d and mamba-ssm installed, to ``cuda_kernels_forward`` (the
kernels the module imported).

``bamba_forward`` is that forward without a cache, its convolution computed by ``causal_conv1d``
(``hfpatch.mixers.kinds.conv``: the same ``F.conv1d`` as the module's ``nn.Conv1d``) and its scan by
``mamba2_chunk_scan`` below (``torch_forward``'s chunked algorithm); under CP ``install_mixers`` rebinds both names
in this module to the wrappers of the ``causal_conv1d`` and ``ssd_chunk_scan`` kinds. The CUDA path (its unfused
branch, the one HF's Mamba2 mixers take under CP from 5.x on, and its fused kernel alike) computes
``torch_forward``'s function, so under CP it runs through the same two kernels (torch, not the CUDA kernels).

Heads and groups: ``mamba2_chunk_scan`` (like mamba-ssm and the ``ssd_chunk_scan`` kind) gives head h the B, C of
group ``h // (heads / groups)``. 4.48's ``torch_forward`` tiles the groups instead (``B.repeat``: head h reads
group ``h % groups``); ``bamba_forward_tiled_groups`` expands B, C to one group per head that way before the
scan on that path, so that each path of each release keeps its own mapping.

The registry recognises the class by ``forward``'s fingerprint; the methods it dispatches to, which the CP forms
reproduce, are checked against the fingerprints they were read with (``family.require_methods_read``) at the first
call.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.family import require_methods_read
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON
from hfpatch.mixers.kinds.conv import causal_conv1d

__all__ = ["mamba2_chunk_scan", "causal_conv1d", "bamba_forward", "bamba_forward_tiled_groups", "BAMBA_METHODS_READ",
           "BAMBA_TILED_GROUPS_METHODS_READ"]


def _pad_tokens(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x (b, L, ...) with ``pad`` zero tokens appended along dim 1."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad), mode="constant", value=0)


def _chunks(x: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """x (b, L, ...) padded to whole chunks: (b, chunks, chunk_size, ...)."""
    x = _pad_tokens(x, pad)
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): entry [i, j] = x[j+1] + ... + x[i] for j <= i, -inf above the diagonal."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    x = x.masked_fill(~torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=0),
                         -torch.inf)


def mamba2_chunk_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, chunk_size: int, D: Optional[torch.Tensor] = None,
                      dt_bias: Optional[torch.Tensor] = None, initial_states: Optional[torch.Tensor] = None,
                      dt_softplus: bool = False, dt_limit: tuple = (0.0, float("inf")),
                      return_final_states: bool = False):
    """Mamba2's SSD scan in chunks of ``chunk_size`` tokens, as ``BambaMixer.torch_forward`` (4.48 - 5.0)
    computes it: x (b, L, H, P), dt (b, L, H), A (H,) fp32, B, C (b, L, G, N) -> y (b, L, H, P) in fp32, and with
    ``return_final_states`` the state after the last token (b, H, P, N). dt becomes
    ``clamp(softplus(dt + dt_bias), *dt_limit)`` (softplus when asked); head h reads group ``h // (H / G)``;
    ``initial_states`` (b, H, P, N) or None (zeros) enters before the first token."""
    batch, seq_len, heads, head_dim = hidden_states.shape
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, dt_limit[0], dt_limit[1])
    hidden_states = hidden_states.float()
    B = B.float().repeat_interleave(heads // B.shape[2], dim=2, output_size=heads)
    C = C.float().repeat_interleave(heads // C.shape[2], dim=2, output_size=heads)
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    D_residual = D[..., None] * _pad_tokens(hidden_states, pad) if D is not None else 0.0

    hidden_states = hidden_states * dt[..., None]
    A = A.to(hidden_states.dtype) * dt
    hidden_states, A, B, C = [_chunks(t, pad, chunk_size) for t in (hidden_states, A, B, C)]
    A = A.permute(0, 3, 1, 2)                                                   # (b, H, chunks, chunk_size)
    A_cumsum = torch.cumsum(A, dim=-1)

    # 1. the output of each chunk from its own tokens (diagonal blocks)
    L = torch.exp(_segment_sum(A))
    G = (C[:, :, :, None, :, :] * B[:, :, None, :, :, :]).sum(dim=-1)          # (b, c, l, s, H)
    M = (G[..., None] * L.permute(0, 2, 3, 4, 1)[..., None]).sum(dim=-1)
    Y_diag = (M[..., None] * hidden_states[:, :, None]).sum(dim=3)
    # 2. the state each chunk adds from a zero start
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = (B_decay[..., None, :] * hidden_states[..., None]).sum(dim=2)
    # 3. the state entering each chunk (and after the last)
    previous = (torch.zeros_like(states[:, :1]) if initial_states is None
                else initial_states[:, None].to(device=states.device, dtype=states.dtype))
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = (decay_chunk[..., None, None] * states[:, :, None, ...]).sum(dim=1)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    # 4. what the entering states add to each chunk's outputs
    Y_off = (C[..., None, :] * states[:, :, None, ...]).sum(-1) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]

    y = (Y_diag + Y_off).reshape(batch, -1, heads, head_dim)
    y = (y + D_residual)[:, :seq_len]
    return (y, final_state) if return_final_states else y


def _refuse_cache_and_packing(cache_params, seq_idx) -> None:
    if cache_params is not None:
        raise UnsupportedArgument("cache_params", cache_params, CACHE_REASON, CACHE_FIX)
    if seq_idx is not None:
        raise UnsupportedArgument(
            "seq_idx", seq_idx,
            "packing metadata passed to a Mamba2 mixer under CP: hfpatch's mixer exchange runs the documents of a "
            "packed row as one sequence, like HF's torch path, and does not reset the state at document starts.",
            "pass packed documents as position_ids only (shard_inputs), not seq_idx / cu_seq_lens_*.",
        )


def _bamba_forward(module, input_states: torch.Tensor, attention_mask, tile_groups: bool) -> torch.Tensor:
    """``torch_forward``'s computation without a cache; ``tile_groups``: head h reads group h % groups."""
    modeling = sys.modules[type(module).__module__]
    batch, seq_len, _ = input_states.shape
    dtype = input_states.dtype
    groups_state = module.n_groups * module.ssm_state_size
    input_states = modeling.apply_mask_to_padding_states(input_states, attention_mask)
    projected_states = module.in_proj(input_states)
    gate, hidden_states_B_C, dt = projected_states.split(
        [module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
    # Read from this module's globals at call time: install_mixers rebinds the names to their CP wrappers.
    hidden_states_B_C = module.act(causal_conv1d(hidden_states_B_C.transpose(1, 2), module.conv1d.weight[:, 0, :],
                                                 module.conv1d.bias).transpose(1, 2))
    hidden_states_B_C = modeling.apply_mask_to_padding_states(hidden_states_B_C, attention_mask)
    hidden_states, B, C = torch.split(hidden_states_B_C, [module.intermediate_size, groups_state, groups_state],
                                      dim=-1)
    A = -torch.exp(module.A_log.float())
    B = B.reshape(batch, seq_len, -1, module.ssm_state_size)
    C = C.reshape(batch, seq_len, -1, module.ssm_state_size)
    if tile_groups:
        B = B.repeat(1, 1, module.num_heads // module.n_groups, 1)
        C = C.repeat(1, 1, module.num_heads // module.n_groups, 1)
    y = mamba2_chunk_scan(hidden_states.reshape(batch, seq_len, -1, module.head_dim), dt, A, B, C,
                          module.chunk_size, D=module.D, dt_bias=module.dt_bias, dt_softplus=True,
                          dt_limit=module.time_step_limit)
    scan_output = module.norm(y.reshape(batch, seq_len, -1), gate)
    return module.out_proj(scan_output.to(dtype))


# The methods BambaMixer.forward dispatches to, as the CP forms below reproduce them: fingerprint -> releases.
BAMBA_TILED_GROUPS_METHODS_READ = {
    "torch_forward": {"7fe7cbb2fb3da2b0": "4.48.3"},
    "cuda_kernels_forward": {"b98e1a5689a90244": "4.48.3"},
}
BAMBA_METHODS_READ = {
    "torch_forward": {"161376a172802210": "4.53.3, 4.54.1", "2421fdf57105bd51": "5.0.0"},
    "cuda_kernels_forward": {"f30692e7ea1f4f6a": "4.53.3, 4.54.1", "9e5f3dfc4047e9c3": "5.0.0"},
}


def _bamba_dispatch(module, hidden_states, cache_params, attention_mask, seq_idx, tiled: bool) -> torch.Tensor:
    _refuse_cache_and_packing(cache_params, seq_idx)
    modeling = sys.modules[type(module).__module__]
    if getattr(modeling, "is_fast_path_available", False) and "cuda" in module.in_proj.weight.device.type:
        return _bamba_forward(module, hidden_states, attention_mask, tile_groups=False)
    # forward's own padding mask (the same as apply_mask_to_padding_states), then torch_forward's computation
    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    return _bamba_forward(module, hidden_states, attention_mask, tile_groups=tiled)


def bamba_forward(module, hidden_states: torch.Tensor, cache_params=None, cache_position=None,
                  attention_mask: Optional[torch.Tensor] = None, seq_idx=None, **kwargs) -> torch.Tensor:
    """``BambaMixer.forward`` (transformers 4.53 - 5.0: groups repeated per head on both paths) without a cache:
    input (b, L, hidden) -> (b, L, hidden). A cache and ``seq_idx`` are refused (``UnsupportedArgument``); a class
    whose dispatched methods are not the ones read (``BAMBA_METHODS_READ``) is refused (``UnsupportedModel``)."""
    require_methods_read(module, BAMBA_METHODS_READ)
    return _bamba_dispatch(module, hidden_states, cache_params, attention_mask, seq_idx, tiled=False)


def bamba_forward_tiled_groups(module, hidden_states: torch.Tensor, cache_params=None, cache_position=None,
                               attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``BambaMixer.forward`` (transformers 4.48: groups tiled over the heads on the torch path) without a cache;
    refusals as ``bamba_forward`` (``BAMBA_TILED_GROUPS_METHODS_READ``)."""
    require_methods_read(module, BAMBA_TILED_GROUPS_METHODS_READ)
    return _bamba_dispatch(module, hidden_states, cache_params, attention_mask, None, tiled=True)
