"""Every sequence-kernel kind hfpatch runs under CP, by the role name the registry uses for it."""
from __future__ import annotations

from typing import Mapping

from hfpatch.mixers.conv import CausalConv1d
from hfpatch.mixers.delta_rule import GatedDeltaRule
from hfpatch.mixers.kernel import SequenceKernel

__all__ = ["KERNELS"]

KERNELS: Mapping[str, SequenceKernel] = {kernel.role: kernel for kernel in (CausalConv1d(), GatedDeltaRule())}
