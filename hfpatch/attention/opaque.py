"""The attention call as ONE opaque operator for ``torch.compile``: ``torch.ops.hfpatch.flash_attention``.

Why: under ``torch.compile`` Dynamo traces the generated wrapper and the dispatcher. The ring itself (P2P
``batch_isend_irecv``, collectives, Python planning over documents, data-dependent checks such as "is this mask
all ones") cannot be traced, so without this module every attention layer is a graph break and
``fullgraph=True`` fails. Here the whole routed call (switch mode -> ring / reference / original, with every
refusal and the step's layout) runs inside a ``torch.library.custom_op``: the compiler sees one operator with a
fake (meta) implementation, and autograd through ``register_autograd``.

How a compiled call reaches the ring (``Dispatcher.__call__`` -> ``compiled_call`` while compiling):

    call/extra (role -> value)  ──split──>  tensors: list[Tensor]   (q, k, v, masks, position ids, ...)
                                            ints:    list[SymInt]   (query_length, layer_idx, ...; may be symbolic)
                                            spec_id: int            (everything else, interned: causal, scale,
                                                                     window, softcap, dtype, names, None ...)
    torch.ops.hfpatch.flash_attention(tensors, ints, dispatcher_token, spec_id) -> (out, mode_code)

At run time the operator rebuilds ``call``/``extra`` and runs exactly what the eager dispatcher runs (the mode is
read per call; the step state ``ctx.step`` that ``shard_inputs`` recorded is read per call too, so one compiled
graph serves every step). ``mode_code`` records which mode ran, so that the backward uses the same one.

Backward (``torch.ops.hfpatch.flash_attention_backward``): the public ring kernels are autograd Functions that keep
their own saved state, which cannot cross the operator boundary. The backward operator therefore recomputes the
forward of this call with autograd enabled and differentiates it: exact, and equal to the eager gradients, at the
cost of one more attention forward per layer in backward (the compiled path only; eager runs the kernels' own
backward). Gradients flow to query, key and value; the other tensor arguments (masks, position ids, cu_seq_lens)
are integer or boolean metadata and get none.

Layer accounting under compile: the calling module cannot be found on the stack (compiled code has no frames
per module), so compiled calls are counted under ``layer_idx`` (passed by transformers >= 4.54) or
``"<compiled>"``; ``Patch.unpatched_layers`` matches them by the modules' ``layer_idx``. The forward pre-hook of
a tracked model does not reset the per-forward record inside a compiled region (it would be a graph break).

The operators' signatures carry real annotations, not strings (no ``from __future__ import annotations`` here):
``torch.library.custom_op`` infers the schema from them, and before torch 2.7 it cannot read string annotations.
Nothing that Dynamo traces calls ``hash``: the Dynamo of torch 2.7 to 2.12 cannot trace ``hash`` of a tuple, so the
constants are checked inside ``_intern``, which runs once, untraced (``assume_constant_result``).
"""
import itertools
import threading
import weakref
from typing import Any, List, Mapping, Tuple

import torch

from hfpatch.errors import KeepAttentionError, PatchError
from hfpatch.modes import MODES
from ring_kernels.checkpointing import current_region

__all__ = ["OP_NAME", "BACKWARD_OP_NAME", "register_dispatcher", "compiled_call", "is_recomputing"]

OP_NAME = "hfpatch::flash_attention"
BACKWARD_OP_NAME = "hfpatch::flash_attention_backward"

_TENSOR, _INT, _CONST = "tensor", "int", "const"

# Dispatchers by token: the operator's schema can only carry numbers, so the dispatcher travels as a token.
# Weak values: a removed, dropped patch does not stay alive because a compiled graph once referred to it.
_dispatchers: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_tokens = itertools.count(1)
# Interned specs: spec -> id and id -> spec. A spec is a tuple of constants, so a model has a handful (one per
# distinct layer configuration), and the table never grows per step.
_spec_ids: dict = {}
_specs: List[tuple] = []
_lock = threading.Lock()


