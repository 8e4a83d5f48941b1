"""``keep_attention(model, budget)``: activation checkpointing that keeps each checkpointed layer's attention output,
so that the backward's recomputation of the layer skips the ring forward and its communication.

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    #   or FSDP2's usual torch checkpoint_wrapper / apply_activation_checkpointing, before or after this call
    kept = hfpatch.keep_attention(model, budget="auto")      # GiB (a number), "auto" (CUDA: what fits) or "all"
    ... train ...
    kept.remove()                                            # plain checkpointing again

The mechanism is ``ring_kernels.checkpointing``: each checkpoint call becomes a region whose forward keeps its ring
calls' merged output and LSE within the budget, and whose recomputation takes them instead of running the ring
again. The rest of the layer is recomputed as before, and the gradients are bitwise those of plain checkpointing:
the kept tensors are the ones the forward computed. A kept call's backward fetches the K/V block its forward ended
on again (one K/V hop) instead of holding it.

What is wrapped: at every forward of ``model`` (a forward pre-hook, so that enabling checkpointing, FSDP2 or
transformers' Trainer may come before or after this call), the checkpoint function of

- every torch ``CheckpointWrapper`` (``checkpoint_wrapper``, ``apply_activation_checkpointing``: ``checkpoint_fn``);
- every module transformers checkpoints (``gradient_checkpointing`` set, ``_gradient_checkpointing_func``).

A training forward (``model.training`` and gradients on) that finds no checkpointed module raises
``KeepAttentionError``: without recomputation there is nothing to skip. So does a compiled model's forward
(``torch.compile``: its attention operator recomputes its own forward in backward, whatever is kept). So does a module checkpointed twice (a
``CheckpointWrapper`` around a layer transformers checkpoints too): it recomputes twice whatever is kept.

Budget (``budget=``), counted over the kept outputs alive at once:

- a number: GiB; each forward keeps its first checkpointed layers until the next would exceed it;
- ``"auto"`` (CUDA): the first step keeps nothing and measures the peak; then the device's memory less
  ``headroom`` (10%) less that peak (and less what the step's allocations grew since: optimizer states) is the
  budget, re-evaluated at each forward; a warning says when not even one layer fits;
- ``"all"``: every layer, no limit.

A layer's kept output is its attention output (local tokens x heads x head dim in the model's dtype; for
Llama-style models one hidden state) plus its fp32 LSE (local tokens x heads x 4 bytes): Llama-3-8B at 64k tokens
per GPU keeps 512 + 8 MiB per layer, 16.3 GiB for all 32. What it saves is the ring forward of each kept layer's
recomputation: attention's forward share of the step, which grows with the sequence (attention is quadratic).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple, Union

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from hfpatch.errors import KeepAttentionError
from ring_kernels.checkpointing import OutputKeeper, keeping

__all__ = ["keep_attention", "KeptAttention"]

logger = logging.getLogger("hfpatch")

_TORCH_WRAPPER = "checkpoint_fn"
_TRANSFORMERS = "_gradient_checkpointing_func"


def _budget_bytes(budget: Union[float, int, str]):
    """``budget`` as ``OutputKeeper``'s budget_bytes (module docstring)."""
    if budget == "auto":
        return "auto"
    if budget == "all":
        return None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget >= 0:
        return int(budget * 2**30)
    raise KeepAttentionError(
        f"keep_attention: budget={budget!r} is not a budget; pass GiB of kept attention outputs as a number >= 0 "
        "(e.g. 12), 'auto' (CUDA: what fits beside the step's peak) or 'all' (every checkpointed layer)")


def _inside(name: str, ancestor: str) -> bool:
    """Whether module ``name`` lies inside module ``ancestor`` (names as ``named_modules`` gives them)."""
    return ancestor == "" or name.startswith(ancestor + ".")


@torch.compiler.disable
def _refuse_compiled_model() -> None:
    """Raise ``KeepAttentionError`` for a compiled model. Hidden from Dynamo, so the error is raised when the compiled
    code runs, whatever the torch release does with an exception raised while tracing (see
    ``ring_kernels.checkpointing``)."""
    raise KeepAttentionError(
        "keep_attention does not apply to a compiled model: the compiled attention operator recomputes its "
        "forward in its own backward, so outputs kept through checkpointing would only cost memory. Fix: "
        "remove keep_attention (kept.remove()) when compiling, or train without torch.compile")


def _refusing_compile(kept_checkpoint):
    """``kept_checkpoint`` that refuses to run in a model compiled by torch.compile (see ``hfpatch.attention.opaque``:
    the compiled attention operator recomputes its forward in its own backward, so kept outputs would only cost
    memory)."""

    def checkpoint_fn(function, *args, **kwargs):
        if torch.compiler.is_compiling():
            _refuse_compiled_model()
        return kept_checkpoint(function, *args, **kwargs)

    checkpoint_fn.keeper = kept_checkpoint.keeper
    return checkpoint_fn


