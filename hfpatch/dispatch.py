"""The handler behind every generated wrapper: read the switch, route the call, count it.

``codegen.render(match, dispatcher)`` builds a wrapper with exactly the live signature of
``_flash_attention_forward`` that calls ``dispatcher(call, extra_kwargs)`` with ``call`` keyed by role
(``query``, ``key``, ``value``, ``attention_mask``, ...). Per call the dispatcher:

1. reads ``switch.current_mode()`` (per-thread override over the process-wide default);
2. routes: ``"ring"`` -> ``semantics.ring_attention``; ``"original"`` -> the original transformers function,
   re-called by parameter name (``codegen.original_kwargs``); ``"reference"`` -> ``semantics.reference_attention``
   (all-gather, plain attention on the whole sequence, this rank's slice);
3. counts the call under its layer, so that ``Patch`` can say which attention layers ran the ring in the last
   forward and which did not.

After ``Patch.remove()`` a wrapper may still be referenced somewhere (a user variable): it then calls the
original function, exactly what the restored binding sites call.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from hfpatch import _opaque
from hfpatch import switch as _switch

__all__ = ["Dispatcher", "LayerRecord"]

# How far up the stack to look for the attention module that made the call: wrapper -> INTEG's
# flash_attention_forward(module, ...) (4.48+) or the *FlashAttention2.forward(self, ...) method (4.43-4.47).
_MAX_FRAMES = 6


@dataclass(frozen=True)
class LayerRecord:
    """One attention call site seen in a forward: ``key`` (layer index, or class@id), ``module_id`` (``id``
    of the calling attention module, None when not found), ``mode`` (the switch mode it ran)."""

    key: Hashable
    module_id: int | None
    mode: str


def _calling_module() -> torch.nn.Module | None:
    """The ``nn.Module`` whose code called the wrapper: the ``module`` argument of transformers'
    ``flash_attention_forward`` or the ``self`` of an attention ``forward``. ``_flash_attention_forward`` is
    never given the module itself on any release, and ``layer_idx`` only from 4.54 on, so the stack is the
    one release-independent source."""
    frame = sys._getframe(3)  # skip this function, Dispatcher._record, Dispatcher.__call__
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        local = frame.f_locals
        for name in ("module", "self"):
            candidate = local.get(name)
            if isinstance(candidate, torch.nn.Module):
                return candidate
        frame = frame.f_back
    return None


class Dispatcher:
    """Callable ``(call, extra_kwargs) -> Tensor`` given to ``codegen.render``.

    ``original``: the transformers function the wrapper replaces; ``match``: the registry match (for
    ``codegen.original_kwargs``); ``ctx``: the ``semantics.RingContext``. Counters: ``calls`` (layer key ->
    calls that ran the ring, over the patch's life), ``mode_calls`` (mode -> calls).
    """

    def __init__(self, *, original: Callable, match: Any, ctx: Any) -> None:
        self.original = original
        self.match = match
        self.ctx = ctx
        self.removed = False
        self.calls: Counter = Counter()
        self.mode_calls: Counter = Counter()
        # Layer key -> calls made while autograd ran a backward (activation checkpointing recomputing a layer):
        # kept out of ``calls`` and the per-forward record, which count forwards of the model.
        self.recomputed: Counter = Counter()
        self.opaque_token = _opaque.register_dispatcher(self)  # how torch.compile's opaque operator finds us
        self._forward: dict[Hashable, LayerRecord] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------- the call
    def __call__(self, call: dict, extra: dict) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Dynamo cannot trace the ring (P2P, data-dependent checks): one opaque operator that runs the rest
            # of this method at run time (hfpatch/_opaque.py).
            return _opaque.compiled_call(self, call, extra)
        if self.removed:
            return self.call_original(call, extra)
        mode = _switch.current_mode()
        self._record(mode, extra)
        return self.run_mode(mode, call, extra)

    def compiled_forward(self, call: dict, extra: dict) -> str:
        """Run-time part of a compiled call: the mode to run, counted like an eager call (the caller module is
        not on the stack in compiled code: the key is ``layer_idx``, or "<compiled>")."""
        if self.removed:
            return "original"
        mode = _switch.current_mode()
        layer_idx = extra.get("layer_idx") if isinstance(extra, dict) else None
        self._count(mode, layer_idx if isinstance(layer_idx, int) else "<compiled>", None)
        return mode

    def run_mode(self, mode: str, call: dict, extra: dict) -> torch.Tensor:
        """Route one call: ``"ring"``, ``"reference"`` or ``"original"`` (no counting)."""
        if mode == "ring":
            from hfpatch import semantics

            return semantics.ring_attention(call, extra, self.ctx)
        if mode == "reference":
            from hfpatch import semantics

            return semantics.reference_attention(call, extra, self.ctx)
        return self.call_original(call, extra)

    def call_original(self, call: dict, extra: dict) -> torch.Tensor:
        """Re-call the original transformers function with this call's arguments, by parameter name."""
        from hfpatch import codegen

        return self.original(**codegen.original_kwargs(self.match, call, extra))

    # ------------------------------------------------------------------------------------- counting
    def _record(self, mode: str, extra: dict) -> None:
        module = _calling_module()
        layer_idx = extra.get("layer_idx") if isinstance(extra, dict) else None
        if layer_idx is None and module is not None:
            layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int):
            key: Hashable = layer_idx
        elif module is not None:
            key = f"{type(module).__name__}@{id(module):x}"
        else:
            key = "<unknown caller>"
        self._count(mode, key, id(module) if module is not None else None)

    def _count(self, mode: str, key: Hashable, module_id: int | None) -> None:
        # Two modules with the same layer index (an encoder and a decoder) stay apart by module identity.
        slot = (key, module_id)
        with self._lock:
            if _opaque.is_recomputing():  # checkpointing re-runs a layer in backward: not a new forward
                self.recomputed[key] += 1
                return
            self.mode_calls[mode] += 1
            if mode == "ring":
                self.calls[key] += 1
            self._forward[slot] = LayerRecord(key, slot[1], mode)

    def begin_forward(self) -> None:
        """Start a new per-forward record (a forward pre-hook of a tracked model calls this)."""
        if torch.compiler.is_compiling():
            return  # a lock cannot be traced; compiled calls keep one record per layer (hfpatch/_opaque.py)
        with self._lock:
            self._forward = {}

    def reset(self) -> None:
        """Clear every counter and the per-forward record."""
        with self._lock:
            self.calls.clear()
            self.mode_calls.clear()
            self.recomputed.clear()
            self._forward = {}

    def forward_records(self) -> list[LayerRecord]:
        """The calls of the current forward (since the last ``begin_forward``/``reset``), one per layer."""
        with self._lock:
            return list(self._forward.values())
