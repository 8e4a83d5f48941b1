"""Callables the harness times: a ring variant on this rank's shard, and the single-GPU baselines.

Every ``make_*`` returns ``step(mode)`` where mode is ``"fwd"`` (forward only, no autograd graph) or
``"fwd_bwd"`` (forward, then the gradients of q, k, v for a fixed ``dout`` through ``torch.autograd.grad``,
so nothing accumulates between iterations).

Shapes: batch q/dout (1, S, H, D), k/v (1, S, Hk, D); varlen q/dout (T, H, D), k/v (T, Hk, D).

``usp`` runs on the grid of process groups given once to ``set_usp_grid`` (every rank in one Ulysses group and
one ring group); its inputs are sharded over the whole group in its zigzag ring's layout.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from _cases import VARIANT_LAYOUT, AttnConfig

__all__ = ["Inputs", "make_inputs", "shard_inputs", "shard_tensors", "ring_function", "make_ring_step",
           "make_backend_step", "make_varlen_single_step", "cu_seqlens_of", "input_bytes", "ring_outputs_and_grads",
           "set_usp_grid"]

# ring_kernels public name of each variant; looked up at run time so a missing one is reported, not fatal.
_FUNCTIONS = {
    "ring": "ring_attn_func", "zigzag": "zigzag_ring_attn_func", "stripe": "stripe_attn_func",
    "ring_varlen": "ring_attn_varlen_func", "zigzag_varlen": "zigzag_ring_attn_varlen_func",
    "llama3": "llama3_attn_varlen_func", "ulysses": "ulysses_attn_func", "ulysses_varlen": "ulysses_attn_varlen_func",
    "usp": "usp_attn_func", "usp_varlen": "usp_attn_varlen_func",
}
# Where a name may live while ring_kernels/__init__.py does not export it yet.
_MODULES = ("ring_kernels", "ring_kernels.layout", "ring_kernels.ring", "ring_kernels.zigzag",
            "ring_kernels.stripe", "ring_kernels.varlen", "ring_kernels.llama3", "ring_kernels.ulysses",
            "ring_kernels.usp")
# The ring variant each USP variant runs across its Ulysses groups (batch: zigzag, causal work balanced over the
# ring; packed: llama3, as hfpatch's "usp:UxR" does on packed rows), and the grid (``set_usp_grid``).
USP_RING_VARIANTS = {"usp": "zigzag", "usp_varlen": "llama3"}
_USP_GRID: Dict[str, object] = {}


def _api(name: str) -> Callable:
    """The ring_kernels function ``name``; ``LookupError`` naming the modules searched when absent."""
    for module in _MODULES:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    raise LookupError(f"ring_kernels provides no {name!r} (searched {', '.join(_MODULES)})")


def ring_function(variant: str) -> Callable:
    return _api(_FUNCTIONS[variant])


def set_usp_grid(ulysses_group, ring_group) -> None:
    """The process groups every ``usp`` call and shard of this process uses."""
    _USP_GRID.update(ulysses_group=ulysses_group, ring_group=ring_group)


def _usp_grid(variant: str) -> Dict[str, object]:
    if not _USP_GRID:
        raise LookupError(f"variant {variant!r} needs a grid of process groups: call set_usp_grid first")
    return dict(_USP_GRID, ring_variant=USP_RING_VARIANTS[variant])


def _group_kwargs(variant: str, group) -> Dict[str, object]:
    """The keyword arguments that place ``variant`` on its ranks: ``group``, and a USP variant's grid of it."""
    return dict(_usp_grid(variant), group=group) if variant in USP_RING_VARIANTS else {"group": group}


@dataclass
class Inputs:
    """Global or local tensors of one case; ``doc_lengths`` is None for batch."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    doc_lengths: Optional[List[int]] = None

    @property
    def varlen(self) -> bool:
        return self.doc_lengths is not None


def cu_seqlens_of(doc_lengths: Sequence[int], device) -> torch.Tensor:
    """int32 (num_docs + 1,) cumulative lengths."""
    cu = torch.zeros(len(doc_lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(doc_lengths), dtype=torch.int64), 0).to(torch.int32)
    return cu.to(device)


def make_inputs(cfg: AttnConfig, tokens: int, *, dtype, device, seed: int,
                doc_lengths: Optional[List[int]] = None) -> Inputs:
    """Random inputs of ``tokens`` tokens, identical on every rank (seeded generator on ``device``)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    lead = () if doc_lengths is not None else (1,)

    def randn(heads):
        return torch.randn(*lead, tokens, heads, cfg.head_dim, generator=gen, device=device, dtype=dtype)

    return Inputs(randn(cfg.nheads), randn(cfg.nheads_k), randn(cfg.nheads_k), randn(cfg.nheads),
                  list(doc_lengths) if doc_lengths is not None else None)


def shard_tensors(tensors: Dict[str, torch.Tensor], variant: str, doc_lengths: Optional[Sequence[int]] = None,
                  group=None) -> Dict[str, torch.Tensor]:
    """This rank's part of each global tensor in ``variant``'s layout (contiguous copies).

    Batch tensors are (1, S, H*, D), sharded along dim 1; varlen (``doc_lengths`` given) (T, H*, D) along dim 0.
    """
    shard = _api("shard")
    layout = VARIANT_LAYOUT[variant]
    if doc_lengths is not None:
        kw = dict(layout=layout, dim=0, cu_seqlens=cu_seqlens_of(doc_lengths, "cpu"))
    else:
        kw = dict(layout=layout, dim=1)
    return {name: shard(t, group, **kw).contiguous() for name, t in tensors.items()}


