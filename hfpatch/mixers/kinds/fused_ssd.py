"""mamba-ssm's fused Mamba2 kernel (HF's ``mamba2_split_conv1d_scan_combined``: convolution, SSD scan, gated norm
and output projection in one call) under CP: declined.

HF's Mamba2 mixers try it first in training and fall back to their unfused path when it returns None (as it does
on the torch path). Under CP it returns None, so the mixer runs its convolution and its scan separately, the
``causal_conv1d`` and ``ssd_chunk_scan`` kinds, each through the implementation HF picked.
"""
from __future__ import annotations

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import CACHE_FIX, CACHE_REASON, KernelCall, SequenceKernel
from hfpatch.mixers.segments import SegmentPlan

__all__ = ["UnfusedMamba2"]


class UnfusedMamba2(SequenceKernel):
    """``mamba2_split_conv1d_scan_combined(zxbcdt (B, L, ...), ...)``: None under CP (and in switch mode
    "reference"), so that the mixer runs its unfused convolution and scan, which hfpatch runs under CP."""

    role = "mamba2_split_conv1d_scan"
    token_args = {"zxbcdt": 1}
    output_token_dim = 1

    def check(self, call: KernelCall) -> None:
        if call.arg("initial_states") is not None:
            raise UnsupportedArgument("initial_states", call.arg("initial_states"), CACHE_REASON, CACHE_FIX)

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> None:
        return None

    def reference(self, call: KernelCall, plan: SegmentPlan) -> None:
        return None
