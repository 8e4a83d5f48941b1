"""A ring call's plan: the kernel ``kernel_choice`` decided and its keyword arguments, run on this rank's tensors.

``KERNELS`` maps every name of ``kernel_choice.FUNCTIONS`` to its ring_kernels function: the one table a plan looks
its kernel up in, per call (a test replaces an entry to stand in for a kernel: ``monkeypatch.setitem``). A kernel's
refusal reaches the caller as ``UnsupportedArgument`` naming the kernel's argument (a block backend's: ``kernel``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import torch

import ring_kernels
from hfpatch import version_gates
from hfpatch.attention.context import RingContext, StepState
from hfpatch.attention.kernel_choice import FUNCTIONS, choose
from hfpatch.errors import UnsupportedArgument
from ring_kernels import RingInputError
from ring_kernels.backends import UnknownBackendError, UnsupportedBackendError

__all__ = ["KERNELS", "RingPlan", "build_plan", "window_size_of", "window_is_inclusive"]

# name -> the ring_kernels function (every kernel ``kernel_choice`` can decide on)
KERNELS: Dict[str, Callable] = {name: getattr(ring_kernels, name) for name in sorted(set(FUNCTIONS.values()))}
# The kernels' once-per-step cross-rank check is scoped by ring_kernels' public context variable RANK_CHECKED, set
# and reset around each kernel call (``rank_check_scope`` does the same through a context-manager object).
_RANK_CHECKED = ring_kernels.RANK_CHECKED


def window_size_of(sliding_window: Optional[int], seq_len_global: int) -> Tuple[int, int]:
    """flash-attn ``window_size`` for HF's ``sliding_window``, converted as the installed release converts it."""
    # HF applies the window only when the keys outnumber it (the key length is the GLOBAL length here: that is
    # what the non-CP run sees); a window at least as long as the sequence excludes nothing anyway.
    if sliding_window is None or seq_len_global <= sliding_window:
        return (-1, -1)
    if window_is_inclusive():
        return (sliding_window - 1, sliding_window - 1)
    return (sliding_window, sliding_window)


@functools.lru_cache(maxsize=None)
def window_is_inclusive() -> bool:
    """True when the installed release gives flash-attn (w - 1, w - 1) for sliding_window w (read once: the
    metadata lookup is too slow for the per-layer hot path)."""
    version = version_gates.installed_transformers_version()
    return version is None or version >= version_gates.TRANSFORMERS_SLIDING_WINDOW_INCLUSIVE


class RingPlan:
    """What a ring call runs: the ring_kernels function (by name, looked up in ``KERNELS`` per call) and its
    keyword arguments, for one step and one configuration (causal, softmax_scale, sliding_window, softcap). Built
    by ``build_plan``; ``run`` is the only place hfpatch calls a ring kernel.

    step:        the StepState it was built for.
    kernel:      the ring_kernels function's name (``kernel_choice.FUNCTIONS``); ``kwargs``: its keyword arguments
                 (the kernel gets its own copy).
    packed:      the step is one packed row: the kernel also takes the step's GLOBAL int32 ``cu_seqlens``
                 (``StepState.cu_seqlens_on``: one copy per step and device).
    inputs:      what its caller built it for (``semantics.ring_plan(..., inputs=)``), compared with a later call's to reuse
                 it (``hfpatch.attention.dispatch``); None: not to be reused.
    """

    __slots__ = ("step", "kernel", "kwargs", "packed", "cu_by_device", "rank_checked", "inputs")

    def __init__(self, step: StepState, kernel: str, kwargs: dict, packed: bool, inputs: Optional[tuple] = None
                 ) -> None:
        self.step = step
        self.kernel = kernel
        self.kwargs = kwargs
        self.packed = packed
        self.cu_by_device = step.cu_by_device
        self.rank_checked = step.rank_checked
        self.inputs = inputs

    def __repr__(self) -> str:
        return f"<RingPlan {self.kernel} {self.step.layout} packed={self.packed}>"

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
        """The kernel on this rank's q (B, S_local, H, D), k/v (B, S_local, Hk, D) -> (B, S_local, H, D), inside the
        step's rank-check scope (the kernels' cross-rank shape check runs once per step and shape, not per layer).
        A packed row (1, T, H, D) goes to the varlen kernel as is and comes back as (1, T, H, D). ``sink``: the
        attention sinks (H,) (``refusals.sink_of``) or None."""
        kernel = KERNELS[self.kernel]
        token = _RANK_CHECKED.set(self.rank_checked)
        try:
            if self.packed:
                cu = self.cu_by_device.get(q.device)
                if cu is None:
                    cu = self.step.cu_seqlens_on(q.device)
                if sink is None:
                    return kernel(q, k, v, cu, **self.kwargs)
                return kernel(q, k, v, cu, sink=sink, **self.kwargs)
            if sink is None:  # (an extra keyword would make the call merge it into a copy of kwargs)
                return kernel(q, k, v, **self.kwargs)
            return kernel(q, k, v, sink=sink, **self.kwargs)
        except (RingInputError, UnknownBackendError, UnsupportedBackendError) as exc:
            raise _kernel_refusal(exc, self.kernel, self.kwargs.get("backend"), q) from exc
        finally:
            _RANK_CHECKED.reset(token)


def _kernel_refusal(exc: ValueError, kernel: str, backend: Optional[str], q: torch.Tensor) -> UnsupportedArgument:
    """What a kernel refused, as hfpatch's refusal: the kernel's argument (a backend's refusal: the kernel's
    ``:backend``) and its message."""
    if isinstance(exc, RingInputError):
        return UnsupportedArgument(
            exc.argument or "query", exc.value if exc.argument else tuple(q.shape),
            f"ring_kernels.{kernel} refused this call: {exc}",
            "pin another kernel (hfpatch.apply(kernel=...)), or change what the message names.")
    return UnsupportedArgument(
        "kernel", backend, f"the block backend of ring_kernels.{kernel} cannot compute this call: {exc}",
        "leave the backend to the kernel (kernel='<variant>' or '<variant>:auto' picks one that can).")


def build_plan(step: StepState, causal: Any, scale: Any, window: Any, softcap: Any, ctx: RingContext,
               inputs: Optional[tuple], nheads: int, kv_heads: int, head_dim: int) -> RingPlan:
    """The plan of a call on ``step`` with this configuration: the kernel ``kernel_choice.choose`` decides and its
    arguments (``window``: HF's ``sliding_window``; ``inputs``: kept as ``RingPlan.inputs``)."""
    window_size = window_size_of(window, step.seq_len_global)
    kernel = choose(step, bool(causal), window_size, nheads, kv_heads, head_dim, ctx)
    kwargs = dict(group=ctx.group, causal=bool(causal), softmax_scale=None if scale is None else float(scale),
                  backend=ctx.backend, window_size=window_size, softcap=float(softcap or 0.0))
    step = kernel.step
    if kernel.function == FUNCTIONS["llama3", True]:
        kwargs["heads_k_stride"] = ctx.heads_k_stride
    elif step.kernel == "ulysses":
        kwargs["layout"] = step.layout
    elif step.kernel == "usp":
        kwargs.update(groups=kernel.heads.groups, ring_variant=kernel.ring_variant)
    if kernel.function not in KERNELS:
        raise RuntimeError(f"ring_kernels.{kernel.function} is not available in this installation of ring_kernels")
    return RingPlan(step, kernel.function, kwargs, step.packed, inputs)
