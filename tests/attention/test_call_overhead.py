"""The one call path -- ``Dispatcher.entry`` runs a call site's kept ``plan.RingPlan`` when the call's inputs equal
the plan's, and plans every other call -- keeps every behaviour; and its cost stays within budget.

What the path keeps, and what each test proves it never reuses stale:

- ``RingPlan`` (kernel name + kwargs), built by ``ring_plan`` for one call and kept by the dispatcher with the call's
  inputs (``dispatch.INPUTS``): a new step, a changed keyword, a changed context field (backend, heads_k_stride;
  ``RingContext.version``) and a changed shape (a derived step has the global length in it) each give the kernel
  the arguments of a fresh run.
- derived ``StepState`` per step: a modified position_ids tensor (same object, new version) is derived again.
- every refusal still runs on every call after a plan is kept; the switch is read on every call.
- counting without a lock: exact over threads (tests/attention/test_switch.py), recomputations kept apart, one
record per
  module even when two modules share a layer index, ``calling_module`` skips frames whose code cannot hold it.
- the rendered wrapper passes every role by position (for every registry entry, the values a role dict would hold);
  a site's plan is reused only for a call it computes (position_ids identity and version, shape, configuration,
  context version, sinks); the refusals, the switch, removal, per-module counting and recomputation counting hold
  when a site has a plan; the kernel runs inside the step's rank-check scope, which ends with the call.
- a model given to ``track`` binds its layers' sites by ``layer_idx`` only while its own forward runs on this
  thread: another model's calls with the same indices are recorded under their own modules.
- ``ring_kernels.RANK_CHECKED`` (public; what ``RingPlan.run`` sets) is the variable ``rank_check_scope`` sets and
  ``check_ranks_agree`` reads.

The benchmark ``benchmarks/patched_call_overhead.py`` runs once at tiny counts so that it cannot rot, and the
budget test measures hfpatch's added time per call against the direct kernel call in the same run.
Kernels are replaced by recorders: single process, no collectives.
"""
from __future__ import annotations

import dataclasses
import inspect

import sys

import pytest
import torch
import torch.distributed as dist

from _paths import BENCHMARKS
import hfpatch
import ring_kernels
from hfpatch.attention import codegen, dispatch, plan, semantics, step as step_stage
from hfpatch.signatures import registry
from ring_kernels import validation as rk_validation
from hfpatch.errors import UnsupportedArgument
from hfpatch.attention.context import RingContext, StepState
from hfpatch.attention.semantics import ring_attention
from test_semantics import hf_call

_BENCH = str(BENCHMARKS)
_KERNELS = ("ring_attn_func", "zigzag_ring_attn_func", "stripe_attn_func", "ring_attn_varlen_func",
            "zigzag_ring_attn_varlen_func", "llama3_attn_varlen_func")


class _Kernels:
    """The ring kernels (``hfpatch.attention.plan.KERNELS``) replaced by recorders of (name, args, kwargs); each
    returns its query."""

    def __init__(self, monkeypatch):
        self.seen = []
        for name in _KERNELS:
            monkeypatch.setitem(plan.KERNELS, name, self._recorder(name))

    def _recorder(self, name):
        def kernel(q, *args, **kwargs):
            self.seen.append((name, (q,) + args, kwargs))
            return q * 1.0  # a new tensor, differentiable like the real kernels' outputs
        return kernel

    def last(self):
        return self.seen[-1]


@pytest.fixture
def kernels(monkeypatch):
    return _Kernels(monkeypatch)


def _qkv(batch=1, seq=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, seq, 4, 8, generator=g).to(dtype) for _ in range(3))


def _world_of_one_cu(monkeypatch):
    """Derive packing without a collective (world of one): the all-gather of one rank is the identity."""
    monkeypatch.setattr(step_stage, "global_cu_from_position_ids",
                        lambda p, seq_local, ctx: step_stage.packed_cu_seqlens(p.reshape(-1)))


# ------------------------------------------------------------------------------------------- the plan cache

# The local position ids a packed shard_inputs step hands the model (a step built here records none to compare with:
# the attention call must only carry some, as the model's own calls do).
_PACKED_POSITIONS = torch.arange(8)[None]


def test_a_new_step_never_reuses_the_previous_steps_plan(kernels):
    ctx = RingContext(rank=0, world_size=2)
    q, k, v = _qkv(seq=8)
    ctx.set_step(StepState(kernel="zigzag", layout="zigzag", packed=False, batch_size=1, seq_len_global=16,
                           seq_len_local=8))
    ring_attention(hf_call(q, k, v), {}, ctx)
    assert kernels.last()[0] == "zigzag_ring_attn_func"
    # Same shapes, new step objects: each one's own kernel and document boundaries, never the cached ones.
    for cu in ([0, 5, 16], [0, 9, 12, 16]):
        cu = torch.tensor(cu, dtype=torch.int32)
        ctx.set_step(StepState(kernel="llama3", layout="contiguous", packed=True, batch_size=1, seq_len_global=16,
                               seq_len_local=8, cu_seqlens=cu))
        out = ring_attention(hf_call(q, k, v, position_ids=_PACKED_POSITIONS), {}, ctx)
        name, args, kwargs = kernels.last()
        assert name == "llama3_attn_varlen_func" and torch.equal(args[3], cu) and args[0] is q  # the packed row as is
        assert out.shape == q.shape
    ctx.set_step(StepState(kernel="stripe", layout="stripe", packed=False, batch_size=1, seq_len_global=16,
                           seq_len_local=8))
    ring_attention(hf_call(q, k, v), {}, ctx)
    assert kernels.last()[0] == "stripe_attn_func"