def shard_inputs(inputs: Inputs, variant: str, group=None) -> Inputs:
    """This rank's part of global ``inputs`` in ``variant``'s layout (contiguous copies)."""
    parts = shard_tensors({"q": inputs.q, "k": inputs.k, "v": inputs.v, "dout": inputs.dout}, variant,
                          inputs.doc_lengths, group)
    return Inputs(**parts, doc_lengths=inputs.doc_lengths)


def input_bytes(inputs: Inputs) -> int:
    return sum(t.numel() * t.element_size() for t in (inputs.q, inputs.k, inputs.v, inputs.dout))


def _stepper(forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
             local: Inputs) -> Callable[[str], object]:
    q, k, v, dout = local.q, local.k, local.v, local.dout
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def step(mode: str):
        if mode == "fwd":
            with torch.no_grad():
                return forward(q, k, v)
        out = forward(qg, kg, vg)
        return torch.autograd.grad(out, (qg, kg, vg), dout)

    return step


def make_ring_step(variant: str, local: Inputs, *, causal: bool, backend: str, group=None,
                   global_doc_lengths: Optional[Sequence[int]] = None) -> Callable[[str], object]:
    """``step(mode)`` running ``variant`` on this rank's shard ``local`` over ``group``."""
    fn = ring_function(variant)
    kwargs = dict(_group_kwargs(variant, group), causal=causal, backend=backend)
    if local.varlen:
        cu = cu_seqlens_of(global_doc_lengths, local.q.device)
        return _stepper(lambda q, k, v: fn(q, k, v, cu, **kwargs), local)
    return _stepper(lambda q, k, v: fn(q, k, v, **kwargs), local)


def ring_outputs_and_grads(variant: str, local: Inputs, *, causal: bool, backend: str, group=None,
                           global_doc_lengths: Optional[Sequence[int]] = None) -> Dict[str, torch.Tensor]:
    """One forward+backward of ``variant``: this rank's ``out, dq, dk, dv`` (for the correctness gate)."""
    fn = ring_function(variant)
    q, k, v = (t.detach().requires_grad_() for t in (local.q, local.k, local.v))
    kwargs = dict(_group_kwargs(variant, group), causal=causal, backend=backend)
    if local.varlen:
        out = fn(q, k, v, cu_seqlens_of(global_doc_lengths, q.device), **kwargs)
    else:
        out = fn(q, k, v, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), local.dout)
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def make_backend_step(backend_name: str, local: Inputs, *, causal: bool) -> Callable[[str], object]:
    """Single-GPU baseline for batch: the block backend called directly on the local shard (one block).

    This is the kernel's own cost with nothing around it (no merge, no autograd wrapper): the strictest
    denominator for the ring's efficiency with the same backend.
    """
    from ring_kernels.backends import get_backend
    from ring_kernels.backends.base import CAUSAL, FULL, BlockMask

    q, k, v, dout = local.q, local.k, local.v, local.dout
    backend = get_backend(backend_name, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                          mask_kind=CAUSAL if causal else FULL, softcap=0.0)
    mask = BlockMask(causal=causal)
    scale = q.shape[-1] ** -0.5

    def step(mode: str):
        with torch.no_grad():
            out, lse = backend.forward(q, k, v, scale=scale, mask=mask)
            if mode == "fwd":
                return out
            return backend.backward(dout, q, k, v, out, lse, scale=scale, mask=mask)

    return step


def _flash_varlen_single_step(local: Inputs, *, causal: bool) -> Optional[Callable[[str], object]]:
    """torch's packed-document flash op called directly on the local documents (one call, no merge, no
    autograd wrapper), or None where it does not exist: the fastest honest single-GPU varlen attention with the
    kernel the ring's ``torch_flash`` varlen path uses."""
    from ring_kernels.backends.torch_cuda_varlen import segments_from_lengths, varlen_kernel_for

    q, k, v, dout = local.q, local.k, local.v, local.dout
    kernel = varlen_kernel_for("torch_flash", "torch_flash", device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                               softcap=0.0, document_lengths=[])
    if kernel is None:
        return None
    seg = segments_from_lengths(local.doc_lengths, local.doc_lengths, causal, q.device)
    scale = q.shape[-1] ** -0.5

    def step(mode: str):
        with torch.no_grad():
            out, lse = kernel.forward(q, k, v, seg, scale=scale)
            if mode == "fwd":
                return out
            return kernel.backward(dout, q, k, v, out, lse, seg, scale=scale)

    return step


def make_varlen_single_step(local: Inputs, *, causal: bool, backend: str, solo_group) -> Callable[[str], object]:
    """Single-GPU baseline for varlen: the library's varlen attention on a process group of one rank.

    ``local.doc_lengths`` is this GPU's own document mix (summing to its token count); a group of size one is
    plain attention (issue 2), so this is the same code path and backend with no communication. For
    ``torch_flash`` on CUDA it is torch's packed-document flash op called directly (the kernel the ring's
    varlen path uses for all documents of a step at once), the faster and stricter denominator.
    """
    if backend == "torch_flash":
        direct = _flash_varlen_single_step(local, causal=causal)
        if direct is not None:
            return direct
    fn = ring_function("ring_varlen")
    cu = cu_seqlens_of(local.doc_lengths, local.q.device)
    return _stepper(lambda q, k, v: fn(q, k, v, cu, group=solo_group, causal=causal, backend=backend), local)
