"""The handler behind every generated wrapper: find the call site, run its plan, count the call.

``codegen.render(match, dispatcher.entry)`` builds a wrapper with exactly the live signature of
``_flash_attention_forward`` that calls ``dispatcher.entry(<each role of codegen.ROLE_ORDER>, extra_kwargs)``.
Per call:

1. The call site: the attention layer that made the call, as a ``CallSite`` (one per layer, kept for the patch's
   life). A model given to ``track`` (``apply(model=)`` does) has its attention modules' sites bound once, by
   ``layer_idx``, and used while that model's forward runs on this thread (transformers passes ``layer_idx`` from
   4.54 on); any other call finds its module on the stack: the wrapper's caller (transformers' integration,
   4.48+) first, then ``calling_module``.
2. The call's inputs (``INPUTS``): the switch mode, the context's version, the position ids (object and version),
   query shape, key size, configuration, the roles the ring refuses or derives from (mask, dropout, document
   lengths, paged cache) and the attention sinks. The site's plan (the ``plan.RingPlan`` its last planned
   ring call ran, or another configuration's that the site kept) carries the inputs it was kept for: when they
   equal this call's -- one tuple comparison -- the call is counted and ``plan.run(q, k, v, sink)`` computes it
   on q, k, v cast as HF casts them (``refusals.cast_to_target``).
3. Anything else is planned (``plan_and_run``): the role dict, the call counted under its mode, then ``"ring"`` ->
   ``semantics.ring_plan`` (every refusal, the step, the kernel's arguments); the plan runs and, when nothing in the
   call is refused or derived per call, the site keeps it with its inputs (``CallSite.plans``: the one plan cache);
   ``"original"`` -> ``run_original``: the original transformers function, re-called by parameter name, where its
   flash path can run (``whole.flash_path_runs``, a non-CPU query), else ``whole.local_attention`` (what
   the model's own SDPA/eager attention computes on these tensors); ``"reference"``/``"local"`` -> ``whole``
   (``"local"`` on this rank's shard of a step warns once per patch: it is not the non-CP computation). While
   Dynamo traces (torch.compile) the call is one opaque operator (``hfpatch.attention.opaque``).

Counts live per thread (``ThreadState``: no lock per call; readers sum every thread's), under the call's site, so
that ``Patch`` can say which attention layers ran the ring in the last forward and which did not. After
``Patch.remove()`` (``removed = True`` drops every plan) a wrapper may still be referenced somewhere (a
user variable): it then calls the original function, exactly what the restored binding sites call.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from typing import Any, Callable, Iterator

import torch

from hfpatch.attention import opaque
from hfpatch.attention import codegen
from hfpatch.attention import semantics
from hfpatch.attention import whole
from hfpatch import modes
from hfpatch.attention.context import RingContext
from hfpatch.attention.discovery import attention_modules
from hfpatch.attention.refusals import cast_to_target, sink_of
from hfpatch.attention.sites import INPUTS, CallSite, LayerRecord, calling_module, keeps, site_key
from hfpatch.errors import UnsupportedArgument
from hfpatch.undo import UndoStack

__all__ = ["Dispatcher", "LayerRecord", "CallSite", "ThreadState", "INPUTS", "calling_module", "original_caller"]

# Bound once: these run on every attention call. Dynamo recognises ``torch.compiler.is_compiling`` by identity, so
# the bound name still reads True while it traces.
_is_compiling = torch.compiler.is_compiling
# ``is_compiling()`` is ``_is_compiling_flag`` (set by non-strict torch.export) behind a TorchScript check, two Python
# calls; the entry reads its parts: ``is_dynamo_compiling()`` (one call; Dynamo folds it to True, like is_compiling)
# or the flag. A torch without them: is_compiling itself, and a flag that is never set.
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", _is_compiling)
_export_flag = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else type(
    "_NoFlag", (), {"_is_compiling_flag": False})
# The autograd engine's current graph task (-1: no backward running on this thread); see opaque.is_recomputing.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_current_mode = modes.current_mode
_refresh_switch = modes.refresh_from_env
logger = logging.getLogger("hfpatch")
_RECOMPUTED = "<recomputed>"  # the kind under which a recomputed call is counted (never a switch mode)

_MAX_SITES = 4096  # call sites kept per dispatcher (a model has one per attention layer); beyond this, restart



def original_caller(original: Callable, match: Any) -> Callable[[dict, dict], torch.Tensor]:
    """``(call, extra) -> Tensor`` that re-calls ``original`` (the transformers function the wrapper replaces) with
    a call's arguments, by parameter name (``RingContext.call_original``)."""
    def call_original(call: dict, extra: dict) -> torch.Tensor:
        return original(**codegen.original_kwargs(match, call, extra))

    return call_original