def register_dispatcher(dispatcher: Any) -> int:
    """A token under which the operator finds ``dispatcher`` at run time (called once per ``Dispatcher``)."""
    token = next(_tokens)
    _dispatchers[token] = dispatcher
    return token


def is_recomputing() -> bool:
    """True while the autograd engine is running a backward on this thread: a forward that runs now is a
    recomputation (activation checkpointing, or this module's backward), not a new forward of the model."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


# ------------------------------------------------------------------------------------------- tracing side


@torch.compiler.assume_constant_result
def _intern(spec: tuple) -> int:
    """The id of ``spec`` (a tuple of constants); evaluated once while tracing, a constant in the graph. A constant
    that cannot be hashed raises ``PatchError`` naming it."""
    try:
        hash(spec)
    except TypeError as exc:
        unhashable = [(name, type(value).__name__) for _, name, kind, value in spec if kind == _CONST
                      and not _hashable(value)]
        raise PatchError(
            f"hfpatch cannot compile this attention call: the arguments {unhashable} are neither tensors, ints nor "
            "hashable constants, so they cannot be baked into the compiled graph. Fix: run this model without "
            "torch.compile, or open an issue with the transformers release and model."
        ) from exc
    with _lock:
        found = _spec_ids.get(spec)
        if found is None:
            found = _spec_ids[spec] = len(_specs)
            _specs.append(spec)
        return found


def _split(call: Mapping[str, Any], extra: Mapping[str, Any]) -> Tuple[list, list, tuple]:
    """(tensors, ints, spec): the arguments as the operator's schema can carry them (see the module docstring)."""
    tensors, ints, spec = [], [], []
    for section, mapping in (("call", call), ("extra", extra)):
        for name, value in mapping.items():
            if isinstance(value, torch.Tensor):
                spec.append((section, name, _TENSOR, len(tensors)))
                tensors.append(value)
            elif isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
                # Ints travel as SymInt: a sequence length stays symbolic under dynamic shapes.
                spec.append((section, name, _INT, len(ints)))
                ints.append(value)
            else:
                spec.append((section, name, _CONST, value))
    return tensors, ints, tuple(spec)


def compiled_call(dispatcher: Any, call: Mapping[str, Any], extra: Mapping[str, Any]) -> torch.Tensor:
    """What ``Dispatcher.__call__`` does while Dynamo traces it: one opaque operator. Returns (B, S_local, H, D)."""
    tensors, ints, spec = _split(call, extra or {})
    out, _mode = torch.ops.hfpatch.flash_attention(tensors, ints, dispatcher.opaque_token, _intern(spec))
    return out


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# ------------------------------------------------------------------------------------------ run-time side


def _rebuild(tensors: List[torch.Tensor], ints: List[int], spec_id: int) -> Tuple[dict, dict]:
    """``call`` and ``extra`` of the traced call, with this run's tensors and ints."""
    call: dict = {}
    extra: dict = {}
    for section, name, kind, value in _specs[spec_id]:
        if kind == _TENSOR:
            value = tensors[value]
        elif kind == _INT:
            value = int(ints[value])
        (call if section == "call" else extra)[name] = value
    return call, extra


def _dispatcher(token: int) -> Any:
    found = _dispatchers.get(token)
    if found is None:
        raise PatchError(
            "a compiled model called hfpatch's attention operator for a patch that no longer exists (removed and "
            "garbage-collected). Fix: compile the model again after hfpatch.apply (torch._dynamo.reset())."
        )
    return found


def _call_tensor_index(spec_id: int) -> dict:
    """role -> position in ``tensors`` of the call's tensor arguments."""
    return {name: value for section, name, kind, value in _specs[spec_id] if section == "call" and kind == _TENSOR}


def _private_output(out: torch.Tensor, inputs: List[torch.Tensor]) -> torch.Tensor:
    """``out`` contiguous and sharing no storage with an input (a custom operator's output may not alias)."""
    out = out.contiguous()
    storage = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in inputs):
        out = out.clone()
    return out


