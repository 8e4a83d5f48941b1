"""The torch releases ring_kernels (and hfpatch on top of it) supports, and every torch boundary their code branches on.

The supported range is the tested range: CI runs the oldest release of it and the newest (docs/ci.md), and
pyproject's ``torch`` requirement states the same two bounds. ``import ring_kernels`` on a torch outside it raises
``UnsupportedTorch`` naming the installed release and the range; nothing computes.

Each bound below is a ``(major, minor)`` release series, measured by running the project's tests under that
release and the one before it.
"""
from __future__ import annotations

import re
from importlib import metadata
from typing import Optional, Tuple

import torch

__all__ = [
    "TORCH_OLDEST", "TORCH_NEWEST", "TRITON_OLDEST",
    "UnsupportedTorch", "installed_torch", "supported_range", "check_supported_torch",
    "triton_unsupported_reason",
]

Release = Tuple[int, int]

# The oldest series supported: 2.9, the oldest release where the whole tested stack is exact. Measured below it
# (the project's tests under 2.7.1 and 2.8.0): aten's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`)
# returns wrong numbers for GQA (errors of 1e28 to 1e34) and corrupts the heap; FSDP2 + CP with the documented
# gradient sum over CP (`FSDPModule.set_all_reduce_hook`, examples/train_cp.py) ends its first step with parameters
# 0.02 away from the single-process ones (bound 2e-6) on gloo; 2.7's gloo has no `reduce_scatter` (`unshard`'s
# backward) and its cuDNN attention op returns another output layout; 2.6 has no `set_all_reduce_hook`.
TORCH_OLDEST: Release = (2, 9)
# The newest series supported (tested: 2.15.0). A newer series is refused until its tests have run.
TORCH_NEWEST: Release = (2, 15)

# Triton (the `triton` backend and the fused merge; torch's wheels pin their own: torch 2.9 -> 3.5, 2.10 -> 3.6,
# 2.15 -> 3.9). 3.6 is the oldest the kernels are tested with (compiled on the GPU machine's 3.6; CI's
# interpreter runs 3.9). Below, both report triton as absent, naming the release; the torch backends serve.
TRITON_OLDEST: Release = (3, 6)


class UnsupportedTorch(ImportError):
    """The installed torch is outside the supported range; the message names both and how to get a supported one.
    An ``ImportError``: ``import ring_kernels`` raises it, and so does everything of hfpatch that computes."""

    def __init__(self, installed: str) -> None:
        super().__init__(
            f"torch {installed} is outside the torch releases ring_kernels and hfpatch support and test "
            f"({supported_range()}). Fix: pip install 'torch>={_text(TORCH_OLDEST)},<{_text(_next(TORCH_NEWEST))}'")
        self.installed = installed


def _text(release: Release) -> str:
    return f"{release[0]}.{release[1]}"


def _next(release: Release) -> Release:
    return release[0], release[1] + 1


def _series(version: str) -> Optional[Release]:
    """(major, minor) of a version string (local and pre-release parts ignored), or None if it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return None if found is None else (int(found.group(1)), int(found.group(2)))


def installed_torch() -> Release:
    """(major, minor) of the imported torch (``torch.__version__``)."""
    series = _series(str(torch.__version__))
    if series is None:
        raise UnsupportedTorch(str(torch.__version__))
    return series


def supported_range() -> str:
    """The supported series in words, e.g. ``'2.6 to 2.15'``."""
    return f"{_text(TORCH_OLDEST)} to {_text(TORCH_NEWEST)}"


def triton_unsupported_reason() -> Optional[str]:
    """Why the installed triton cannot serve ring_kernels' Triton kernels (older than ``TRITON_OLDEST``, or not
    installed), or None. Reads the distribution's version; triton is not imported."""
    try:
        text = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "triton is not installed (pip install 'hfpatch[triton]')"
    series = _series(text)
    if series is None or series < TRITON_OLDEST:
        return (f"triton {text} is older than {_text(TRITON_OLDEST)}, the oldest release ring_kernels' Triton kernels "
                f"are tested with (ring_kernels.torch_releases.TRITON_OLDEST). Fix: pip install 'triton>="
                f"{_text(TRITON_OLDEST)}' where your torch allows it, or use a torch backend")
    return None


def check_supported_torch() -> None:
    """Raise ``UnsupportedTorch`` unless the imported torch is within ``TORCH_OLDEST`` .. ``TORCH_NEWEST``."""
    if not TORCH_OLDEST <= installed_torch() <= TORCH_NEWEST:
        raise UnsupportedTorch(str(torch.__version__))
