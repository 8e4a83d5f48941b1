"""The handler behind every generated wrapper: read the switch, route the call, count it.

``codegen.render(match, dispatcher)`` builds a wrapper with exactly the live signature of
``_flash_attention_forward`` that calls ``dispatcher(call, extra_kwargs)`` with ``call`` keyed by role
(``query``, ``key``, ``value``, ``attention_mask``, ...). Per call the dispatcher:

1. reads ``switch.current_mode()`` (per-thread override over the process-wide default);
2. routes: ``"ring"`` -> ``semantics.ring_attention``; ``"original"`` -> the original transformers function,
   re-called by parameter name (``codegen.original_kwargs``); ``"reference"`` -> ``semantics.reference_attention``
   (all-gather, plain attention on the whole sequence, this rank's slice); ``"local"`` ->
   ``semantics.local_attention`` (no CP: plain attention on the tensors given);
3. counts the call under its layer, so that ``Patch`` can say which attention layers ran the ring in the last
   forward and which did not.

This runs once per attention layer per step, so it is kept cheap (benchmarks/patched_call_overhead.py): the
common eager ring call arrives at ``fast_call`` with the hot roles as positional arguments (no role dict; see
``hfpatch.codegen``) and does the same three things inline; no lock per call (each thread counts into its own
dict; readers sum them); the calling module is read from the one frame whose code can hold it
(``frame.f_locals`` copies every local of a frame, so other frames are skipped by their code object).

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
from hfpatch import codegen as _codegen
from hfpatch import semantics as _semantics
from hfpatch import switch as _switch

__all__ = ["Dispatcher", "LayerRecord"]

# How far up the stack to look for the attention module that made the call: wrapper -> INTEG's
# flash_attention_forward(module, ...) (4.48+) or the *FlashAttention2.forward(self, ...) method (4.43-4.47).
_MAX_FRAMES = 6
_HOLDER_NAMES = ("module", "self")  # the local that holds the calling attention module, in order of preference

# Bound once: these run on every attention call. Dynamo recognises ``torch.compiler.is_compiling`` by identity, so
# the bound name still reads True while it traces.
_is_compiling = torch.compiler.is_compiling
# The autograd engine's current graph task (-1: no backward running on this thread); see _opaque.is_recomputing.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_current_mode = _switch.current_mode
_RECOMPUTED = "<recomputed>"  # the kind under which a recomputed call is counted (never a switch mode)

# id(code) -> (code, names): which of _HOLDER_NAMES a frame of that code can hold. Reading ``frame.f_locals`` builds
# a dict of every local of the frame (Python 3.11), so it is read only for frames that can hold the module; the code
# object is kept in the entry, so its id cannot be reused while cached (code objects hash slowly, hence the id).
_holders: dict = {}
_MAX_HOLDERS = 4096


@dataclass(frozen=True)
class LayerRecord:
    """One attention call site seen in a forward: ``key`` (layer index, or class@id), ``module_id`` (``id``
    of the calling attention module, None when not found), ``mode`` (the switch mode it ran)."""

    key: Hashable
    module_id: int | None
    mode: str


def _holder_names(code) -> tuple:
    names = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
    found = tuple(name for name in _HOLDER_NAMES if name in names)
    if len(_holders) >= _MAX_HOLDERS:
        _holders.clear()
    _holders[id(code)] = (code, found)
    return found


def _slot(layer_idx: Any, module: torch.nn.Module | None) -> tuple:
    """(layer key, module id) under which a call is counted: the layer index (an int, from the call or the
    module), else "Class@id" of the module, else "<unknown caller>"."""
    if isinstance(layer_idx, int):
        key: Hashable = layer_idx
    elif module is not None:
        key = f"{type(module).__name__}@{id(module):x}"
    else:
        key = "<unknown caller>"
    return key, None if module is None else id(module)


def _calling_module(depth: int = 2) -> torch.nn.Module | None:
    """The ``nn.Module`` whose code called the wrapper: the ``module`` argument of transformers'
    ``flash_attention_forward`` or the ``self`` of an attention ``forward``, found within ``_MAX_FRAMES`` frames
    from ``depth`` (2: skip this function and ``Dispatcher.__call__``; the first frame is the wrapper's).
    ``_flash_attention_forward`` is never given the module itself on any release, and ``layer_idx`` only from 4.54
    on, so the stack is the one release-independent source."""
    frame = sys._getframe(depth)
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
                if isinstance(candidate, torch.nn.Module):
                    return candidate
        frame = frame.f_back
    return None


class _ThreadCounts(threading.local):
    """This thread's call counts: ``by_kind[kind][(key, module_id)] -> calls``, kind a switch mode or
    ``_RECOMPUTED``. Only its own thread writes its dicts, so counting takes no lock; readers sum every thread's.
    ``ring`` and ``recomputed`` are the two dicts the fast path writes, held as attributes so that a call reads
    one attribute and hashes its slot once (no ``(kind, slot)`` tuple to build and hash)."""

    def __init__(self, every_thread: list) -> None:
        self.ring: dict = {}
        self.recomputed: dict = {}
        self.by_kind: dict = {"ring": self.ring, _RECOMPUTED: self.recomputed}
        every_thread.append(self.by_kind)  # list.append is atomic; a thread's dicts outlive the thread


class Dispatcher:
    """Callable ``(call, extra_kwargs) -> Tensor`` given to ``codegen.render``.

    ``original``: the transformers function the wrapper replaces; ``match``: the registry match (for
    ``codegen.original_kwargs``); ``ctx``: the ``semantics.RingContext``. Counters (each a fresh ``Counter``
    summed over threads): ``calls`` (layer key -> calls that ran the ring, over the patch's life), ``mode_calls``
    (mode -> calls), ``recomputed`` (layer key -> calls made while autograd ran a backward).
    """

    def __init__(self, *, original: Callable, match: Any, ctx: Any) -> None:
        self.original = original
        self.match = match
        self.ctx = ctx
        self.removed = False
        self._every_thread: list = []
        self._counts = _ThreadCounts(self._every_thread)
        self.opaque_token = _opaque.register_dispatcher(self)  # how torch.compile's opaque operator finds us
        # (key, module_id) -> the mode of its last call in the current forward (one item store per call: atomic).
        self._forward: dict[tuple, str] = {}
        self._lock = threading.Lock()  # for the readers and reset, never taken per call
        self.fast_call = self._make_fast_call()

    # ------------------------------------------------------------------------------------- the fast call
    def _make_fast_call(self) -> Callable:
        """The wrapper's entry for the common call (``codegen`` renders a call to ``fast_call`` when the rarely
        used roles are None): the roles as positional arguments, no role dict. It returns
        ``codegen.DECLINED`` -- and the wrapper then calls ``self(call, extra)``, the generic path -- unless the
        call is an eager ring call: not compiling, not removed, switch "ring". Otherwise it does what
        ``__call__`` does, in the same order: find the calling module, count, ``semantics`` (whose own fast path
        falls back to ``ring_attention`` for anything it does not run itself).

        A closure, not a method: its constants are cells (no attribute reads per call)."""
        ring = _semantics.fast_ring_attention
        ctx = self.ctx
        declined = _codegen.DECLINED
        switch_state = _switch._local  # the per-thread override stack (switch.current_mode, inlined)
        switch_module = _switch
        thread_counts = self._counts
        getframe = sys._getframe
        holders = _holders
        module_type = torch.nn.Module

        def fast_call(q, k, v, mask, causal, dropout, scale, window, softcap, position_ids, extra):
            if _is_compiling() or self.removed:
                return declined
            stack = switch_state.stack
            if (stack[-1] if stack else switch_module._default_mode) != "ring":
                return declined
            # The calling module: the frame above the wrapper is transformers' flash_attention_forward(module, ...)
            # on 4.48+ (else the walk of _calling_module, from the same frame).
            frame = getframe(2)
            code = frame.f_code
            entry = holders.get(id(code))
            module = None
            if entry is not None and entry[0] is code and entry[1]:
                local = frame.f_locals
                for name in entry[1]:
                    candidate = local.get(name)
                    if isinstance(candidate, module_type):
                        module = candidate
                        break
            if module is None:
                module = _calling_module(3)
            layer_idx = extra.get("layer_idx") if extra else None
            if layer_idx is None and module is not None:
                layer_idx = getattr(module, "layer_idx", None)
            if type(layer_idx) is int:
                slot = (layer_idx, None if module is None else id(module))
            else:
                slot = _slot(layer_idx, module)
            if _graph_task_id() != -1:  # checkpointing re-runs a layer in backward: not a new forward
                counts = thread_counts.recomputed
            else:
                counts = thread_counts.ring
                self._forward[slot] = "ring"
            counts[slot] = counts.get(slot, 0) + 1
            return ring(ctx, q, k, v, mask, causal, dropout, scale, window, softcap, position_ids, extra)

        return fast_call

    # ------------------------------------------------------------------------------------- the call
    def __call__(self, call: dict, extra: dict) -> torch.Tensor:
        if _is_compiling():
            # Dynamo cannot trace the ring (P2P, data-dependent checks): one opaque operator that runs the rest
            # of this method at run time (hfpatch/_opaque.py).
            return _opaque.compiled_call(self, call, extra)
        if self.removed:
            return self.call_original(call, extra)
        mode = _current_mode()
        module = _calling_module()  # (fast_call, when it declined, has returned: the wrapper is the caller)
        layer_idx = extra.get("layer_idx") if isinstance(extra, dict) else None
        if layer_idx is None and module is not None:
            layer_idx = getattr(module, "layer_idx", None)
        key, module_id = _slot(layer_idx, module)
        self._count(mode, key, module_id)
        if mode == "ring":
            return _semantics.ring_attention(call, extra, self.ctx)
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
        """Route one call: ``"ring"``, ``"reference"``, ``"local"`` or ``"original"`` (no counting)."""
        if mode == "ring":
            return _semantics.ring_attention(call, extra, self.ctx)
        if mode == "reference":
            return _semantics.reference_attention(call, extra, self.ctx)
        if mode == "local":
            return _semantics.local_attention(call, extra, self.ctx)
        return self.call_original(call, extra)

    def call_original(self, call: dict, extra: dict) -> torch.Tensor:
        """Re-call the original transformers function with this call's arguments, by parameter name."""
        from hfpatch import codegen

        return self.original(**codegen.original_kwargs(self.match, call, extra))

    # ------------------------------------------------------------------------------------- counting
    def _count(self, mode: str, key: Hashable, module_id: int | None) -> None:
        # Two modules with the same layer index (an encoder and a decoder) stay apart by module identity.
        slot = (key, module_id)
        if _graph_task_id() != -1:  # checkpointing re-runs a layer in backward: not a new forward
            counts = self._counts.recomputed
        else:
            by_kind = self._counts.by_kind
            counts = by_kind.get(mode)
            if counts is None:
                counts = by_kind[mode] = {}  # dict item store: atomic; only this thread writes by_kind
            self._forward[slot] = mode
        counts[slot] = counts.get(slot, 0) + 1

    def _tally(self, want: Callable[[str], bool]) -> Counter:
        """layer key (or mode, for ``want=None``) -> calls, summed over every thread's counts."""
        out: Counter = Counter()
        for kind, counts in self._snapshot():
            if want(kind):
                for (key, _module_id), n in counts.items():
                    out[key] += n
        return out

    def _snapshot(self) -> list:
        """[(kind, {slot: calls})] of every thread, copied (``dict()`` copies in C: no torn reads)."""
        with self._lock:
            return [(kind, dict(counts)) for by_kind in self._every_thread for kind, counts in list(by_kind.items())]

    @property
    def calls(self) -> Counter:
        """Layer key -> calls that ran the ring (over the patch's life, recomputations excluded)."""
        return self._tally(lambda kind: kind == "ring")

    @property
    def recomputed(self) -> Counter:
        """Layer key -> calls made while autograd ran a backward (activation checkpointing recomputing a layer):
        kept out of ``calls``, ``mode_calls`` and the per-forward record, which count forwards of the model."""
        return self._tally(lambda kind: kind == _RECOMPUTED)

    @property
    def mode_calls(self) -> Counter:
        """Mode -> calls (recomputations excluded)."""
        out: Counter = Counter()
        for kind, counts in self._snapshot():
            if kind != _RECOMPUTED:
                for n in counts.values():
                    out[kind] += n
        return out

    def begin_forward(self) -> None:
        """Start a new per-forward record (a forward pre-hook of a tracked model calls this)."""
        if torch.compiler.is_compiling():
            return  # a lock cannot be traced; compiled calls keep one record per layer (hfpatch/_opaque.py)
        with self._lock:
            self._forward = {}

    def reset(self) -> None:
        """Clear every counter and the per-forward record."""
        with self._lock:
            for by_kind in self._every_thread:
                for counts in list(by_kind.values()):
                    counts.clear()  # the dicts themselves stay: the fast path holds the thread's ring/recomputed
            self._forward = {}

    def forward_records(self) -> list[LayerRecord]:
        """The calls of the current forward (since the last ``begin_forward``/``reset``), one per layer."""
        with self._lock:
            forward = dict(self._forward)
        return [LayerRecord(key, module_id, mode) for (key, module_id), mode in forward.items()]