def test_each_call_configuration_gets_its_own_kwargs(kernels):
    """Alternating layer configurations (e.g. sliding and global layers) in one step: each call's kwargs are
    those of an uncached run with its own arguments."""
    ctx = RingContext(rank=0, world_size=1)
    q, k, v = _qkv(seq=16)
    configs = [
        dict(causal=True, scale=None, window=None, softcap=None),
        dict(causal=True, scale=0.5, window=None, softcap=None),
        dict(causal=True, scale=0.5, window=4, softcap=None),
        dict(causal=True, scale=0.5, window=4, softcap=30.0),
        dict(causal=False, scale=None, window=None, softcap=None),
    ]
    seen = {}
    for _round in range(2):  # the second round hits the cached plans
        for i, cfg in enumerate(configs):
            ring_attention(hf_call(q, k, v, **cfg), {}, ctx)
            name, _args, kwargs = kernels.last()
            want_window = (-1, -1) if cfg["window"] is None else plan.window_size_of(cfg["window"], 16)
            assert kwargs["causal"] is cfg["causal"] and kwargs["softmax_scale"] == cfg["scale"]
            assert kwargs["window_size"] == want_window and kwargs["softcap"] == (cfg["softcap"] or 0.0)
            assert name == "ring_attn_func"  # derived batch step: contiguous ring
            seen.setdefault(i, []).append(kwargs)
    assert all(first == again for first, again in seen.values())
    assert len({repr(kw[0]) for kw in seen.values()}) == len(configs)


def test_a_changed_context_field_drops_the_plans(kernels):
    ctx = RingContext(rank=0, world_size=2)
    q, k, v = _qkv(seq=8)
    step = StepState(kernel="llama3", layout="contiguous", packed=True, batch_size=1, seq_len_global=16,
                     seq_len_local=8, cu_seqlens=torch.tensor([0, 7, 16], dtype=torch.int32))
    ctx.set_step(step)
    pos = _PACKED_POSITIONS
    ring_attention(hf_call(q, k, v, position_ids=pos), {}, ctx)
    assert kernels.last()[2]["backend"] == "auto" and kernels.last()[2]["heads_k_stride"] is None
    changed = dataclasses.replace(ctx, heads_k_stride=1)  # what hfpatch.dropin asks for after apply
    assert changed.version != ctx.version and changed.step is None  # its own step: none yet
    changed.set_step(step)
    ring_attention(hf_call(q, k, v, position_ids=pos), {}, changed)
    assert kernels.last()[2]["heads_k_stride"] == 1
    changed = dataclasses.replace(changed, backend="reference")
    changed.set_step(step)
    ring_attention(hf_call(q, k, v, position_ids=pos), {}, changed)
    assert kernels.last()[2]["backend"] == "reference"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.backend = "reference"  # a context is changed by replacing it, never in place


def test_a_changed_shape_or_dtype_is_derived_again(kernels):
    ctx = RingContext(rank=0, world_size=2)
    for seq, dtype in ((8, torch.float32), (8, torch.bfloat16), (2, torch.bfloat16), (8, torch.float32)):
        q, k, v = _qkv(seq=seq, dtype=dtype)
        # sliding_window 10: no window on a 4-token global sequence, a window on a 16-token one.
        out = ring_attention(hf_call(q, k, v, window=10), {}, ctx)
        _name, args, kwargs = kernels.last()
        assert args[0] is q and out.dtype == dtype and out.shape == q.shape
        assert kwargs["window_size"] == plan.window_size_of(10, 2 * seq)
        assert (kwargs["window_size"] == (-1, -1)) == (2 * seq <= 10)


def test_a_shard_inputs_step_refuses_other_shapes_after_a_cached_call(kernels):
    ctx = RingContext(rank=0, world_size=2)
    ctx.set_step(StepState(kernel="zigzag", layout="zigzag", packed=False, batch_size=1, seq_len_global=16,
                           seq_len_local=8))
    ring_attention(hf_call(*_qkv(seq=8)), {}, ctx)
    for _ in range(2):
        with pytest.raises(UnsupportedArgument, match="shard_inputs prepared this step"):
            ring_attention(hf_call(*_qkv(seq=4)), {}, ctx)


def test_position_ids_modified_in_place_are_derived_again(kernels, monkeypatch):
    _world_of_one_cu(monkeypatch)
    ctx = RingContext(rank=0, world_size=1)
    q, k, v = _qkv(seq=8)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    for _layer in range(2):
        ring_attention(hf_call(q, k, v, position_ids=pos), {}, ctx)
        assert kernels.last()[0] == "llama3_attn_varlen_func"
        assert kernels.last()[1][3].tolist() == [0, 3, 8]
    pos.copy_(torch.arange(8)[None])  # same object, new contents: one sequence now
    ring_attention(hf_call(q, k, v, position_ids=pos), {}, ctx)
    assert kernels.last()[0] == "ring_attn_func"
    pos.copy_(torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]]))
    ring_attention(hf_call(q, k, v, position_ids=pos), {}, ctx)
    assert kernels.last()[1][3].tolist() == [0, 2, 8]