class KeptAttention:
    """What ``keep_attention`` installed on one model. ``keeper``: the ``ring_kernels.checkpointing.OutputKeeper``
    (its ``stats()``: kept, replayed, gaps, bytes, budget); ``wrapped``: the module names whose checkpoint function
    keeps attention, as of the last forward. ``remove()`` restores every checkpoint function it wrapped."""

    def __init__(self, model: torch.nn.Module, keeper: OutputKeeper) -> None:
        self.model = model
        self.keeper = keeper
        self.wrapped: List[str] = []
        self._originals: Dict[Tuple[int, str], Tuple[torch.nn.Module, Any, Any]] = {}
        self._hook = model.register_forward_pre_hook(self._before_forward)
        self._removed = False
        self._wrap()

    def __repr__(self) -> str:
        return f"<hfpatch.KeptAttention {len(self.wrapped)} checkpointed modules, {self.keeper!r}>"

    def stats(self) -> Dict[str, Any]:
        """The keeper's counters and the number of checkpointed modules wrapped."""
        return dict(self.keeper.stats(), modules=len(self.wrapped))

    # --------------------------------------------------------------------------------------------- wrapping
    def _checkpointed(self) -> List[Tuple[str, torch.nn.Module, str]]:
        """(name, module, attribute) of every checkpointed module of the model."""
        found = []
        for name, module in self.model.named_modules():
            if isinstance(module, CheckpointWrapper):
                found.append((name, module, _TORCH_WRAPPER))
            elif getattr(module, "gradient_checkpointing", False) is True and \
                    callable(getattr(module, _TRANSFORMERS, None)):
                found.append((name, module, _TRANSFORMERS))
        wrappers = [name for name, _, attribute in found if attribute == _TORCH_WRAPPER]
        for name, _, attribute in found:
            if attribute != _TRANSFORMERS:
                continue
            # transformers checkpoints a layer inside a wrapper (5.x: the layer itself), or a stack of wrapped
            # layers (4.x: the decoder stack's function): either way each layer is checkpointed twice
            nested = [w for w in wrappers if _inside(name, w) or _inside(w, name)]
            if nested:
                raise KeepAttentionError(
                    f"keep_attention: {nested[0]!r} is checkpointed twice, by torch's checkpoint_wrapper and by "
                    f"transformers' gradient checkpointing (of {name or type(self.model).__name__!r}): every "
                    "recomputation runs it twice, kept outputs or not. Use one: model.gradient_checkpointing_disable() "
                    "with checkpoint_wrapper (FSDP2), or no wrapper")
        return found

    def _wrap(self) -> List[Tuple[str, torch.nn.Module, str]]:
        found = self._checkpointed()
        for name, module, attribute in found:
            current = getattr(module, attribute)
            if getattr(current, "keeper", None) is self.keeper:
                continue
            key = (id(module), attribute)
            # the first original stays the one to restore (a re-enabled checkpointing replaces ours: wrap again)
            self._originals.setdefault(key, (module, attribute, current))
            setattr(module, attribute, _refusing_compile(keeping(current, self.keeper)))
        self.wrapped = [name for name, _, _ in found]
        return found

    def _before_forward(self, model, args):
        found = self._wrap()
        if not found and model.training and torch.is_grad_enabled():
            raise KeepAttentionError(
                f"keep_attention: {type(model).__name__} is training with no checkpointed layer, so there is no "
                "recomputation for kept attention outputs to skip. Enable activation checkpointing "
                "(model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}), or "
                "torch's checkpoint_wrapper / apply_activation_checkpointing), or remove keep_attention")
        return None

    def remove(self) -> None:
        """Restore every wrapped checkpoint function and drop the pre-hook (idempotent)."""
        if self._removed:
            return
        self._removed = True
        self._hook.remove()
        for module, attribute, original in self._originals.values():
            if getattr(getattr(module, attribute, None), "keeper", None) is self.keeper:
                setattr(module, attribute, original)
        self._originals.clear()
        self.wrapped = []


def keep_attention(model: torch.nn.Module, budget: Union[float, int, str] = "auto", *,
                   headroom: float = 0.10) -> KeptAttention:
    """Keep the attention outputs of ``model``'s checkpointed layers through activation checkpointing (module
    docstring). ``budget``: GiB (a number), ``"auto"`` (CUDA) or ``"all"``; ``headroom``: for ``"auto"``, the share
    of the device's memory left free. Raises ``KeepAttentionError`` for a budget it cannot read (and for
    ``"auto"`` without CUDA) and, at a training forward, when nothing or something twice is checkpointed."""
    if not isinstance(model, torch.nn.Module):
        raise KeepAttentionError(f"keep_attention: model must be a torch.nn.Module, got {type(model).__name__}")
    budget_bytes = _budget_bytes(budget)
    if budget_bytes == "auto" and not torch.cuda.is_available():
        raise KeepAttentionError(
            "keep_attention: budget='auto' measures CUDA memory and no CUDA device is available; pass GiB (a "
            "number) or 'all'")
    try:
        keeper = OutputKeeper(budget_bytes, headroom=headroom)
    except ValueError as exc:
        raise KeepAttentionError(f"keep_attention: {exc}") from exc
    kept = KeptAttention(model, keeper)
    logger.info("hfpatch: keep_attention on %s: budget %s, %d checkpointed modules now", type(model).__name__,
                budget, len(kept.wrapped))
    return kept
