"""Correctness gate: every timed variant must first reproduce plain single-process attention.

The reference is ``softmax(Q K^T * scale + mask) V`` on the *unsharded* inputs in float64
(``ring_kernels.backends.reference.plain_attention``), with gradients from autograd. Tolerances are the
project's (issue 2): bf16/fp16 relative Frobenius error < 1e-2 for the output and < 5e-2 for gradients; fp32 max
abs error relative to the tensor's max abs value < 1e-5.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from ring_kernels.backends.reference import plain_attention

__all__ = ["reference_attention", "relative_errors", "passes", "max_over_ranks"]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool,
                        scale: float, doc_lengths: Optional[Sequence[int]] = None) -> Dict[str, torch.Tensor]:
    """Output and gradients of plain attention in float64.

    q, dout: (B, S, H, D); k, v: (B, S, Hk, D) with H % Hk == 0. ``doc_lengths`` (summing to S, B = 1)
    makes documents independent (varlen). Returns ``out, dq, dk, dv`` in float64, shaped like the inputs.
    """
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    cu_seqlens = None
    if doc_lengths is not None:
        cu_seqlens = torch.tensor([0, *doc_lengths], device=q.device).cumsum(0)
    out = plain_attention(q64, k64, v64, causal=causal, softmax_scale=scale, cu_seqlens=cu_seqlens)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def relative_errors(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, float]]:
    """Per tensor: ``fro`` = ||got - ref|| / ||ref||, ``max`` = max|got - ref| / max|ref|."""
    errors = {}
    for name, r in ref.items():
        g = got[name].double()
        diff = g - r
        errors[name] = {
            "fro": float(diff.norm() / r.norm().clamp_min(1e-300)),
            "max": float(diff.abs().max() / r.abs().max().clamp_min(1e-300)),
            "finite": bool(torch.isfinite(g).all()),
        }
    return errors


def passes(errors: Dict[str, Dict[str, float]], dtype: torch.dtype) -> bool:
    """Whether the errors are within the project's per-dtype tolerances (see the module docstring)."""
    for name, err in errors.items():
        if not err["finite"]:
            return False
        if dtype == torch.float32:
            if err["max"] >= 1e-5:
                return False
        elif err["fro"] >= (1e-2 if name == "out" else 5e-2):
            return False
    return True


def max_over_ranks(errors: Dict[str, Dict[str, float]], device: torch.device, group=None) -> Dict[str, Dict[str, float]]:
    """The worst error of each kind over all ranks (a non-finite value anywhere fails everywhere)."""
    if not (dist.is_available() and dist.is_initialized()):
        return errors
    names = sorted(errors)
    flat = []
    for n in names:
        flat += [errors[n]["fro"], errors[n]["max"], 0.0 if errors[n]["finite"] else 1.0]
    reduce_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(flat, dtype=torch.float64, device=reduce_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    vals = t.tolist()
    return {n: {"fro": vals[3 * i], "max": vals[3 * i + 1], "finite": vals[3 * i + 2] == 0.0}
            for i, n in enumerate(names)}
