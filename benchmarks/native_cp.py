"""PyTorch's own context parallelism as a peer: ``torch.distributed.tensor.experimental.context_parallel``.

It shards buffers in place along the sequence dimension and, while active, replaces
``F.scaled_dot_product_attention`` by a ring over the SDPA op that ``torch.nn.attention.sdpa_kernel`` pins
(flash, efficient or cuDNN; those are the only ops its dispatcher knows, so it needs CUDA). Knobs, read
from ``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` (torch 2.11 - 2.13):

- ``_cp_options.enable_load_balance``: causal needs it (head-tail reordering, like our zigzag); non-causal
  must have it off ("Load balancing requires is_causal=True"). ``context_parallel`` decides from it whether
  to build its default load balancer, and restores the previous value on exit.
- ``set_rotate_method("allgather" | "alltoall")``: how K/V shards travel (default all-gather).

Its layout is SDPA's ``(B, H, S, D)``; GQA is given K/V heads repeated to H, as HF's SDPA path does.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.nn.functional as F

from _cases import AttnConfig

__all__ = ["SDPA_BACKENDS", "native_cp_unavailable_reason", "native_cp_session", "make_sdpa_single_step"]

SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def native_cp_unavailable_reason(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return ("PyTorch's context_parallel dispatches only the CUDA SDPA ops "
                "(aten._scaled_dot_product_{flash,efficient,cudnn}_attention)")
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method  # noqa: F401
    except ImportError as exc:
        return f"this torch has no usable context_parallel ({exc})"
    return None


def _sdpa_layout(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(1, S, Hx, D) -> (1, H, S, D) contiguous, K/V heads repeated to ``heads`` (query head h uses h // g)."""
    x = x.transpose(1, 2)
    if x.shape[1] != heads:
        x = x.repeat_interleave(heads // x.shape[1], dim=1)
    return x.contiguous()


@contextlib.contextmanager
def _cp_settings(causal: bool, rotate: str) -> Iterator[None]:
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    saved = (_cp_options.enable_load_balance, _cp_options.rotate_method)
    _cp_options.enable_load_balance = causal
    set_rotate_method(rotate)
    try:
        yield
    finally:
        _cp_options.enable_load_balance, _cp_options.rotate_method = saved


@contextlib.contextmanager
def native_cp_session(cfg: AttnConfig, q, k, v, dout, *, causal: bool, sdpa_backend: str, rotate: str,
                      mesh) -> Iterator[Dict[str, Callable]]:
    """Shard the *global* batch inputs with ``context_parallel`` and yield ``{"step", "outputs_and_grads"}``.

    q, dout: (1, S, H, D); k, v: (1, S, Hk, D), identical on every rank. ``step(mode)`` runs the sharded
    SDPA; ``outputs_and_grads()`` returns the *unsharded* ``out, dq, dk, dv`` in our (1, S, H*, D) layout
    (dk/dv summed back over the repeated heads) for the correctness gate.
    """
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import sdpa_kernel

    h = cfg.nheads
    buffers = [_sdpa_layout(t, h) for t in (q, k, v, dout)]
    with _cp_settings(causal, rotate), sdpa_kernel([_sdpa_backend(sdpa_backend)]), context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(buffers)):
        ql, kl, vl, dl = buffers                          # now this rank's (1, H, S/N, D) shards
        qg, kg, vg = (t.detach().requires_grad_() for t in (ql, kl, vl))

        def step(mode: str):
            # Looked up at call time: context_parallel replaced the module attribute.
            if mode == "fwd":
                with torch.no_grad():
                    return F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            return torch.autograd.grad(out, (qg, kg, vg), dl)

        def outputs_and_grads() -> Dict[str, torch.Tensor]:
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dl)
            full = context_parallel_unshard(mesh, [out.detach(), dq, dk, dv], [2, 2, 2, 2])
            out, dq, dk, dv = (t.transpose(1, 2) for t in full)        # back to (1, S, H, D)
            g = h // cfg.nheads_k
            dk, dv = (t.unflatten(2, (cfg.nheads_k, g)).sum(3) for t in (dk, dv))
            return {"out": out, "dq": dq, "dk": dk, "dv": dv}

        local_bytes = sum(t.numel() * t.element_size() for t in buffers)
        yield {"step": step, "outputs_and_grads": outputs_and_grads, "local_bytes": local_bytes}


def make_sdpa_single_step(cfg: AttnConfig, q, k, v, dout, *, causal: bool, sdpa_backend: str) -> Callable[[str], object]:
    """Single-GPU SDPA on the local shard with the same backend and layout native CP uses (its denominator)."""
    from torch.nn.attention import sdpa_kernel

    h = cfg.nheads
    qs, ks, vs, ds = (_sdpa_layout(t, h) for t in (q, k, v, dout))
    qg, kg, vg = (t.detach().requires_grad_() for t in (qs, ks, vs))
    backend = [_sdpa_backend(sdpa_backend)]

    def step(mode: str):
        with sdpa_kernel(backend):
            if mode == "fwd":
                with torch.no_grad():
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            return torch.autograd.grad(out, (qg, kg, vg), ds)

    return step
