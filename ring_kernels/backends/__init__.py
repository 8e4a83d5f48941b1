"""Block backends (see ``base``); ``get_backend(name, ...)`` resolves a name or ``"auto"``.

Every backend computes one (query block, key block) pair and returns ``(out, lse)``; ``backward`` takes the
merged output and LSE. Backends are created lazily: importing this package imports no optional dependency.

Order of ``"auto"`` (``auto_ranking``: the first that is present and supports the device, dtype, head dim,
mask kind and softcap wins):

- CPU: ``torch_cpu`` (aten's fused flash kernel for CPU, FULL/CAUSAL without a mask tensor, GENERAL with an
  additive mask), then ``reference`` (the only one that does softcap, and any dtype). ``triton`` exists on CPU
  only under ``TRITON_INTERPRET=1`` (for tests) and comes last.
- CUDA: ``torch_cudnn``, ``torch_flash`` (FlashAttention-2 built into torch), ``triton`` (our kernel, when
  triton is importable: the fast one that does softcap), ``torch_efficient`` (fp32 and arbitrary additive masks:
  windows, documents), ``reference`` (anything, slowly): fastest measured first
  (docs/performance.md#which-block-backend-ran-and-which-commit). In fp32, ``torch_efficient`` comes before
  ``triton``: Triton compiles and autotunes its fp32 tiles per shape class before the first call of each, and
  fp32 is the dtype of exactness checks, where that wait is all cost. ``triton`` stays the fp32 choice where
  ``torch_efficient`` cannot (softcap).

Chosen by name only: ``flash_attn`` (the flash-attn package; its adapter is checked against flash-attn 2.6's and
2.7's signatures and the real 2.8.3). It has not been timed against torch's ops, so ``"auto"`` does not rank it;
``backend="flash_attn"`` picks it, and ``available_backends`` lists it after auto's ranking where it is
importable.

Every choice (``"auto"``'s with the reason the faster backends could not, a name's, the varlen kernel's, and a
backend's own fallback) is noted in ``choices`` (``choices()``, ``reset_choices()``, ``recording()``) and logged
once per shape class and reason on the ``ring_kernels.backends`` logger.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Dict, List, Optional

import torch

from .base import CAUSAL, EMPTY, FULL, GENERAL, BlockBackend, BlockMask
from .choices import BackendChoice, choices, note, recording, reset_choices, shape_class

__all__ = ["get_backend", "available_backends", "auto_ranking", "BlockBackend", "BlockMask", "UnknownBackendError",
           "UnsupportedBackendError", "FULL", "CAUSAL", "EMPTY", "GENERAL", "BackendChoice", "choices",
           "reset_choices", "recording"]


class UnknownBackendError(ValueError):
    """A backend name that is not registered."""


class UnsupportedBackendError(ValueError):
    """A backend (or every backend, for ``"auto"``) that cannot compute the requested blocks."""


# name -> (module, class name). Modules import their optional dependency lazily.
_REGISTRY: Dict[str, tuple] = {
    "reference": (".reference", "ReferenceBackend"),
    "torch_cpu": (".torch_cpu", "TorchCpuBackend"),
    "torch_flash": (".torch_cuda", "TorchFlashBackend"),
    "torch_cudnn": (".torch_cuda", "TorchCudnnBackend"),
    "torch_efficient": (".torch_cuda", "TorchEfficientBackend"),
    "flash_attn": (".flash_attn", "FlashAttnBackend"),
    "triton": (".triton_attn", "TritonBackend"),
}

_AUTO_ORDER = {
    # triton on CPU only under its interpreter (tests); after reference, so "auto" never picks it there.
    "cpu": ["torch_cpu", "reference", "triton"],
    "cuda": ["torch_cudnn", "torch_flash", "triton", "torch_efficient", "reference"],
}
# Present where their dependency is, chosen only by name: not timed against the ranked ones (module docstring).
_BY_NAME_ONLY = {"cuda": ["flash_attn"]}

INSTANCES: Dict[str, BlockBackend] = {}
_MASK_KINDS = (FULL, CAUSAL, EMPTY, GENERAL)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _device_type(device) -> str:
    return torch.device(device).type


def is_present(name: str, device_type: str) -> bool:
    """Whether the backend can exist at all here (its module and optional dependency import)."""
    if name == "reference":
        return True
    if name == "torch_cpu":
        return device_type == "cpu"
    cuda = device_type == "cuda" and torch.cuda.is_available()
    if name in ("torch_flash", "torch_cudnn", "torch_efficient"):
        return cuda
    if name == "flash_attn":
        return cuda and _importable("flash_attn")
    if name == "triton":
        interpreted = device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        return (cuda or interpreted) and _importable("triton") and _importable(__name__ + ".triton_attn")
    return False


def _instance(name: str) -> BlockBackend:
    if name not in INSTANCES:
        module, cls = _REGISTRY[name]
        INSTANCES[name] = getattr(importlib.import_module(module, __name__), cls)()
    return INSTANCES[name]


def auto_ranking(device, dtype: Optional[torch.dtype] = None) -> List[str]:
    """The order in which ``"auto"`` tries backends on ``device`` (a device or its type) for blocks of ``dtype``
    (None: any dtype's general order), present or not. fp32 on CUDA puts ``torch_efficient`` before ``triton``
    (module docstring)."""
    order = list(_AUTO_ORDER.get(_device_type(device), ["reference"]))
    if dtype == torch.float32 and "torch_efficient" in order and "triton" in order:
        order.remove("triton")
        order.insert(order.index("torch_efficient") + 1, "triton")
    return order


def available_backends(device) -> List[str]:
    """Names of the backends usable on ``device`` (a device or its type): those of ``auto_ranking`` that are
    present, in that order, then the present ones that are chosen by name only (``flash_attn``)."""
    dt = _device_type(device)
    order = auto_ranking(dt) + _BY_NAME_ONLY.get(dt, [])
    return [n for n in order if is_present(n, dt)]


def get_backend(name_or_auto: str, *, device, dtype: torch.dtype, head_dim: int, mask_kind: str,
                softcap: float = 0.0) -> BlockBackend:
    """The backend called ``name_or_auto`` (or the fastest that can, for ``"auto"``) for these blocks.

    ``mask_kind`` is the most general ``BlockMask.kind`` the caller will pass (``"general"`` covers all).
    Raises ``UnknownBackendError`` for an unknown name and ``UnsupportedBackendError`` (both ``ValueError``)
    with the backend's reason when it cannot compute such blocks.
    """
    if mask_kind not in _MASK_KINDS:
        raise ValueError(f"get_backend: mask_kind={mask_kind!r} is not one of {_MASK_KINDS}")
    dt = _device_type(device)
    query = dict(device=torch.device(device), dtype=dtype, head_dim=head_dim, mask_kind=mask_kind, softcap=softcap)
    if name_or_auto == "auto":
        skipped = []
        for name in (n for n in auto_ranking(dt, dtype) if is_present(n, dt)):
            reason = _instance(name).unsupported_reason(**query)
            if reason is None:
                _note_auto(name, tuple(skipped), dt, dtype, head_dim, mask_kind, softcap)
                return _instance(name)
            skipped.append((name, reason))
        reasons = "; ".join(f"{n}: {r}" for n, r in skipped)
        raise UnsupportedBackendError(
            f"backend='auto': no backend on {dt} supports dtype={dtype}, head_dim={head_dim}, "
            f"mask={mask_kind}, softcap={softcap} ({reasons})")
    if name_or_auto not in _REGISTRY:
        raise UnknownBackendError(
            f"backend={name_or_auto!r} is not a known backend; choose 'auto' or one of {sorted(_REGISTRY)}")
    if not is_present(name_or_auto, dt):
        raise UnsupportedBackendError(
            f"backend={name_or_auto!r} is not available on device type {dt!r}; available here: "
            f"{available_backends(dt)} (or use backend='auto')")
    backend = _instance(name_or_auto)
    reason = backend.unsupported_reason(**query)
    if reason is not None:
        raise UnsupportedBackendError(
            f"backend={name_or_auto!r} cannot compute these blocks: {reason}; use backend='auto' or 'reference'")
    _note_named(name_or_auto, dt, dtype, head_dim, mask_kind, softcap)
    return backend


def _note_auto(name: str, skipped: tuple, dt: str, dtype, head_dim: int, mask_kind: str, softcap: float) -> None:
    """Note ``"auto"``'s choice of ``name``; ``skipped``: ((faster backend, why it cannot), ...)."""
    def describe():
        if skipped:
            reason = "auto: higher-ranked backends cannot: " + "; ".join(f"{n}: {r}" for n, r in skipped)
        else:
            reason = f"auto: the first present and capable backend of {dt}'s ranking {auto_ranking(dt, dtype)}"
        return name, "auto", reason, shape_class(dt, dtype, head_dim, mask_kind, softcap > 0.0)

    note(("auto", name, tuple(n for n, _ in skipped), dt, dtype, head_dim, mask_kind, softcap > 0.0), describe)


def _note_named(name: str, dt: str, dtype, head_dim: int, mask_kind: str, softcap: float) -> None:
    note(("named", name, dt, dtype, head_dim, mask_kind, softcap > 0.0),
         lambda: (name, name, f"requested by name (backend={name!r})",
                  shape_class(dt, dtype, head_dim, mask_kind, softcap > 0.0)))
