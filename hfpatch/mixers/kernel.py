"""The interface of one sequence kernel hfpatch can run under CP, and the call object it receives.

A *sequence kernel* is a function a mixer module's ``forward`` calls on this rank's tokens (HF's
``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ...). hfpatch replaces the module-level name the forward
reads with a wrapper (``hfpatch.mixers.install``) that, in switch mode ``"ring"``, hands a ``KernelCall`` and the
step's ``SegmentPlan`` to the kernel's ``SequenceKernel.run_cp``. A mixer kind (Mamba's selective scan, Mamba2's
SSD, lightning attention, RG-LRU, ...) is one subclass in its own module of ``hfpatch.mixers.kinds``, listed in
``kinds.KERNELS``, plus the registry entries of the families that call it (``hfpatch.mixers.families``).

What ``run_cp`` does, for every kind (``segments.SegmentPlan``):

1. ``call.arg(name)`` / ``plan.split(x, dim)``: this rank's segments of each token-indexed argument;
2. summarise each segment from a zero state, using the ORIGINAL kernel (``call.original_with(...)``) wherever
   possible, so that the fast implementation HF picked (fla, causal-conv1d, mamba-ssm, or the torch fallback) does
   the work: e.g. the transition of an affine recurrence by linearity (an identity initial state, zero inputs);
3. ``plan.exchange(summaries, compose, initial)``: the state entering each local segment;
4. correct (or re-run) each segment from its entering state; ``plan.join``: the local output.

Everything stays differentiable: autograd carries the gradient back through the correction, ``compose`` and the
exchange's all-gather to the ranks whose segments produced the states.

What the kinds and the CP forms share lives here too: the refusal of a recurrent state carried in from a cache
(``CACHE_REASON``, ``CACHE_FIX``, ``refuse_cache``), the refusal of packing metadata handed to a state-space scan
(``refuse_packing``), and the step sizes of those scans (``discretised_dt``).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.segments import SegmentPlan
from ring_kernels.layout import shard, unshard

__all__ = ["KernelCall", "SequenceKernel", "CACHE_REASON", "CACHE_FIX", "PACKING_KWARGS", "refuse_cache",
           "refuse_packing", "discretised_dt"]

CACHE_REASON = ("a recurrent state carried in from a cache (generation) cannot be used with context parallelism, "
                "where every rank holds a slice of one whole sequence.")
CACHE_FIX = "call the model with use_cache=False under CP, or generate after patch.remove() (the model as it was)."

# Packing metadata the fast kernels would honour (document starts reset the state or the window).
PACKING_KWARGS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q")


class KernelCall:
    """One call of the original kernel: its arguments bound by name to the original's signature.

    ``original``: the function the wrapper replaced. ``arguments``: name -> value (``**kwargs`` under its own
    name, as ``inspect.BoundArguments`` holds it).
    """

    def __init__(self, original: Callable, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        self.original = original
        self.signature = signature
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.arguments = dict(bound.arguments)
        self._var_kw = next((p.name for p in signature.parameters.values()
                             if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def arg(self, name: str, default: Any = None) -> Any:
        """The value of parameter ``name``, or of a ``**kwargs`` entry of that name; ``default`` if absent."""
        if name in self.arguments and name != self._var_kw:
            return self.arguments[name]
        return self.extra.get(name, default)

    @property
    def extra(self) -> dict:
        """The ``**kwargs`` the caller passed (empty when the kernel takes none)."""
        return dict(self.arguments.get(self._var_kw, {})) if self._var_kw else {}

    def original_with(self, **replace: Any) -> Any:
        """Call the original kernel with this call's arguments, ``replace`` overriding some of them by name.

        Parameters without a default go by position, every other one by keyword: HF's hub wrappers
        (``use_kernel_func_from_hub_with_fallback``) forward the call to a fast implementation (causal-conv1d,
        mamba-ssm, flash-linear-attention) whose optional parameters are in another order than the torch
        function's, and drop the keywords it does not take."""
        arguments = dict(self.arguments)
        extra = dict(arguments.pop(self._var_kw, {})) if self._var_kw else {}
        for name, value in replace.items():
            if name in arguments:
                arguments[name] = value
            else:
                extra[name] = value
        parameters = self.signature.parameters
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values()):
            bound = inspect.BoundArguments(self.signature, arguments)
            return self.original(*bound.args, **bound.kwargs, **extra)
        args, kwargs = [], {}
        for name, value in arguments.items():
            parameter = parameters[name]
            if parameter.kind is inspect.Parameter.POSITIONAL_ONLY or (
                    parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                    and parameter.default is inspect.Parameter.empty and not kwargs):
                args.append(value)
            else:
                kwargs[name] = value
        return self.original(*args, **kwargs, **extra)