@pytest.mark.parametrize("bad, match", [
    (dict(dropout=0.1), "dropout"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])), "padding mask"),
    (dict(block_table=torch.zeros(1, 1)), "paged KV cache"),
    (dict(softcap=-1.0), "softcap"),
    (dict(sliding_window=True), "sliding_window"),
    (dict(window=True), "sliding_window"),
])
def test_refusals_still_run_after_a_cached_plan(kernels, bad, match):
    ctx = RingContext(rank=0, world_size=1)
    q, k, v = _qkv(seq=8)
    ring_attention(hf_call(q, k, v, window=1), {}, ctx)  # plans cached for window=1 (True == 1 as a dict key)
    ring_attention(hf_call(q, k, v), {}, ctx)
    with pytest.raises(UnsupportedArgument, match=match):
        ring_attention(hf_call(q, k, v, **bad), {}, ctx)


def test_extra_kwargs_and_kv_cache_refused_after_a_cached_plan(kernels):
    ctx = RingContext(rank=0, world_size=1)
    q, k, v = _qkv(seq=8)
    ring_attention(hf_call(q, k, v), {"layer_idx": 0, "s_aux": None}, ctx)
    for extra, match in (({"s_aux": torch.zeros(3)}, "attention sinks have shape"), ({"cache": object()}, "KV cache"),
                         ({"cache_seqlens": torch.zeros(1)}, "KV cache")):
        with pytest.raises(UnsupportedArgument, match=match):
            ring_attention(hf_call(q, k, v), extra, ctx)
    longer_k = torch.randn(1, 12, 4, 8)
    with pytest.raises(UnsupportedArgument, match="KV cache"):
        ring_attention(hf_call(q, longer_k, longer_k), {}, ctx)
    ones = torch.ones(1, 8, dtype=torch.long)
    ring_attention(hf_call(q, k, v, attention_mask=ones), {}, ctx)  # all ones: accepted, as before


# ---------------------------------------------------------------------------------------- the dispatcher


class _Attention(torch.nn.Module):
    def __init__(self, layer_idx=None):
        super().__init__()
        if layer_idx is not None:
            self.layer_idx = layer_idx


def _integration(module, dispatcher, call, extra):
    """Stands in for transformers' flash_attention_forward(module, ...): ``module`` is a local of this frame."""
    return _wrapper(dispatcher, call, extra)


def _wrapper(dispatcher, call, extra):  # the generated wrapper's frame (holds no module)
    return dispatcher(call, extra)


def _dispatcher(ctx):
    import transformers.modeling_flash_attention_utils as mfau

    match = registry.require(inspect.signature(mfau._flash_attention_forward))
    originals = []
    d = dispatch.Dispatcher(original=lambda **kw: originals.append(kw) or kw["query_states"] * 3.0, match=match,
                            ctx=ctx)
    d.original_runs = lambda call: True  # the recorder stands in for a flash path that runs here
    return d, originals


def test_the_switch_is_read_on_every_call_of_a_cached_plan(kernels):
    ctx = RingContext(rank=0, world_size=1)
    d, originals = _dispatcher(ctx)
    module = _Attention(layer_idx=0)
    q, k, v = _qkv(seq=8)
    call = hf_call(q, k, v)
    _integration(module, d, call, {})
    with hfpatch.switch("original"):
        assert torch.equal(_integration(module, d, call, {}), q * 3.0)
    _integration(module, d, call, {})
    assert len(kernels.seen) == 2 and len(originals) == 1
    assert d.mode_calls == {"ring": 2, "original": 1} and d.calls == {0: 2}
    assert [(r.key, r.module_id, r.mode) for r in d.forward_records()] == [(0, id(module), "ring")]


def test_two_modules_with_one_layer_index_are_recorded_apart(kernels):
    d, _ = _dispatcher(RingContext(rank=0, world_size=1))
    encoder, decoder, unnamed = _Attention(layer_idx=0), _Attention(layer_idx=0), _Attention()
    call = hf_call(*_qkv(seq=8))
    for module in (encoder, decoder, unnamed):
        _integration(module, d, call, {})
    records = {(r.key, r.module_id) for r in d.forward_records()}
    assert records == {(0, id(encoder)), (0, id(decoder)), (f"_Attention@{id(unnamed):x}", id(unnamed))}
    assert d.calls[0] == 2
    d.begin_forward()
    assert d.forward_records() == [] and d.calls[0] == 2  # a new forward keeps the patch's life counts
    _integration(decoder, d, call, {"layer_idx": 5})  # layer_idx passed by transformers wins
    assert [(r.key, r.module_id) for r in d.forward_records()] == [(5, id(decoder))]
    d.reset()
    assert d.calls == {} and d.mode_calls == {} and d.forward_records() == []


def test_calling_module_reads_only_frames_that_can_hold_it():
    attention = _Attention(layer_idx=3)  # not called `module`: this frame must not hold one

    def inner():  # depth 0 is calling_module itself: start at this frame
        return dispatch.calling_module(depth=1)

    def not_a_module_local(module):  # a local named `module` that is not an nn.Module is skipped
        return inner()

    def holder(self):
        return not_a_module_local("a string called module")

    def closure_holder(module):
        def nested():  # `module` is a free variable of this frame: found too
            return module, inner()
        return nested()[1]

    assert holder(attention) is attention
    assert closure_holder(attention) is attention
    assert dispatch.calling_module(depth=1) is None  # nothing on this test's stack holds a module