class ThreadState:
    """One thread's state: call counts ``by_kind[kind][site] -> calls`` (kind a switch mode or ``_RECOMPUTED``;
    ``ring`` and ``recomputed`` are two of them; only its own thread writes them, so counting takes no lock;
    readers sum every thread's), ``bound``, the sites of the tracked model whose forward runs on this thread
    (layer_idx -> CallSite; None outside one), ``outer_bound`` those of the enclosing tracked forwards, and
    ``thread_mode``, this thread's ``hfpatch.modes.ThreadMode`` (its ``mode``: the switch for this thread's calls)."""

    __slots__ = ("ring", "recomputed", "by_kind", "bound", "outer_bound", "thread_mode")

    def __init__(self) -> None:
        self.ring: dict = {}
        self.recomputed: dict = {}
        self.by_kind: dict = {"ring": self.ring, _RECOMPUTED: self.recomputed}
        self.bound: dict | None = None
        self.outer_bound: list = []
        self.thread_mode = modes.thread_mode()  # read in the thread that owns it


class _PerThread(threading.local):
    """``.state``: this thread's ``ThreadState`` (one thread-local read per call; its fields are slots)."""

    def __init__(self, every_thread: list) -> None:
        self.state = ThreadState()
        every_thread.append(self.state.by_kind)  # list.append is atomic; a thread's dicts outlive the thread


