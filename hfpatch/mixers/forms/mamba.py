"""The CP form of Jamba's Mamba mixer where transformers computes it inline (4.43 - 5.0): ``JambaMambaMixer``'s
``forward`` dispatches to ``slow_forward`` (``nn.Conv1d`` over the whole sequence, the selective scan as a Python
loop) or, with ``use_mamba_kernels``, to ``cuda_kernels_forward`` (the causal-conv1d / mamba-ssm kernels the
module imported).

``jamba_forward`` is that forward without a cache, its convolution computed by ``causal_conv1d``
(``hfpatch.mixers.kinds.conv``: the same ``F.conv1d`` as the module's ``nn.Conv1d``) and its scan by
``mamba_selective_scan`` below (``slow_forward``'s token loop); under CP ``install_mixers`` rebinds both names in
this module to the wrappers of the ``causal_conv1d`` and ``selective_scan`` kinds. The fused path computes
``slow_forward``'s function with mamba-ssm's silu gate (causal-conv1d accepts only a silu convolution), so under
CP it runs that computation through the same two kernels (torch, not the CUDA kernels).

The registry recognises the class by ``forward``'s fingerprint; the methods it dispatches to, which the CP form
reproduces, are checked against the fingerprints they were read with (``family.require_methods_read``) at the
first call.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.family import require_methods_read
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON
from hfpatch.mixers.kinds.conv import causal_conv1d

__all__ = ["mamba_selective_scan", "causal_conv1d", "jamba_forward", "JAMBA_METHODS_READ"]

def mamba_selective_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         C: torch.Tensor, D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                         delta_bias: Optional[torch.Tensor] = None, delta_softplus: bool = False,
                         return_last_state: bool = False):
    """Mamba's selective scan from a zero state, token by token as ``JambaMambaMixer.slow_forward`` (4.43 - 5.0)
    computes it: x, dt, z (b, D, L), A (D, N) fp32, B, C (b, N, L) -> y (b, D, L) in x's dtype, and with
    ``return_last_state`` the state after the last token (b, D, N) in fp32. ``dt`` is used as given, after
    ``delta_bias`` and softplus when asked; ``y_t = h_t . C_t (+ D x_t)``, times ``silu(z_t)`` when z is given."""
    batch, channels, length = hidden_states.shape
    dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)                                 # (b, L, N)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])            # (b, D, L, N)
    discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
    deltaB_u = discrete_B * hidden_states[:, :, :, None].float()
    state = torch.zeros(batch, channels, A.shape[-1], device=hidden_states.device, dtype=dtype)
    outputs = []
    for i in range(length):
        state = discrete_A[:, :, i, :] * state + deltaB_u[:, :, i, :]
        outputs.append(torch.matmul(state.to(dtype), C[:, i, :].unsqueeze(-1))[:, :, 0])
    out = torch.stack(outputs, dim=-1)
    if D is not None:
        out = out + hidden_states * D[None, :, None]
    if z is not None:
        out = out * F.silu(z)
    return (out, state) if return_last_state else out


def _jamba_forward(module, input_states: torch.Tensor, cache_params, attention_mask,
                   gate_activation: Callable) -> torch.Tensor:
    """``slow_forward``'s computation without a cache, the gate through ``gate_activation``."""
    if cache_params is not None:
        raise UnsupportedArgument("cache_params", cache_params, CACHE_REASON, CACHE_FIX)
    projected_states = module.in_proj(input_states).transpose(1, 2)           # (b, 2 * D, L)
    hidden_states, gate = projected_states.chunk(2, dim=1)
    if attention_mask is not None:
        hidden_states = hidden_states * attention_mask.unsqueeze(1)
    # Read from this module's globals at call time: install_mixers rebinds the names to their CP wrappers.
    hidden_states = module.act(causal_conv1d(hidden_states, module.conv1d.weight[:, 0, :], module.conv1d.bias))
    if attention_mask is not None:
        hidden_states = hidden_states * attention_mask.unsqueeze(1)
    ssm_parameters = module.x_proj(hidden_states.transpose(1, 2))
    time_step, B, C = torch.split(ssm_parameters, [module.time_step_rank, module.ssm_state_size,
                                                   module.ssm_state_size], dim=-1)
    time_step = module.dt_layernorm(time_step)
    B = module.b_layernorm(B)
    C = module.c_layernorm(C)
    discrete_time_step = F.softplus(module.dt_proj(time_step)).transpose(1, 2)  # (b, D, L)
    A = -torch.exp(module.A_log.float())
    scan_output = mamba_selective_scan(hidden_states, discrete_time_step, A, B.transpose(1, 2), C.transpose(1, 2))
    scan_output = scan_output + (hidden_states * module.D[None, :, None])
    scan_output = scan_output * gate_activation(gate)
    return module.out_proj(scan_output.transpose(1, 2))


# The release's forward raises ValueError in this case too.
_FAST_PATH_MISSING = ("use_mamba_kernels=True needs causal-conv1d and mamba-ssm installed and the Mamba mixer on a "
                      "CUDA device; set use_mamba_kernels=False in the model config to run the torch path")

# The methods JambaMambaMixer.forward dispatches to, as the CP form below reproduces them: fingerprint
# (family.forward_fingerprint) -> the releases they were read on.
JAMBA_METHODS_READ = {
    "slow_forward": {"78f1837c60c912cb": "4.43.4", "95ab7393d0efdb9f": "4.48.3, 4.53.3, 4.54.1",
                     "87873f8973997270": "5.0.0"},
    "cuda_kernels_forward": {"801fd878003f5b45": "4.43.4", "b34f3ac5ec53c11c": "4.48.3, 4.53.3, 4.54.1",
                             "e4b441117cd49524": "5.0.0"},
}


def jamba_forward(module, hidden_states: torch.Tensor, cache_params=None,
                  attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``JambaMambaMixer.forward`` (transformers 4.43 - 5.0) without a cache: ``cuda_kernels_forward``'s
    computation with ``use_mamba_kernels`` (the release's ValueError where its kernels cannot run), else
    ``slow_forward``'s. Input (b, L, hidden) -> (b, L, hidden). A cache (``cache_params``) is refused
    (``UnsupportedArgument``); a class whose dispatched methods are not the ones read (``JAMBA_METHODS_READ``)
    is refused (``UnsupportedModel``)."""
    require_methods_read(module, JAMBA_METHODS_READ)
    if module.use_fast_kernels:
        modeling = sys.modules[type(module).__module__]
        if not getattr(modeling, "is_fast_path_available", False) or "cuda" not in module.x_proj.weight.device.type:
            raise ValueError(_FAST_PATH_MISSING)
        # mamba-ssm gates with silu; causal-conv1d requires the convolution's activation (module.act) to be silu.
        return _jamba_forward(module, hidden_states, cache_params, attention_mask, F.silu)
    return _jamba_forward(module, hidden_states, cache_params, attention_mask, module.act)
