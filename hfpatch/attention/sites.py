"""Where an attention call comes from: its call site (one per attention layer), found from the call's
``layer_idx`` or on the stack, and the ring plans the site keeps under the call's inputs (``INPUTS``).

``_flash_attention_forward`` is never given the module itself on any release, and ``layer_idx`` only from 4.54
on, so the stack is the one release-independent source: the ``module`` argument of transformers'
``flash_attention_forward`` (4.48+) or the ``self`` of an attention ``forward`` (4.43-4.47), a few frames up.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Hashable

import torch

__all__ = ["LayerRecord", "CallSite", "calling_module", "site_key", "INPUTS", "keeps"]

# How far up the stack to look for the attention module that made the call: wrapper -> INTEG's
# flash_attention_forward(module, ...) (4.48+) or the *FlashAttention2.forward(self, ...) method (4.43-4.47).
_MAX_FRAMES = 6
_HOLDER_NAMES = ("module", "self")  # the local that holds the calling attention module, in order of preference
# id(code) -> (code, names): which of _HOLDER_NAMES a frame of that code can hold. Reading ``frame.f_locals`` builds
# a dict of every local of the frame (Python 3.11), so it is read only for frames that can hold the module; the code
# object is kept in the entry, so its id cannot be reused while cached (code objects hash slowly, hence the id).
_holders: dict = {}
_MAX_HOLDERS = 4096
_getframe, _Module = sys._getframe, torch.nn.Module
MAX_SITE_PLANS = 8  # plans of one step kept per site (a layer has one configuration); beyond this, restart
# What a call's inputs hold, in the order ``Dispatcher.entry`` builds them: everything a ring plan is built from
# or the ring refuses. A plan kept with its inputs (``RingPlan.inputs``) computes every call whose inputs equal them.
# A tensor is held after its id: the tuples compare left to right and stop at the first difference, so a tensor is
# compared only with itself (a kept plan holds it, so its id cannot be reused) and never by value.
INPUTS = ("mode", "context version", "id(position_ids)", "position_ids", "position_ids._version", "query.shape",
          "key.numel()", "is_causal", "softmax_scale", "sliding_window", "type(sliding_window)", "softcap",
          "dropout", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "block_table", "k_cache", "v_cache",
          "id(s_aux)", "s_aux", "cache or cache_seqlens given")
# The step a plan belongs to: the context's version, the position ids, the query's shape and the key's size.
STEP_INPUTS = slice(INPUTS.index("context version"), INPUTS.index("key.numel()") + 1)
_WINDOW_TYPE = INPUTS.index("type(sliding_window)")
_DROPOUT = INPUTS.index("dropout")
_ABSENT = slice(INPUTS.index("attention_mask"), INPUTS.index("v_cache") + 1)  # what a kept plan's call lacks
_PAGED = INPUTS.index("cache or cache_seqlens given")
_KEPT_WINDOW_TYPES = (int, type(None))  # True == 1, 2.0 == 2: another type is planned (and refused) every call


def keeps(inputs: tuple) -> bool:
    """Whether a plan of these inputs may be kept: nothing in the call is refused or derived per call (no
    dropout, mask, document lengths, paged cache or cache kwargs; an int or no window)."""
    return (not inputs[_DROPOUT] and all(value is None for value in inputs[_ABSENT]) and not inputs[_PAGED]
            and inputs[_WINDOW_TYPE] in _KEPT_WINDOW_TYPES)


@dataclass(frozen=True)
class LayerRecord:
    """One attention call site seen in a forward: ``key`` (layer index, or class@id), ``module_id`` (``id``
    of the calling attention module, None when not found), ``mode`` (the switch mode it ran)."""

    key: Hashable
    module_id: int | None
    mode: str


class CallSite:
    """One call site -- an attention layer -- and the ring plans it keeps.

    key, module_id:  what its calls are counted and recorded under (see ``LayerRecord``).
    plans:           ``RingPlan.inputs`` -> the plan, every one of the same step (``STEP_INPUTS``): a call whose
                     inputs equal a kept plan's runs it (``Dispatcher.entry``);
    plan:            the plan kept last (None: none), compared first: a layer makes one configuration of call.
    """

    __slots__ = ("key", "module_id", "plans", "plan")

    def __init__(self, key: Hashable, module_id: int | None) -> None:
        self.key = key
        self.module_id = module_id
        self.plans: dict = {}
        self.plan = None

    def plan_for(self, inputs: tuple):
        """The kept plan of these inputs, or None (an unhashable input has none)."""
        try:
            return self.plans.get(inputs)
        except TypeError:
            return None

    def keep(self, plan) -> None:
        """Keep ``plan`` under its inputs; plans of another step are dropped (and the tensors they hold)."""
        last, plans = self.plan, self.plans
        if last is None or last.inputs[STEP_INPUTS] != plan.inputs[STEP_INPUTS] or len(plans) >= MAX_SITE_PLANS:
            plans = {}  # a new dict, not cleared: another thread may be reading the old one
        plans[plan.inputs] = plan
        self.plans, self.plan = plans, plan

    def forget(self) -> None:
        """Drop every kept plan: the next call is planned (``Dispatcher.plan_and_run``)."""
        self.plans, self.plan = {}, None

    def __repr__(self) -> str:
        return f"<CallSite {self.key!r} module={self.module_id} plans={list(self.plans.values())}>"


def _holder_names(code) -> tuple:
    names = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
    found = tuple(name for name in _HOLDER_NAMES if name in names)
    if len(_holders) >= _MAX_HOLDERS:
        _holders.clear()
    _holders[id(code)] = (code, found)
    return found


def site_key(layer_idx: Any, module: torch.nn.Module | None) -> tuple:
    """(layer key, module id) under which a call is counted: the layer index (an int, from the call or the
    module), else "Class@id" of the module, else "<unknown caller>"."""
    if isinstance(layer_idx, int):
        key: Hashable = layer_idx
    elif module is not None:
        key = f"{type(module).__name__}@{id(module):x}"
    else:
        key = "<unknown caller>"
    return key, None if module is None else id(module)


def calling_module(depth: int = 2) -> torch.nn.Module | None:
    """The ``nn.Module`` whose code called the wrapper: the ``module`` argument of transformers'
    ``flash_attention_forward`` or the ``self`` of an attention ``forward``, found within ``_MAX_FRAMES`` frames
    from ``depth`` (the frame that called the dispatcher's entry; 0 is this function's own frame).
    ``_flash_attention_forward`` is never given the module itself on any release, and ``layer_idx`` only from 4.54
    on, so the stack is the one release-independent source."""
    frame = _getframe(depth)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        entry = _holders.get(id(code))
        names = entry[1] if entry is not None and entry[0] is code else _holder_names(code)
        if names:
            local = frame.f_locals
            for name in names:
                candidate = local.get(name)
                if isinstance(candidate, _Module):
                    return candidate
        frame = frame.f_back
    return None
