"""The one-token steps of a state-space mixer that continue from a cache (HF's ``causal_conv1d_update``,
``mamba2_selective_state_update``, ``mamba_selective_state_update``): refused under CP.

They run only during generation, when the mixer's convolution window and recurrent state come from a cache;
under CP every rank holds a slice of one sequence, so a rank's cached state is not the state before its token.
Wrapping them lets a recognised mixer refuse by name, whatever else the model's layers do with the cache.
"""
from __future__ import annotations

from typing import Any

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import KernelCall, SequenceKernel
from hfpatch.mixers.segments import SegmentPlan

__all__ = ["CachedStep"]

_REASON = ("a state-space mixer's step from its cached state (generation) cannot be used with context "
           "parallelism, where every rank holds a slice of one whole sequence.")
_FIX = "call the model with use_cache=False under CP, or generate after patch.remove() (the model as it was)."


class CachedStep(SequenceKernel):
    """A cached one-token step of role ``role`` whose state argument is ``state_arg``: refused in switch modes
    "ring" and "reference" (the original runs in "original" / "local")."""

    token_args = {"hidden_states": 1}

    def __init__(self, role: str, state_arg: str) -> None:
        self.role, self.state_arg = role, state_arg

    def check(self, call: KernelCall) -> None:
        raise UnsupportedArgument(self.state_arg, call.arg(self.state_arg), _REASON, _FIX)

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> Any:  # check always refuses first
        raise AssertionError("unreachable: CachedStep.check refuses every call")