class Dispatcher:
    """The handler of one patch. ``entry`` is what ``codegen.render`` is given; calling the dispatcher itself,
    ``dispatcher(call, extra)``, is the same entry with the arguments as a role dict.

    ``original``: the transformers function the wrapper replaces; ``match``: the registry match (for
    ``codegen.original_kwargs``); ``ctx``: the ``context.RingContext`` its calls run on (``using`` swaps it). Counters (each a fresh ``Counter``
    summed over threads): ``calls`` (layer key -> calls that ran the ring, over the patch's life), ``mode_calls``
    (mode -> calls), ``recomputed`` (layer key -> calls made while autograd ran a backward).
    """

    def __init__(self, *, original: Callable, match: Any, ctx: Any) -> None:
        self.original = original
        self.match = match
        self.ctx = ctx
        self._removed = False
        self._every_thread: list = []
        self._threads = _PerThread(self._every_thread)
        self.opaque_token = opaque.register_dispatcher(self)  # how torch.compile's opaque operator finds us
        self._sites: dict[tuple, CallSite] = {}
        # CallSite -> the mode of its last call in the current forward (one item store per call: atomic).
        self._forward: dict[CallSite, str] = {}
        self._lock = threading.Lock()  # for the readers, reset and the site table, never taken per call
        self._calls_before_reset = 0  # forward calls counted before the last reset (``total_calls``)
        self._warned_local = False  # "local" on a shard: warned once per patch (``run_mode``)
        self.entry = self._make_entry()

    # ------------------------------------------------------------------------------------------ the call
    def _make_entry(self) -> Callable:
        """The wrapper's handler: ``entry(<each role of codegen.ROLE_ORDER>, extra)`` (see the module docstring).
        A closure, not a method: what it reads on every call are cells, not attribute lookups. Removal needs no
        check here: ``removed = True`` drops every plan, and ``plan_and_run`` reads it."""
        dispatcher = self
        threads = self._threads
        forward = self._forward
        site_from_stack = self._site_from_stack
        plan_and_run = self.plan_and_run
        dynamo_compiling, export_flag, graph_task_id = _dynamo_compiling, _export_flag, _graph_task_id

        def entry(query, key, value, attention_mask, query_length, is_causal, dropout, position_ids, softmax_scale,
                  sliding_window, use_top_left_mask, softcap, deterministic, cu_seq_lens_q, cu_seq_lens_k,
                  max_length_q, max_length_k, target_dtype, implementation, block_table, k_cache, v_cache, extra):
            site = inputs = None
            if not (dynamo_compiling() or export_flag._is_compiling_flag):
                state = threads.state
                sink, paged = None, False
                if extra:
                    if state.bound is not None:
                        site = state.bound.get(extra.get("layer_idx"))
                    sink = extra.get("s_aux")
                    paged = "cache" in extra or "cache_seqlens" in extra
                if site is None:
                    site = site_from_stack(extra)
                inputs = (state.thread_mode.mode, dispatcher.ctx.version, id(position_ids), position_ids,
                          getattr(position_ids, "_version", None), query.shape, key.numel(), is_causal, softmax_scale,
                          sliding_window, type(sliding_window), softcap, dropout, attention_mask, cu_seq_lens_q,
                          cu_seq_lens_k, block_table, k_cache, v_cache, id(sink), sink, paged)  # INPUTS
                plan = site.plan
                if plan is not None and plan.inputs != inputs:
                    plan = site.plan_for(inputs)  # another configuration of this layer's, or None
                if plan is not None:
                    if graph_task_id() == -1:
                        forward[site] = "ring"
                        counts = state.ring
                    else:  # checkpointing re-runs a layer in backward: not a new forward
                        counts = state.recomputed
                    try:
                        counts[site] += 1
                    except KeyError:  # the site's first call on this thread (or since reset)
                        counts[site] = 1
                    if target_dtype is not None:
                        query, key, value = cast_to_target(target_dtype, query, key, value)
                    return plan.run(query, key, value, sink)
            return plan_and_run(site, (
                query, key, value, attention_mask, query_length, is_causal, dropout, position_ids, softmax_scale,
                sliding_window, use_top_left_mask, softcap, deterministic, cu_seq_lens_q, cu_seq_lens_k,
                max_length_q, max_length_k, target_dtype, implementation, block_table, k_cache, v_cache), extra, inputs)

        return entry

    @property
    def removed(self) -> bool:
        """True once the patch is removed: every call then runs the original function, uncounted."""
        return self._removed

    @removed.setter
    def removed(self, value: bool) -> None:
        self._removed = bool(value)
        if value:
            with self._lock:
                for site in self._sites.values():
                    site.forget()  # the entry runs no plan: its calls reach plan_and_run, which reads this

    def __call__(self, call: dict, extra: dict) -> torch.Tensor:
        """``entry`` with the arguments as ``{role: value}`` (roles not in ``call`` are not passed on)."""
        return self.entry(*codegen.role_args(call), extra)

    def plan_and_run(self, site: CallSite | None, values: tuple, extra: dict, inputs: tuple | None = None
                     ) -> torch.Tensor:
        """A call the site's plan does not compute as is: route it by the switch and count it; a ring call runs
        (and keeps) a plan (``run_ring``). ``values``: the roles in ``codegen.ROLE_ORDER``; ``site``: the call site
        and ``inputs`` the call's ``INPUTS`` (both None while compiling)."""
        call = codegen.role_call(self.match, values)
        if _is_compiling():
            # Dynamo cannot trace the ring (P2P, data-dependent checks): one opaque operator that runs the rest
            # at run time (hfpatch/attention/opaque.py).
            return opaque.compiled_call(self, call, extra)
        if self.removed:
            return self.call_original(call, extra)
        mode = _current_mode() if inputs is None else inputs[0]
        self._count(mode, site)
        if mode == "ring":
            return self.run_ring(site, call, extra, inputs)
        return self.run_mode(mode, call, extra)

    def run_ring(self, site: CallSite, call: dict, extra: dict, inputs: tuple | None) -> torch.Tensor:
        """Run a ring call by a new plan (``semantics.ring_plan``: every refusal, the step, the kernel's
        arguments); the site keeps it when it ran and ``sites.keeps`` allows (a call that raised keeps nothing)."""
        q, k, v = cast_to_target(call.get("target_dtype"), call["query"], call["key"], call["value"])
        sink = sink_of(extra, q)
        keep = inputs is not None and keeps(inputs)
        plan = semantics.ring_plan(call, extra, self.ctx, inputs=inputs if keep else None)
        out = plan.run(q, k, v, sink)
        if keep:
            site.keep(plan)
        return out

    def compiled_forward(self, call: dict, extra: dict) -> str:
        """Run-time part of a compiled call: the mode to run, counted like an eager call (the caller module is
        not on the stack in compiled code: the key is ``layer_idx``, or "<compiled>")."""
        if self.removed:
            return "original"
        mode = _current_mode()
        layer_idx = extra.get("layer_idx") if isinstance(extra, dict) else None
        self._count(mode, self._site((layer_idx if isinstance(layer_idx, int) else "<compiled>", None)))
        return mode

    def run_mode(self, mode: str, call: dict, extra: dict) -> torch.Tensor:
        """Route one call: ``"ring"``, ``"reference"``, ``"local"`` or ``"original"`` (no counting)."""
        if mode == "ring":
            return semantics.ring_attention(call, extra, self.ctx)
        if mode == "reference":
            return whole.reference_attention(call, extra, self.ctx)
        if mode == "local":
            if not self._warned_local:
                self._warn_local_on_shard(call)
            return whole.local_attention(call, extra, self.ctx)
        return self.run_original(call, extra)

    def run_original(self, call: dict, extra: dict) -> torch.Tensor:
        """Switch mode ``"original"``: what the model's own attention computes on this call's (local) tensors.
        Transformers' original function where its flash path can run (``original_runs``) or the patch is removed
        (what the restored binding sites call); else
        ``whole.local_attention``: the SDPA/eager result on these tensors (causal or not, window, softcap,
        scale, GQA, sinks, documents from ``cu_seq_lens``/``position_ids``). Something plain attention cannot honour
        there (a padding mask, dropout, a KV cache) raises ``UnsupportedArgument`` with its fix, never
        transformers' ImportError. q (B, S, H, D), k/v (B, S, Hk, D) -> (B, S, H, D)."""
        if self._removed or self.original_runs(call):
            return self.call_original(call, extra)
        try:
            return whole.local_attention(call, extra, self.ctx)
        except UnsupportedArgument as exc:
            raise UnsupportedArgument(
                exc.parameter, exc.value,
                "switch mode 'original' computes the model's own attention in plain math here, transformers' flash "
                f"path being unable to run (flash-attn is not installed, or the query is on CPU): {exc.reason}",
                f"{exc.fix + ' Or: ' if exc.fix else ''}install flash-attn on a CUDA machine to run transformers' "
                "own function.",
            ) from exc

    def original_runs(self, call: dict) -> bool:
        """Whether transformers' original function can run this call: its flash path loads
        (``whole.flash_path_runs`` of the call's implementation, read once per process) and the query is not on
        CPU (flash-attn has no CPU kernel)."""
        return not call["query"].is_cpu and whole.flash_path_runs(call.get("implementation"))

    def call_original(self, call: dict, extra: dict) -> torch.Tensor:
        """Re-call the original transformers function with this call's arguments, by parameter name."""
        return self.original(**codegen.original_kwargs(self.match, call, extra))

    @contextlib.contextmanager
    def using(self, ctx: RingContext) -> Iterator[RingContext]:
        """Every call made inside runs on ``ctx`` (the whole-model probe's context, made by
        ``dataclasses.replace`` of this one); the previous context is back afterwards."""
        previous, self.ctx = self.ctx, ctx
        try:
            yield ctx
        finally:
            self.ctx = previous

    def _warn_local_on_shard(self, call: dict) -> None:
        """Warn (once per patch) when a ``"local"`` call's query is this rank's shard of the current step: its
        length is the step's local length and shorter than the global one. A whole sequence (the whole-model probe,
        the model sweep, no step) is what ``"local"`` is for: no warning."""
        step = self.ctx.step
        if step is None or step.seq_len_local >= step.seq_len_global or call["query"].shape[1] != step.seq_len_local:
            return
        self._warned_local = True
        logger.warning(
            "hfpatch: switch mode 'local' runs attention within this rank's shard only (%d of %d tokens): not the "
            "non-CP computation. For an A/B against the ring on identical inputs use 'reference'; for the model's "
            "own attention on the local tensors, 'original'. (Logged once per patch.)",
            step.seq_len_local, step.seq_len_global)

    # ------------------------------------------------------------------------------------- call sites
    def _site(self, slot: tuple) -> CallSite:
        site = self._sites.get(slot)
        if site is None:
            with self._lock:
                if len(self._sites) >= _MAX_SITES:
                    self._sites.clear()
                site = self._sites.setdefault(slot, CallSite(*slot))
        return site

    def _site_from_stack(self, extra: dict) -> CallSite:
        """The site of the module found on the stack, from the wrapper's caller up (depth 4: ``calling_module``,
        this frame, ``entry``, the wrapper): transformers' ``flash_attention_forward(module, ...)`` on 4.48+."""
        module = calling_module(4)
        layer_idx = extra.get("layer_idx") if extra else None
        if layer_idx is None and module is not None:
            layer_idx = getattr(module, "layer_idx", None)
        if type(layer_idx) is int:
            site = self._sites.get((layer_idx, None if module is None else id(module)))
            if site is not None:
                return site
        return self._site(site_key(layer_idx, module))

    def track(self, model: torch.nn.Module) -> UndoStack:
        """Make each forward of ``model`` a new "last forward" (``begin_forward``) and a step boundary of the switch
        (``modes.refresh_from_env``: a flipped ``RING_ATTN_SWITCH`` takes effect), and bind its attention modules'
        sites by ``layer_idx`` for the calls made while that forward runs on this thread (an index shared by two
        of its attention modules is left to the stack). Returns both hooks as one ``UndoStack`` (``remove()``)."""
        by_index: dict = {}
        for _name, module in attention_modules(model):
            index = getattr(module, "layer_idx", None)
            if type(index) is int:
                by_index.setdefault(index, []).append(module)
        sites = {index: self._site((index, id(found[0]))) for index, found in by_index.items() if len(found) == 1}
        threads = self._threads

        def begin(module, args):
            if _is_compiling():
                return  # compiled calls keep one record per layer and are counted by layer_idx (hfpatch/attention/opaque.py)
            _refresh_switch()  # a step boundary: RING_ATTN_SWITCH, flipped since the last one, takes effect
            self.begin_forward()
            state = threads.state
            state.outer_bound.append(state.bound)
            state.bound = sites

        def end(module, args, output):
            state = threads.state
            if _is_compiling() or not state.outer_bound:
                return
            state.bound = state.outer_bound.pop()

        return UndoStack(f"the forward tracking of {type(model).__name__}", model.register_forward_pre_hook(begin),
                         model.register_forward_hook(end, always_call=True))

    # ------------------------------------------------------------------------------------- counting
    def _count(self, mode: str, site: CallSite) -> None:
        # Two modules with the same layer index (an encoder and a decoder) are two sites: they stay apart.
        state = self._threads.state
        if _graph_task_id() != -1:  # checkpointing re-runs a layer in backward: not a new forward
            counts = state.recomputed
        else:
            by_kind = state.by_kind
            counts = by_kind.get(mode)
            if counts is None:
                counts = by_kind[mode] = {}  # dict item store: atomic; only this thread writes by_kind
            self._forward[site] = mode
        counts[site] = counts.get(site, 0) + 1

    def _tally(self, want: Callable[[str], bool]) -> Counter:
        """layer key -> calls of the kinds ``want`` accepts, summed over every thread's counts."""
        out: Counter = Counter()
        for kind, counts in self._snapshot():
            if want(kind):
                for site, n in counts.items():
                    out[site.key] += n
        return out

    def _snapshot(self) -> list:
        """[(kind, {site: calls})] of every thread, copied (``dict()`` copies in C: no torn reads)."""
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
            return  # a lock cannot be traced; compiled calls keep one record per layer (hfpatch/attention/opaque.py)
        with self._lock:
            self._forward.clear()

    def reset(self) -> None:
        """Clear every counter and the per-forward record (``total_calls`` keeps counting)."""
        with self._lock:
            for kind, counts in [(kind, counts) for by_kind in self._every_thread for kind, counts in by_kind.items()]:
                if kind != _RECOMPUTED:
                    self._calls_before_reset += sum(counts.values())
                counts.clear()  # the dicts themselves stay: the entry holds the thread's ring/recomputed
            self._forward.clear()

    def total_calls(self) -> int:
        """Every forward call the wrappers made, in any mode, over the patch's life (``reset`` does not clear it;
        recomputations excluded): what ``hfpatch.model.reach`` compares between two step boundaries."""
        return self._calls_before_reset + sum(self.mode_calls.values())

    def forward_records(self) -> list[LayerRecord]:
        """The calls of the current forward (since the last ``begin_forward``/``reset``), one per site."""
        with self._lock:
            forward = dict(self._forward)
        return [LayerRecord(site.key, site.module_id, mode) for site, mode in forward.items()]
