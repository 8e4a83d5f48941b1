"""Every sequence-kernel kind hfpatch runs under CP, one ``SequenceKernel`` per module, and ``KERNELS``: each by
the role name the registry's entries bind kernel names to (``MixerFamily.bindings``)."""
from __future__ import annotations

from typing import Mapping

from hfpatch.mixers.kernel import SequenceKernel
from hfpatch.mixers.kinds.cached_step import CachedStep
from hfpatch.mixers.kinds.cca import CcaProjection
from hfpatch.mixers.kinds.conv import CausalConv1d
from hfpatch.mixers.kinds.delta_rule import GatedDeltaRule
from hfpatch.mixers.kinds.fused_ssd import UnfusedMamba2
from hfpatch.mixers.kinds.lightning import LightningAttention
from hfpatch.mixers.kinds.rglru import DiagonalRecurrence
from hfpatch.mixers.kinds.selective_scan import SelectiveScan
from hfpatch.mixers.kinds.ssd import SSDChunkScan

__all__ = ["KERNELS"]

KERNELS: Mapping[str, SequenceKernel] = {kernel.role: kernel for kernel in (
    CausalConv1d(),           # LFM2's short convolution, and the convolution of every hybrid below
    GatedDeltaRule(),         # Gated DeltaNet, Kimi delta attention
    SSDChunkScan(),           # Mamba2
    UnfusedMamba2(),          # Mamba2's fused kernel, declined: the mixer takes its unfused path
    SelectiveScan(),          # Mamba
    LightningAttention(),     # MiniMax
    DiagonalRecurrence(),     # RecurrentGemma's RG-LRU
    CcaProjection(),          # ZAYA's convolved q/k projection
    # the one-token steps from a cache (generation), refused by name
    CachedStep("causal_conv1d_update", "conv_state"),
    CachedStep("mamba2_state_update", "state"),
    CachedStep("selective_state_update", "state"),
)}
