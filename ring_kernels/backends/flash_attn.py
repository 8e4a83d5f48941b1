"""Block backend on the flash-attn package (``pip install flash-attn``), when it is importable.

flash-attn uses our (B, S, H, D) layout directly, supports GQA and softcap natively, returns the LSE (B, H, Sq)
fp32, and its backward accepts an externally merged out/LSE. Its private ``_flash_attn_forward``/``_backward``
changed parameter names between 2.x releases (``window_size`` became ``window_size_left/right``, ``softcap``
and ``rng_state`` appeared), so they are called by keyword with only the names the installed release has.

Mask kinds: FULL and aligned CAUSAL (EMPTY skipped). Windowed or document blocks go to other backends.

The argument mapping covers flash-attn 2.6's and 2.7's parameter names and return tuples
(tests/ring_kernels/test_backends.py, against stand-in modules, on CPU) and the real flash-attn 2.8.3
(tests/gpu/test_backends_gpu.py: forward, backward, softcap and the ring's merged-block use against float64).
``backend="auto"`` does not rank it (not timed against torch's cuDNN and flash ops:
docs/performance.md#which-block-backend-ran-and-which-commit); only ``backend="flash_attn"`` picks it.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..merge import safe_lse
from .base import CAUSAL, EMPTY, FULL, BlockMask

__all__ = ["FlashAttnBackend"]

_HALF = (torch.float16, torch.bfloat16)


def _parameters(fn):
    """Named parameters of ``fn``; flash-attn >= 2.7 wraps these functions in torch custom ops (``_init_fn``)."""
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        raise RuntimeError(f"flash_attn backend: cannot read the parameters of flash-attn's {fn.__name__}")
    return params


def _call_by_name(fn, **kwargs):
    """Call ``fn`` with the keyword arguments its signature has; required ones missing here are an error."""
    params = _parameters(fn)
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise RuntimeError(f"flash_attn backend: installed flash-attn's {fn.__name__} needs {missing}; "
                           f"this release is not supported (use backend='torch_flash' or 'torch_cudnn')")
    return fn(**{n: v for n, v in kwargs.items() if n in params})


class FlashAttnBackend:
    """``flash_attn.flash_attn_interface._flash_attn_forward/_backward``: fp16/bf16, head_dim <= 256, softcap.

    Chosen by name only (``backend="flash_attn"``): not ranked by ``"auto"`` until timed (module docstring)."""

    name = "flash_attn"

    def __init__(self):
        from flash_attn import flash_attn_interface  # optional dependency, imported on first use only

        self._iface = flash_attn_interface
        self._rng_state = None

    def unsupported_reason(self, *, device, dtype, head_dim, mask_kind, softcap) -> Optional[str]:
        if torch.device(device).type != "cuda":
            return f"runs on CUDA only, not {device}"
        if dtype not in _HALF:
            return f"dtype {dtype} not supported (fp16/bf16 only)"
        if head_dim % 8 != 0 or head_dim > 256:
            return f"head_dim {head_dim} not supported (a multiple of 8, at most 256)"
        if mask_kind not in (FULL, CAUSAL, EMPTY):
            return f"mask kind {mask_kind!r} not supported (FULL/CAUSAL blocks only)"
        if softcap > 0.0 and "softcap" not in _parameters(self._iface._flash_attn_forward):
            return "the installed flash-attn has no softcap (needs flash-attn >= 2.6)"
        return None

    def _common(self, q, scale, kind, softcap):
        return dict(dropout_p=0.0, softmax_scale=scale, causal=kind == CAUSAL, window_size=(-1, -1),
                    window_size_left=-1, window_size_right=-1, softcap=softcap, alibi_slopes=None)

    def forward(self, q, k, v, *, scale: float, mask: BlockMask, softcap: float = 0.0):
        b, sq, h, _ = q.shape
        kind = mask.kind(sq, k.shape[1])
        if kind == EMPTY:
            return q.new_zeros(q.shape), torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
        result = _call_by_name(self._iface._flash_attn_forward, q=q, k=k, v=v, return_softmax=False,
                               **self._common(q, scale, kind, softcap))
        # 2.7+: (out, lse, S_dmask, rng_state); <= 2.6: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        out, lse = result[0], result[5] if len(result) == 8 else result[1]
        self._rng_state = result[-1]
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, softcap: float = 0.0):
        kind = mask.kind(q.shape[1], k.shape[1])
        if kind == EMPTY:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_by_name(self._iface._flash_attn_backward, dout=dout.contiguous(), q=q, k=k, v=v, out=out,
                      softmax_lse=safe_lse(lse).contiguous(), dq=dq, dk=dk, dv=dv, deterministic=False,
                      rng_state=self._rng_state, **self._common(q, scale, kind, softcap))
        return dq, dk, dv