def test_recomputation_is_counted_apart(monkeypatch):
    """Activation checkpointing re-runs a layer in backward: counted under ``recomputed``, not as a forward."""
    from torch.utils.checkpoint import checkpoint

    # q * q saves q for backward: the checkpoint recomputes the layer to get it back.
    for name in plan.KERNELS:
        monkeypatch.setitem(plan.KERNELS, name, lambda q, *args, **kwargs: q * q)
    d, _ = _dispatcher(RingContext(rank=0, world_size=1))
    module = _Attention(layer_idx=7)
    q, k, v = _qkv(seq=8)
    q.requires_grad_(True)

    def layer(q):
        return _integration(module, d, hf_call(q, k, v), {})

    checkpoint(layer, q, use_reentrant=False).sum().backward()
    assert d.calls == {7: 1} and d.recomputed == {7: 1} and d.mode_calls == {"ring": 1}
    assert torch.equal(q.grad, 2 * q.detach())


# ------------------------------------------------------------------ the rendered wrapper and the call sites
#
# The installed wrapper passes every role by position to ``Dispatcher.entry``, which runs the call site's cached
# plan when the call is one it computes and plans every other call (``plan_and_run``). These tests call a wrapper
# rendered for the LIVE signature (the tox matrix runs them on every release) from a frame shaped like
# transformers' flash_attention_forward(module, ...).


def _live_match():
    import transformers.modeling_flash_attention_utils as mfau

    return registry.require(inspect.signature(mfau._flash_attention_forward))


class _Spy:
    """Counts the calls that reach the dispatcher's entry and those it planned (``plan_and_run``); ``fast``: the
    calls a site's cached plan ran."""

    def __init__(self, monkeypatch):
        self.entered = 0
        self.slow = 0
        planned = dispatch.Dispatcher.plan_and_run

        def counting_plan_and_run(d, *args):
            self.slow += 1
            return planned(d, *args)

        monkeypatch.setattr(dispatch.Dispatcher, "plan_and_run", counting_plan_and_run)

    def around(self, entry):
        def counting_entry(*values):
            self.entered += 1
            return entry(*values)
        return counting_entry

    @property
    def fast(self):
        return self.entered - self.slow


def _rendered(ctx, monkeypatch):
    """(wrapper, dispatcher, originals, spy): a wrapper rendered for the live signature around a Dispatcher."""
    spy = _Spy(monkeypatch)
    d, originals = _dispatcher(ctx)
    wrapper = codegen.render(_live_match(), spy.around(d.entry))
    return wrapper, d, originals, spy


def _hf_kwargs(wrapper, **given):
    """Keywords as transformers' integration passes them, limited to what the live signature accepts."""
    params = inspect.signature(wrapper).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {name: value for name, value in given.items() if name in params or open_kwargs}


def _flash_integration(module, wrapper, q, k, v, mask=None, **kwargs):
    """Stands in for transformers' flash_attention_forward(module, ...): calls the wrapper as it does."""
    return wrapper(q, k, v, mask, query_length=q.shape[1], is_causal=kwargs.pop("is_causal", True), **kwargs)


def _takes(role):
    return role in _live_match().roles.values()


def test_every_registry_entry_passes_every_role_by_position():
    """For every signature generation: the wrapper passes, in ``codegen.ROLE_ORDER``, the caller's value of each
    role its signature has and None for the others, then the ``**kwargs`` dict; ``role_call`` gives the role dict
    back (the signature's roles only)."""
    for entry in registry.load_registry():
        found = registry.match(entry.signature())
        seen = []
        wrapper = codegen.render(found, lambda *values: seen.append(values) or "handled")
        params = list(entry.signature().parameters.values())
        values = {p.name: object() for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        extra_in = {"layer_idx": 3} if "extra_kwargs" in found.roles.values() else {}
        assert wrapper(*[values[n] for n in positional],
                       **{n: x for n, x in values.items() if n not in positional}, **extra_in) == "handled"
        got = seen[-1]
        assert len(got) == len(codegen.ROLE_ORDER) + 1 and got[-1] == extra_in, entry.id
        by_role = {found.roles[name]: token for name, token in values.items()}
        for i, role in enumerate(codegen.ROLE_ORDER):
            assert got[i] is by_role.get(role), (entry.id, role)
        assert codegen.role_call(found, got[:-1]) == by_role, entry.id
        assert codegen.wrapper_source(wrapper).count("_hfpatch_handler(") == 1, entry.id  # one call form


def test_the_fast_call_runs_the_kernel_with_the_generic_paths_arguments(kernels, monkeypatch):
    ctx = RingContext(rank=0, world_size=1)
    wrapper, d, _originals, spy = _rendered(ctx, monkeypatch)
    module = _Attention(layer_idx=2)
    q, k, v = _qkv(seq=8)
    for _ in range(3):
        out = _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper, softmax_scale=0.5))
    assert spy.fast == 2 and spy.slow == 1  # the first call built the plan
    name, args, kwargs = kernels.last()
    ring_attention(hf_call(q, k, v, scale=0.5), {}, RingContext(rank=0, world_size=1))  # an uncached run
    assert kernels.last()[0] == name and kernels.last()[2] == kwargs and args[0] is q and torch.equal(out, q)
    assert d.calls == {2: 3} and [(r.key, r.module_id) for r in d.forward_records()] == [(2, id(module))]