@torch.library.custom_op(OP_NAME, mutates_args=())
def _flash_attention(tensors: List[torch.Tensor], ints: List[int], token: int,
                     spec_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run the routed attention call; returns (out (B, S_local, H, D) in the query's dtype, mode_code int64 ())."""
    if current_region() is not None:
        raise KeepAttentionError(
            "hfpatch.keep_attention does not apply to a compiled model: the compiled attention operator "
            "recomputes its forward in its own backward, so outputs kept through checkpointing would only cost "
            "memory. Fix: remove keep_attention (kept.remove()) when compiling, or train without torch.compile.")
    dispatcher = _dispatcher(token)
    call, extra = _rebuild(tensors, ints, spec_id)
    mode = dispatcher.compiled_forward(call, extra)
    with _autograd_enabled(False):
        out = dispatcher.run_mode(mode, call, extra)
    out = _private_output(out.to(call["query"].dtype), tensors)
    return out, torch.tensor(MODES.index(mode), dtype=torch.int64, device=out.device)


@_flash_attention.register_fake
def _flash_attention_fake(tensors, ints, token, spec_id):
    index = _call_tensor_index(spec_id)
    q, v = tensors[index["query"]], tensors[index["value"]]
    # (B, S_local, H, D_v): flash attention's output has the query's heads and the value's head dim.
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((), dtype=torch.int64)


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=())
def _flash_attention_backward(grad_out: torch.Tensor, tensors: List[torch.Tensor], ints: List[int], token: int,
                              spec_id: int, mode_code: torch.Tensor) -> List[torch.Tensor]:
    """Recompute the call in the mode the forward ran and differentiate it: [dq, dk, dv], shaped like q, k, v."""
    dispatcher = _dispatcher(token)
    call, extra = _rebuild(tensors, ints, spec_id)
    mode = MODES[int(mode_code)]
    leaves = {role: call[role].detach().requires_grad_() for role in ("query", "key", "value")}
    call.update(leaves)
    with _autograd_enabled(True):
        out = dispatcher.run_mode(mode, call, extra)
        grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype), allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g.to(leaf.dtype).contiguous()
            for leaf, g in zip(leaves.values(), grads)]


@_flash_attention_backward.register_fake
def _flash_attention_backward_fake(grad_out, tensors, ints, token, spec_id, mode_code):
    index = _call_tensor_index(spec_id)
    return [tensors[index[role]].new_empty(tensors[index[role]].shape) for role in ("query", "key", "value")]


def _setup_context(ctx, inputs, output) -> None:
    tensors, ints, token, spec_id = inputs
    ctx.save_for_backward(*tensors, output[1])
    ctx.ints, ctx.token, ctx.spec_id = ints, token, spec_id


def _backward(ctx, grad_out, _grad_mode):
    *tensors, mode_code = ctx.saved_tensors
    dq, dk, dv = torch.ops.hfpatch.flash_attention_backward(grad_out, tensors, ctx.ints, ctx.token, ctx.spec_id,
                                                            mode_code)
    index = _call_tensor_index(ctx.spec_id)
    grads: List[Any] = [None] * len(tensors)
    grads[index["query"]], grads[index["key"]], grads[index["value"]] = dq, dk, dv
    return grads, None, None, None


_flash_attention.register_autograd(_backward, setup_context=_setup_context)


# The dispatch keys excluded outside any operator: inside a custom operator's implementation the autograd keys are
# excluded (it runs "below autograd"); the backward operator must build a graph to differentiate the recomputation.
_DEFAULT_EXCLUDED_KEYS = torch._C._dispatch_tls_local_exclude_set()


class _autograd_enabled:
    """Inside an operator implementation: ``True`` -> autograd dispatch and grad mode on (to differentiate the
    recomputed call); ``False`` -> grad mode off (the forward operator keeps no graph)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self):
        self._grad = torch.set_grad_enabled(self.enabled)
        self._grad.__enter__()
        self._keys = None
        if self.enabled:
            self._keys = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                                          _DEFAULT_EXCLUDED_KEYS)
            self._keys.__enter__()
        return self

    def __exit__(self, *exc):
        if self._keys is not None:
            self._keys.__exit__(*exc)
        self._grad.__exit__(*exc)
        return False
