"""Where and with what a run was made: device, GPU count, library versions, date, git commit."""
from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import os
import platform
import subprocess
from typing import Optional

import torch

__all__ = ["stamp"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version(dist_name: str) -> Optional[str]:
    """Installed version from package metadata (no import: importing transformers takes seconds)."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _nccl_version() -> Optional[str]:
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


@functools.lru_cache(maxsize=None)
def _static(device_type: str, device_index: Optional[int]) -> dict:
    cuda = device_type == "cuda"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "device_type": device_type,
        "device_name": torch.cuda.get_device_name(device_index) if cuda else (platform.processor() or "cpu"),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": _nccl_version() if cuda else None,
        "triton": _version("triton"),
        "flash_attn": _version("flash-attn"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if dirty is None else bool(dirty),
        "hostname": platform.node(),
        # Settings that change communication speed (read by NCCL / ProcessGroupNCCL / ring_kernels at start-up).
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "TORCH_NCCL_", "RING_KERNELS_")) or k == "PYTORCH_CUDA_ALLOC_CONF"},
    }


def _ring_kernels_options() -> Optional[dict]:
    """The ring_kernels options in effect (``ring_kernels.options``: set in code or by RING_KERNELS_*)."""
    try:
        from ring_kernels import get_options
    except ImportError:
        return None
    return dataclasses.asdict(get_options())


def stamp(device: torch.device, world_size: int) -> dict:
    """The stamp of a run on ``device`` with ``world_size`` ranks (date in UTC, ISO 8601)."""
    return dict(_static(device.type, device.index), world_size=world_size,
                ring_kernels_options=_ring_kernels_options(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