def test_the_fast_path_runs_a_layers_sinks_and_plans_another_sink_again(kernels, monkeypatch):
    """A layer passes its sink parameter (``s_aux``) on every call: the site's plan runs it, the sink reaching the
    kernel as ``sink=``; another sink object, or none, is planned again (and checked again)."""
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(
            codegen.render(_live_match(), lambda *a: None)).parameters.values()):
        pytest.skip("this release's _flash_attention_forward takes no **kwargs: no s_aux reaches it")
    ctx = RingContext(rank=0, world_size=1)
    wrapper, _d, _o, spy = _rendered(ctx, monkeypatch)
    module = _Attention(layer_idx=0)
    q, k, v = _qkv(seq=8)
    sinks = torch.nn.Parameter(torch.zeros(4))
    for _ in range(3):
        _flash_integration(module, wrapper, q, k, v, s_aux=sinks, layer_idx=0)
        assert kernels.last()[2]["sink"] is sinks
    assert spy.fast == 2 and spy.slow == 1
    other = torch.ones(4)
    _flash_integration(module, wrapper, q, k, v, s_aux=other, layer_idx=0)
    assert kernels.last()[2]["sink"] is other and spy.slow == 2
    _flash_integration(module, wrapper, q, k, v, s_aux=None, layer_idx=0)
    assert kernels.last()[2].get("sink") is None and spy.slow == 3
    _flash_integration(module, wrapper, q, k, v, layer_idx=0)
    assert kernels.last()[2].get("sink") is None and spy.slow == 3  # no s_aux is the same as s_aux=None
    with pytest.raises(UnsupportedArgument, match="attention sinks have shape"):
        _flash_integration(module, wrapper, q, k, v, s_aux=torch.zeros(2), layer_idx=0)


def test_the_fast_path_never_reuses_a_stale_step_or_plan(kernels, monkeypatch):
    if not _takes("position_ids"):
        pytest.skip("this release's _flash_attention_forward takes no position_ids (4.43): no derived packing")
    _world_of_one_cu(monkeypatch)
    ctx = RingContext(rank=0, world_size=1)
    wrapper, _d, _o, spy = _rendered(ctx, monkeypatch)
    module = _Attention(layer_idx=0)
    q, k, v = _qkv(seq=8)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    call = lambda **kw: _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper, position_ids=pos, **kw))
    for _layer in range(3):
        call()
        assert kernels.last()[0] == "llama3_attn_varlen_func" and kernels.last()[1][3].tolist() == [0, 3, 8]
    assert spy.fast == 2
    pos.copy_(torch.arange(8)[None])  # same tensor, new contents: derived again (one sequence)
    call()
    assert kernels.last()[0] == "ring_attn_func"
    pos.copy_(torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]]))
    call()
    assert kernels.last()[1][3].tolist() == [0, 2, 8]
    _d.ctx = dataclasses.replace(ctx, backend="reference")  # a context field a plan bakes in (Patch.reconfigure)
    ctx = _d.ctx
    call()
    assert kernels.last()[2]["backend"] == "reference"
    step = StepState(kernel="zigzag", layout="zigzag", packed=False, batch_size=1, seq_len_global=8, seq_len_local=8)
    ctx.set_step(step)  # a shard_inputs step replaces the derived one: its own kernel at once
    _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper))
    assert kernels.last()[0] == "zigzag_ring_attn_func"
    short = _qkv(seq=4)
    with pytest.raises(UnsupportedArgument, match="shard_inputs prepared this step"):
        _flash_integration(module, wrapper, *short, **_hf_kwargs(wrapper))
    ctx.set_step(None)  # derived again, from the new shape
    _flash_integration(module, wrapper, *short, **_hf_kwargs(wrapper, sliding_window=3))
    assert kernels.last()[0] == "ring_attn_func" and kernels.last()[2]["window_size"] == plan.window_size_of(3, 4)


def test_the_kept_plan_carries_the_inputs_it_was_built_for(kernels, monkeypatch):
    """``ring_plan`` returns the plan with the call's inputs (``dispatch.INPUTS``); the site keeps that very plan and
    runs it for the next call with equal inputs."""
    ctx = RingContext(rank=0, world_size=1)
    wrapper, _d, _o, spy = _rendered(ctx, monkeypatch)
    built = []
    planned = semantics.ring_plan
    monkeypatch.setattr(semantics, "ring_plan", lambda *a, **kw: built.append(planned(*a, **kw)) or built[-1])
    module = _Attention(layer_idx=0)
    q, k, v = _qkv(seq=8)
    for _ in range(3):
        _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper, softmax_scale=0.5))
    assert len(built) == 1 and spy.slow == 1 and spy.fast == 2 and len(kernels.seen) == 3
    inputs = dict(zip(dispatch.INPUTS, built[0].inputs))
    assert len(built[0].inputs) == len(dispatch.INPUTS)
    assert inputs["mode"] == "ring" and inputs["context version"] == ctx.version and inputs["softmax_scale"] == 0.5
    assert inputs["query.shape"] == q.shape and inputs["key.numel()"] == k.numel() and inputs["is_causal"] is True
    ctx = _d.ctx = dataclasses.replace(ctx, backend="reference")  # a new context: a new version, a new plan
    _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper, softmax_scale=0.5))
    assert len(built) == 2 and built[1].inputs[1] == ctx.version and kernels.last()[2]["backend"] == "reference"


