"""Every sequence-kernel kind hfpatch runs under CP, by the role name the registry uses for it."""
from __future__ import annotations

from typing import Mapping

from hfpatch.mixers.cca import CcaProjection
from hfpatch.mixers.conv import CausalConv1d
from hfpatch.mixers.delta_rule import GatedDeltaRule
from hfpatch.mixers.kernel import SequenceKernel
from hfpatch.mixers.lightning import LightningAttention
from hfpatch.mixers.rglru import DiagonalRecurrence
from hfpatch.mixers.cached_step import CachedStep
from hfpatch.mixers.selective_scan import SelectiveScan
from hfpatch.mixers.ssd import SSDChunkScan, UnfusedMamba2

__all__ = ["KERNELS"]

KERNELS: Mapping[str, SequenceKernel] = {kernel.role: kernel for kernel in (CausalConv1d(), GatedDeltaRule())}

# Mamba2 (SSD) and Mamba (selective scan), with the fused Mamba2 kernel and the cached one-token steps.
KERNELS = {**KERNELS, **{kernel.role: kernel for kernel in (
    SSDChunkScan(), UnfusedMamba2(), SelectiveScan(),
    CachedStep("causal_conv1d_update", "conv_state"), CachedStep("mamba2_state_update", "state"),
    CachedStep("selective_state_update", "state"))}}

# Lightning attention (MiniMax), the RG-LRU's diagonal recurrence (RecurrentGemma), ZAYA's convolutional projection.
KERNELS = {**KERNELS, **{kernel.role: kernel for kernel in (
    LightningAttention(), DiagonalRecurrence(), CcaProjection())}}