class SequenceKernel:
    """One kind of sequence kernel under CP (see the module docstring). Subclasses set ``role`` (the name the
    registry uses for it) and ``token_args`` (argument name -> its token dimension), and implement ``run_cp``;
    ``check`` refuses what the kind cannot honour (``UnsupportedArgument``), ``reference`` runs the original on
    the all-gathered sequence (switch mode ``"reference"``)."""

    role: str = ""
    token_args: dict = {}
    output_token_dim: int = 1

    def check(self, call: KernelCall) -> None:
        """Raise ``UnsupportedArgument`` for an argument the CP form cannot honour (a cache, packing metadata)."""

    def shape(self, call: KernelCall) -> Tuple[int, int]:
        """(batch, local tokens) of the call: from its first token-indexed argument."""
        name, dim = next(iter(self.token_args.items()))
        x = call.arg(name)
        return int(x.shape[0]), int(x.shape[dim])

    def run_cp(self, call: KernelCall, plan: SegmentPlan) -> Any:
        raise NotImplementedError

    def reference(self, call: KernelCall, plan: SegmentPlan) -> Any:
        """The original kernel on the whole sequence (every token-indexed argument all-gathered), this rank's
        tokens of the output returned; a second output (a final state) is passed through."""
        def gathered(name: str, dim: int) -> Optional[torch.Tensor]:
            x = call.arg(name)
            return None if x is None else unshard(x, plan.group, layout=plan.layout, dim=dim,
                                                  cu_seqlens=plan.cu_seqlens)

        whole = call.original_with(**{name: gathered(name, dim) for name, dim in self.token_args.items()
                                      if call.arg(name) is not None})
        first = whole[0] if isinstance(whole, tuple) else whole
        mine = shard(first, plan.group, layout=plan.layout, dim=self.output_token_dim, cu_seqlens=plan.cu_seqlens)
        return (mine,) + tuple(whole[1:]) if isinstance(whole, tuple) else mine


def refuse_cache(name: str, cache: Any) -> None:
    """Raise ``UnsupportedArgument`` naming ``name`` when a cache was passed. The error carries the cache's class
    name, not the cache: some releases' cache classes cannot be printed (Lfm2HybridConvCache in 4.54)."""
    if cache is not None:
        raise UnsupportedArgument(name, f"a {type(cache).__name__}", CACHE_REASON, CACHE_FIX)


def refuse_packing(call: KernelCall, kernel: str) -> None:
    """``UnsupportedArgument`` when ``call`` of the state-space scan ``kernel`` carries packing metadata
    (``seq_idx``, ``cu_seqlens``, ...)."""
    for name in PACKING_KWARGS:
        if call.arg(name) is not None:
            raise UnsupportedArgument(
                name, call.arg(name),
                f"packing metadata passed to a state-space scan ({kernel}) under CP: hfpatch's mixer exchange runs "
                "the documents of a packed row as one sequence, like HF's torch path, and does not reset the state "
                "at document starts.",
                "pass packed documents as position_ids only (shard_inputs), not seq_idx / cu_seq_lens_*.",
            )


def discretised_dt(dt: torch.Tensor, bias: Optional[torch.Tensor], softplus: bool,
                   limit: Optional[tuple] = None) -> torch.Tensor:
    """The step sizes a state-space scan uses, in fp32: ``clamp(softplus(dt + bias), *limit)`` (bias broadcast
    against dt as given; no clamp when ``limit`` is None), as HF's torch paths compute them (mamba-ssm skips
    Mamba2's clamp at the default limit (0, inf), which changes nothing after a softplus)."""
    dt = dt.float() if bias is None else dt.float() + bias.float()
    if softplus:
        dt = F.softplus(dt)
    return dt if limit is None else dt.clamp(min=limit[0], max=limit[1])