@pytest.mark.parametrize("bad, match", [
    (dict(dropout=0.1), "dropout"),
    (dict(mask=torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])), "padding mask"),
    (dict(softcap=-1.0), "softcap"),
    (dict(sliding_window=True), "sliding_window"),
    (dict(sliding_window=1.0), "sliding_window"),  # == 1, a cached plan's window: refused all the same
    (dict(s_aux=torch.zeros(3)), "attention sinks have shape"),
    (dict(cache=object()), "KV cache"),
    (dict(longer_k=True), "KV cache"),
    (dict(block_table=torch.zeros(1, 1)), "paged KV cache"),
])
def test_the_fast_path_refuses_after_a_cached_plan(kernels, bad, match, monkeypatch):
    ctx = RingContext(rank=0, world_size=1)
    wrapper, _d, _o, spy = _rendered(ctx, monkeypatch)
    module = _Attention(layer_idx=0)
    q, k, v = _qkv(seq=8)
    for _ in range(2):  # plans cached for window=1 (True == 1 as a dict key) and for no window
        _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper, sliding_window=1))
        _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper))
    assert spy.fast == 2
    bad = dict(bad)
    mask = bad.pop("mask", None)
    if bad.pop("longer_k", False):
        k = v = torch.randn(1, 12, 4, 8)
    kwargs = _hf_kwargs(wrapper, **bad)
    if set(bad) - set(kwargs) or ("block_table" in bad and not _takes("block_table")):
        # (before 5.19 a block_table keyword lands in **kwargs, which HF's function and hfpatch ignore)
        pytest.skip(f"this release's _flash_attention_forward takes no {sorted(bad)}")
    with pytest.raises(UnsupportedArgument, match=match):
        _flash_integration(module, wrapper, q, k, v, mask, **kwargs)


def test_the_fast_path_reads_the_switch_and_the_removal_on_every_call(kernels, monkeypatch):
    ctx = RingContext(rank=0, world_size=1)
    wrapper, d, originals, spy = _rendered(ctx, monkeypatch)
    module = _Attention(layer_idx=1)
    q, k, v = _qkv(seq=8)
    call = lambda: _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper))  # noqa: E731
    call(), call()
    with hfpatch.switch("original"):
        assert torch.equal(call(), q * 3.0)
    call()
    hfpatch.switch.set_switch("original")
    try:
        assert torch.equal(call(), q * 3.0)
    finally:
        hfpatch.switch.set_switch("ring")
    assert spy.fast == 2 and len(kernels.seen) == 3 and len(originals) == 2
    assert d.mode_calls == {"ring": 3, "original": 2} and d.calls == {1: 3}
    d.removed = True  # Patch.remove(): a stale wrapper reference calls the original, uncounted
    assert torch.equal(call(), q * 3.0) and len(kernels.seen) == 3 and d.mode_calls == {"ring": 3, "original": 2}


def test_the_fast_path_keeps_modules_with_one_layer_index_apart_and_counts_recomputation_apart(kernels, monkeypatch):
    from torch.utils.checkpoint import checkpoint

    ctx = RingContext(rank=0, world_size=1)
    wrapper, d, _o, spy = _rendered(ctx, monkeypatch)
    encoder, decoder, unnamed = _Attention(layer_idx=0), _Attention(layer_idx=0), _Attention()
    q, k, v = _qkv(seq=8)
    for _ in range(2):
        for module in (encoder, decoder, unnamed):
            _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper))
    assert spy.fast == 3  # each site's first call plans (a plan per call site), its second reuses it
    records = {(r.key, r.module_id) for r in d.forward_records()}
    assert records == {(0, id(encoder)), (0, id(decoder)), (f"_Attention@{id(unnamed):x}", id(unnamed))}
    assert d.calls[0] == 4
    if _takes("extra_kwargs"):  # 4.48+: the layer_idx transformers passes wins
        d.begin_forward()
        _flash_integration(decoder, wrapper, q, k, v, layer_idx=5)
        assert [(r.key, r.module_id) for r in d.forward_records()] == [(5, id(decoder))]
    d.reset()
    layer = _Attention(layer_idx=7)
    qg = q.clone().requires_grad_(True)
    out = checkpoint(lambda x: _flash_integration(layer, wrapper, x, k, v, **_hf_kwargs(wrapper)) ** 2, qg,
                     use_reentrant=False)
    out.sum().backward()  # the recorder's q * 1.0 ** 2 saves q: the checkpoint recomputes the layer
    assert d.calls == {7: 1} and d.recomputed == {7: 1} and d.mode_calls == {"ring": 1}
    assert torch.equal(qg.grad, 2 * qg.detach())


def test_the_fast_path_scopes_the_kernels_rank_check_to_the_step(monkeypatch):
    """The kernel runs inside the step's rank-check scope (the check once per step and shape), and the scope
    ends with the call, also when the kernel raises."""
    scopes = []

    def kernel(q, k, v, **kwargs):
        scopes.append(ring_kernels.RANK_CHECKED.get())
        if kwargs["softmax_scale"] == 0.25:
            raise RuntimeError("kernel failed")
        return q

    for name in _KERNELS:
        monkeypatch.setitem(plan.KERNELS, name, kernel)
    ctx = RingContext(rank=0, world_size=1)
    step = StepState(kernel="ring", layout="contiguous", packed=False, batch_size=1, seq_len_global=8, seq_len_local=8)
    ctx.set_step(step)
    wrapper, _d, _o, spy = _rendered(ctx, monkeypatch)
    module = _Attention(layer_idx=0)
    q, k, v = _qkv(seq=8)
    for scale in (None, None, 0.25, 0.25):
        try:
            _flash_integration(module, wrapper, q, k, v, **_hf_kwargs(wrapper, softmax_scale=scale))
        except RuntimeError:
            pass
    # The first call of each configuration plans; a call that raised keeps no plan, so 0.25 plans twice. Both
    # paths run the kernel through RingPlan.run: its scope ends with the call, raising or not.
    assert spy.slow == 3 and spy.fast == 1
    assert [s is step.rank_checked for s in scopes] == [True] * 4
    assert ring_kernels.RANK_CHECKED.get() is None


def test_rank_checked_is_the_public_form_of_rank_check_scope(monkeypatch):
    """``ring_kernels.RANK_CHECKED`` (what the fast path sets) is the variable ``rank_check_scope`` sets and
    ``check_ranks_agree`` reads: setting it is that scope, without the scope object."""
    import contextvars


    assert "RANK_CHECKED" in ring_kernels.__all__ and isinstance(ring_kernels.RANK_CHECKED, contextvars.ContextVar)
    assert ring_kernels.RANK_CHECKED is rk_validation.RANK_CHECKED
    seen = set()
    with ring_kernels.rank_check_scope(seen):
        assert ring_kernels.RANK_CHECKED.get() is seen
    assert ring_kernels.RANK_CHECKED.get() is None
    # check_ranks_agree reads it: a signature recorded in the set is not gathered again. (A "group" of 2 that no
    # process joins: a gather would fail, so returning proves the skip; outside the set it does try to gather.)
    monkeypatch.setattr(rk_validation, "get_options", ring_kernels.RingOptions)   # the defaults: checks on
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    gathered = []
    monkeypatch.setattr(rk_validation, "gather_and_compare", lambda *args: gathered.append(args[0]))
    group, fields = object(), (("seqlen_local", 8.0),)
    seen.add((id(group), "fn", fields))
    token = ring_kernels.RANK_CHECKED.set(seen)
    try:
        rk_validation.check_ranks_agree("fn", group, fields, torch.device("cpu"))
        rk_validation.check_ranks_agree("other", group, fields, torch.device("cpu"))  # not in the set: gathered, added
    finally:
        ring_kernels.RANK_CHECKED.reset(token)
    assert gathered == ["other"] and (id(group), "other", fields) in seen
    rk_validation.check_ranks_agree("fn", group, fields, torch.device("cpu"))  # no scope: every call is checked
    assert gathered == ["other", "fn"]


# ----------------------------------------------------------------------------------------- the benchmark


class _Layers(torch.nn.Module):
    """A model of attention layers with indices 0..n-1 whose forward calls the wrapper as transformers' integration
    does (``layer_idx`` in the keywords, 4.54+)."""

    def __init__(self, wrapper, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Attention(layer_idx=i) for i in range(n))
        self.wrapper = wrapper

    def forward(self, q, k, v):
        for layer in self.layers:
            q = _flash_integration(layer, self.wrapper, q, k, v, **_hf_kwargs(self.wrapper, layer_idx=layer.layer_idx))
        return q


def test_a_tracked_models_sites_are_bound_only_while_its_forward_runs(kernels, monkeypatch):
    if not _takes("extra_kwargs"):
        pytest.skip("this release's _flash_attention_forward takes no **kwargs (before 4.48): no layer_idx to bind by")
    ctx = RingContext(rank=0, world_size=1)
    wrapper, d, _o, spy = _rendered(ctx, monkeypatch)
    tracked, other = _Layers(wrapper), _Layers(wrapper)
    hooks = d.track(tracked)
    monkeypatch.setattr(dispatch, "calling_module", lambda depth=2: pytest.fail("a bound call read the stack"))
    q, k, v = _qkv(seq=8)
    for _ in range(2):
        tracked(q, k, v)
    assert spy.fast == 3 and spy.slow == 3  # layer i's second call ran its bound site's plan
    assert {(r.key, r.module_id) for r in d.forward_records()} == {(i, id(m)) for i, m in enumerate(tracked.layers)}
    monkeypatch.undo()  # the stack again (and the spy's counting gone): the other model's layers are found there
    d.begin_forward()
    other(q, k, v)  # same indices, not tracked: recorded under its own modules
    assert {(r.key, r.module_id) for r in d.forward_records()} == {(i, id(m)) for i, m in enumerate(other.layers)}
    with pytest.raises(RuntimeError, match="layer failed"):  # a forward that raises ends its binding too
        with monkeypatch.context() as m:
            m.setattr(tracked.layers[1], "forward", None)
            m.setattr(_Layers, "forward", lambda self, *a: (_ for _ in ()).throw(RuntimeError("layer failed")))
            tracked(q, k, v)
    assert d._threads.state.bound is None and d.calls == {0: 3, 1: 3, 2: 3}
    hooks.remove()


def _bench():
    sys.path.insert(0, _BENCH)
    import patched_call_overhead as bench

    return bench


def test_benchmark_runs_at_tiny_counts():
    bench = _bench()
    result = bench.measure(number=2, repeat=2, layers=2)
    rows = {(r["path"], r["step"], r["kernel"]): r for r in result["rows"]}
    import transformers.modeling_flash_attention_utils as fa_utils

    # Packed documents reach the kernel through position_ids, a parameter from 4.44 (S2) on; 4.43's signature
    # has none, so there the packed step's call is an ordinary batch call.
    takes_positions = "position_ids" in inspect.signature(fa_utils._flash_attention_forward).parameters
    packed_kernel = "llama3_attn_varlen_func" if takes_positions else "ring_attn_func"
    for path in ("model=", "stack"):
        for step, kernel in (("batch", "ring_attn_func"), ("packed", packed_kernel)):
            assert (path, step, kernel) in rows and (path, step, "trivial") in rows
    assert ("floor", "batch", "live signature, empty body") in rows and len(rows) == 9
    for r in rows.values():
        assert 0 < r["direct_min_us"] <= r["direct_median_us"] and 0 < r["patched_min_us"] <= r["patched_median_us"]
        assert r["ratio"] == pytest.approx(r["patched_min_us"] / r["direct_min_us"])
    text = bench.render(result)
    assert "added us" in text and result["stamp"]["torch"] in text and len(text.splitlines()) == 6 + len(rows)
    assert hfpatch.active_patch() is None  # the benchmark removed its patch
    assert not dist.is_initialized()  # and its world of one


def test_the_added_time_per_call_stays_within_budget():
    """hfpatch's added time per patched call (trivial kernel, a tracked model, batch step) against the direct kernel
    call from the same integration frame, both measured in one interleaved run (min of 9 samples).

    The target is <= 2 us added per call on the development machine. A ratio to the direct call, not microseconds:
    on a loaded 2-core CI machine both sides slow down together. benchmarks/results/
    patched_call_overhead_cpu_model_and_stack_2b4a202.txt (load ~5): 2.3x the direct call (2.82 us against
    1.23 us; this test's own measurement 2.3-2.5x); the tree before it 2.5x, the twin fast path the one call path
    replaced 4.8x; the bound, 3.3x, keeps the margin the 3.5x bound had over 2.4x, and fails a return to either."""
    bench = _bench()
    import transformers.modeling_flash_attention_utils as mfau

    layers = 8
    q, k, v, position_ids = bench._inputs("batch")
    with bench._world_of_one() as group, bench._installed(group) as patch:
        fa = mfau._flash_attention_forward
        by_layer_idx = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fa).parameters.values())
        budget = 3.3 if by_layer_idx else 4.3  # the two paths' bounds: see the comment at the assertion
        tracked = bench._Model(layers, bench._integration_like(fa))
        patch.track(tracked)
        with bench._kernels(lambda _name: bench._trivial):
            tracked(q, k, v, position_ids)  # each site plans on its first call
            name, args, kernel_kwargs = bench._record_kernel_call(lambda: tracked.layers[0] and bench._Model(
                1, bench._integration_like(fa))(q, k, v, position_ids))
            direct = bench._Model(layers, bench._direct_like(bench._trivial, args, kernel_kwargs))
            empty = bench._Model(layers, bench._integration_like(bench._empty_body(fa)))
            # Up to three interleaved runs, the best kept: a burst of load from another process slows one side of
            # one run, never the same side of three (the min over samples, extended over runs).
            best = None
            for _ in range(3):
                samples = bench._times([lambda: direct(q, k, v, position_ids), lambda: empty(q, k, v, position_ids),
                                        lambda: tracked(q, k, v, position_ids)], 200, 9)
                run = tuple(min(s) / layers * 1e6 for s in samples)
                if best is None or (run[2] - run[0]) / run[0] < (best[2] - best[0]) / best[0]:
                    best = run
                if best[2] - best[0] <= budget * best[0]:
                    break
    t_direct, t_floor, t_patched = best
    added = t_patched - t_direct
    # Where _flash_attention_forward takes no **kwargs (4.43-4.47), transformers cannot pass layer_idx: a tracked
    # model's calls then find their module on the stack, the other path (same file: 3.73 us, 3.0x the direct call,
    # on 5.23; this test on 4.43.4 at load ~8: 3.6-3.7x, the tree before 3.8-5.0x). Its own budget, 4.3x, keeps the
    # margin 4.5x had over 3.8x and still fails the twin path's 4.8x.
    assert t_floor > t_direct * 0.5 and added <= budget * t_direct, (
        f"hfpatch adds {added:.2f} us per call, {added / t_direct:.1f}x the direct call ({t_direct:.2f} us; "
        f"binding the live signature alone: {t_floor - t_direct:.2f} us; "
        f"{'layer_idx' if by_layer_idx else 'stack'} path); the budget is {budget}x")
