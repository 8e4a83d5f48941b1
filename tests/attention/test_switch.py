"""RING_ATTN_SWITCH parsing and its step boundaries (read again at ``shard_inputs``, the drop-ins' ``set_step`` and a
tracked model's forward start), the runtime switch (process default + per-thread override), and per-call routing in
the dispatcher (ring / original / reference / local), including concurrent threads with different modes; "original"
where transformers' flash path cannot run (plain attention on the local tensors, hfpatch's own refusals) and the
warning of "local" on a shard."""
from __future__ import annotations

import importlib.util
import inspect
import logging
import threading

import pytest
import torch
import torch.nn.functional as F

import hfpatch
from hfpatch import inputs, modes, switch
from hfpatch.attention import dispatch, plan, whole
from hfpatch.attention.context import RingContext, StepState
from hfpatch.dropin import ring_flash_attn
from hfpatch.errors import UnsupportedArgument
from hfpatch.signatures import registry
from ring_kernels.tolerances import assert_close, tolerance
from test_semantics import hf_call


@pytest.fixture(autouse=True)
def _default_ring(monkeypatch):
    monkeypatch.delenv(modes.ENV_VAR, raising=False)
    restore = switch.follow_env("ring")  # the default and the reading step boundaries compare with
    yield
    restore()


@pytest.mark.parametrize(
    "value, mode",
    [(None, "ring"), ("", "ring"), ("1", "ring"), (" 1 ", "ring"), ("ring", "ring"), ("0", "original"),
     ("original", "original"), ("reference", "reference"), ("REFERENCE", "reference")],
)
def test_env_values(value, mode):
    env = {} if value is None else {"RING_ATTN_SWITCH": value}
    assert switch.mode_from_env(env) == mode


@pytest.mark.parametrize("value", ["2", "yes", "true", "ref", "-1"])
def test_env_bad_value_names_variable_value_and_allowed(value):
    with pytest.raises(ValueError) as info:
        switch.mode_from_env({"RING_ATTN_SWITCH": value})
    message = str(info.value)
    assert "RING_ATTN_SWITCH" in message and repr(value) in message
    assert "'0'" in message and "'1'" in message and "'reference'" in message


def test_bad_runtime_mode_is_value_error():
    with pytest.raises(ValueError, match="mode='fast'"):
        hfpatch.set_switch("fast")
    with pytest.raises(ValueError, match="mode=True"):
        with hfpatch.switch(True):
            pass
    assert hfpatch.current_mode() == "ring"


def test_set_switch_returns_previous_and_context_nests_and_restores_on_error():
    assert hfpatch.set_switch("reference") == "ring"
    assert hfpatch.current_mode() == "reference"
    with hfpatch.switch("0"):
        assert hfpatch.current_mode() == "original"
        with pytest.raises(RuntimeError):
            with hfpatch.switch("ring"):
                assert hfpatch.current_mode() == "ring"
                raise RuntimeError("boom")
        assert hfpatch.current_mode() == "original"
    assert hfpatch.current_mode() == "reference"


def test_the_switch_is_one_callable_object():
    module = modes.switch

    assert hfpatch.switch is module
    with hfpatch.switch("reference") as mode:
        assert mode == "reference" and module.current_mode() == "reference"


def test_override_is_per_thread_default_is_process_wide():
    barrier = threading.Barrier(3)
    seen = {}

    def worker(name, mode):
        with hfpatch.switch(mode):
            barrier.wait()  # all three threads are inside their blocks at once
            seen[name] = hfpatch.current_mode()
            barrier.wait()

    def plain():
        barrier.wait()
        seen["plain"] = hfpatch.current_mode()  # no override: the process-wide default
        barrier.wait()

    threads = [threading.Thread(target=worker, args=("a", "original")),
               threading.Thread(target=worker, args=("b", "reference")), threading.Thread(target=plain)]
    hfpatch.set_switch("ring")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "original", "b": "reference", "plain": "ring"}

    # A new default reaches a thread that has no override, without touching one that has.
    result = {}
    ready, changed = threading.Event(), threading.Event()

    def late():
        ready.set()
        changed.wait(5)
        result["late"] = hfpatch.current_mode()

    t = threading.Thread(target=late)
    t.start()
    ready.wait(5)
    with hfpatch.switch("ring"):
        hfpatch.set_switch("reference")
        assert hfpatch.current_mode() == "ring"
    changed.set()
    t.join()
    assert result["late"] == "reference"


def test_thread_mode_is_this_threads_mode_kept_current():
    own = switch.thread_mode()
    assert own is hfpatch.switch.thread_mode() and own.mode == "ring" and own.overrides == []
    with hfpatch.switch("reference"):
        assert own.mode == "reference" == hfpatch.current_mode() and own.overrides == ["reference"]
    hfpatch.set_switch("original")  # a new default reaches the held object
    assert own.mode == "original"
    seen = {}

    def other():
        seen["state"] = switch.thread_mode()
        with hfpatch.switch("local"):
            seen["inside"] = seen["state"].mode

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["state"] is not own and seen["inside"] == "local" and own.mode == "original"


# ------------------------------------------------------------------------------- per-call routing


def _live_match():
    import transformers.modeling_flash_attention_utils as mfau

    live = mfau._flash_attention_forward
    return live, registry.require(inspect.signature(live))


class _Recorder:
    """Stands in for the three destinations; returns a tensor tagged with the destination's number."""

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def make(self, tag, value):
        def destination(*args, **kwargs):
            with self.lock:
                self.calls.append((tag, threading.current_thread().name))
            if args and isinstance(args[0], dict):  # whole's functions get (call, extra, ctx)
                query = args[0]["query"]
            elif args:  # a ring kernel gets (q, k, v, ...)
                query = args[0]
            else:  # the original is re-called by parameter name
                query = kwargs["query_states"]
            return torch.full_like(query, value)

        return destination

    def stand_in_for_the_ring(self, monkeypatch, value):
        """Every ring kernel (``plan.KERNELS``) replaced by this recorder's "ring" destination."""
        for name in plan.KERNELS:
            monkeypatch.setitem(plan.KERNELS, name, self.make("ring", value))


def test_dispatcher_routes_every_call_by_the_current_mode(monkeypatch):
    live, match = _live_match()
    rec = _Recorder()
    rec.stand_in_for_the_ring(monkeypatch, 1.0)
    monkeypatch.setattr(whole, "reference_attention", rec.make("reference", 2.0))
    dispatcher = dispatch.Dispatcher(original=rec.make("original", 3.0), match=match, ctx=RingContext())
    dispatcher.original_runs = lambda call: True  # the recorder stands in for a flash path that runs here
    call = {"query": torch.zeros(1, 4, 2, 8), "key": torch.zeros(1, 4, 1, 8), "value": torch.zeros(1, 4, 1, 8),
            "attention_mask": None, "query_length": 4, "is_causal": True}
    assert dispatcher(call, {}).flatten()[0].item() == 1.0
    with hfpatch.switch("original"):
        assert dispatcher(call, {}).flatten()[0].item() == 3.0
    with hfpatch.switch("reference"):
        assert dispatcher(call, {}).flatten()[0].item() == 2.0
    hfpatch.set_switch("0")
    assert dispatcher(call, {}).flatten()[0].item() == 3.0
    assert [c[0] for c in rec.calls] == ["ring", "original", "reference", "original"]
    assert dispatcher.mode_calls == {"ring": 1, "original": 2, "reference": 1}
    assert sum(dispatcher.calls.values()) == 1  # only ring calls count as layers that ran the ring

    # After removal a stale wrapper reference calls the original, whatever the switch says.
    dispatcher.removed = True
    hfpatch.set_switch("ring")
    assert dispatcher(call, {}).flatten()[0].item() == 3.0


def test_dispatcher_threads_with_different_modes_are_isolated(monkeypatch):
    live, match = _live_match()
    rec = _Recorder()
    rec.stand_in_for_the_ring(monkeypatch, 1.0)
    monkeypatch.setattr(whole, "reference_attention", rec.make("reference", 2.0))
    dispatcher = dispatch.Dispatcher(original=rec.make("original", 3.0), match=match, ctx=RingContext())
    dispatcher.original_runs = lambda call: True
    call = {"query": torch.zeros(1, 2, 1, 4), "key": torch.zeros(1, 2, 1, 4), "value": torch.zeros(1, 2, 1, 4),
            "attention_mask": None, "query_length": 2, "is_causal": True}
    expected = {"ring": 1.0, "original": 3.0, "reference": 2.0}
    errors = []
    barrier = threading.Barrier(3)

    def worker(mode):
        try:
            with hfpatch.switch(mode):
                barrier.wait()
                for _ in range(200):
                    value = dispatcher(call, {}).flatten()[0].item()
                    if value != expected[mode]:
                        errors.append((mode, value))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(m,), name=m) for m in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # every call was routed by its own thread's mode
    assert all(tag == thread for tag, thread in rec.calls) and len(rec.calls) == 600
    assert dispatcher.mode_calls == {"ring": 200, "original": 200, "reference": 200}


# ------------------------------------------------------------------------- RING_ATTN_SWITCH at step boundaries

ENV = modes.ENV_VAR


def test_a_step_boundary_follows_the_variable_only_when_its_mode_changes():
    sw = modes.Switch()
    sw.follow_env("ring")  # what apply read
    assert sw.refresh_from_env({}) is None and sw.current_mode() == "ring"
    assert sw.refresh_from_env({ENV: "0"}) == "original" and sw.current_mode() == "original"
    assert sw.refresh_from_env({ENV: "0"}) is None
    assert sw.refresh_from_env({ENV: "original"}) is None  # another spelling of the same mode: no change
    sw.set_switch("reference")  # an explicit choice stands while the variable keeps its mode
    assert sw.refresh_from_env({ENV: "original"}) is None and sw.current_mode() == "reference"
    with sw("local"):
        assert sw.refresh_from_env({ENV: "1"}) == "ring"
        assert sw.current_mode() == "local"  # a thread's override outlives a new default
    assert sw.current_mode() == "ring"


def test_a_bad_value_at_a_step_boundary_raises_every_time_and_changes_nothing():
    sw = modes.Switch()
    sw.follow_env("ring")
    sw.refresh_from_env({ENV: "0"})
    for _ in range(2):
        with pytest.raises(ValueError, match="RING_ATTN_SWITCH='yes'") as info:
            sw.refresh_from_env({ENV: "yes"})
        assert "'reference'" in str(info.value) and sw.current_mode() == "original"
    assert sw.refresh_from_env({ENV: "reference"}) == "reference" and sw.current_mode() == "reference"


def test_follow_env_sets_the_reading_and_its_undo_restores_default_and_reading():
    sw = modes.Switch()
    sw.set_switch("reference")
    undo = sw.follow_env("original")  # apply read RING_ATTN_SWITCH=0
    assert sw.current_mode() == "original"
    assert sw.refresh_from_env({ENV: "0"}) is None  # unchanged since apply
    undo()
    assert sw.current_mode() == "reference"
    assert sw.refresh_from_env({}) is None and sw.current_mode() == "reference"  # the reading before: unset = ring


def test_shard_inputs_set_step_and_a_tracked_forward_are_step_boundaries(monkeypatch):
    ids = torch.zeros(1, 8, dtype=torch.long)
    monkeypatch.setenv(ENV, "0")
    inputs.shard_inputs(None, ids)
    assert hfpatch.current_mode() == "original"

    monkeypatch.setenv(ENV, "reference")
    patch = ring_flash_attn.substitute_hf_flash_attn(None, 1)  # no process group: an inactive drop-in patch
    ring_flash_attn.update_ring_flash_attn_params(torch.tensor([0, 8], dtype=torch.int32), None)
    assert hfpatch.current_mode() == "reference"
    patch.remove()

    live, match = _live_match()
    dispatcher = dispatch.Dispatcher(original=live, match=match, ctx=RingContext())
    model = torch.nn.Linear(2, 2)
    tracking = dispatcher.track(model)
    try:
        monkeypatch.setenv(ENV, "local")
        model(torch.zeros(1, 2))
        assert hfpatch.current_mode() == "local"
        monkeypatch.setenv(ENV, "two")
        with pytest.raises(ValueError, match="RING_ATTN_SWITCH='two'"):
            model(torch.zeros(1, 2))
        with pytest.raises(ValueError, match="RING_ATTN_SWITCH='two'"):
            inputs.shard_inputs(None, ids)
        assert hfpatch.current_mode() == "local"
    finally:
        tracking.remove()


# ------------------------------------------------------------------ "original" where flash-attn cannot run


def _qkv(batch=1, seq=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq, 4, 8, generator=g), torch.randn(batch, seq, 2, 8, generator=g),
            torch.randn(batch, seq, 2, 8, generator=g))


def _sdpa(q, k, v, *, scale):
    """What a model's SDPA attention computes (causal, K/V heads repeated) on (B, S, H, D) tensors."""
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale)
    return out.transpose(1, 2)


def _transformers_original():
    """A dispatcher around transformers' live ``_flash_attention_forward`` (which needs flash-attn to run)."""
    live, match = _live_match()
    return dispatch.Dispatcher(original=live, match=match, ctx=RingContext())


def test_flash_path_runs_is_transformers_check_of_the_implementation():
    from transformers.utils import is_flash_attn_2_available

    assert whole.flash_path_runs("flash_attention_2") is is_flash_attn_2_available()
    assert whole.flash_path_runs("paged|flash_attention_2") is is_flash_attn_2_available()
    assert whole.flash_path_runs("kernels-community/flash-attn2") is True  # loaded when the model was set to it
    assert whole.flash_path_runs("sdpa") is False
    if importlib.util.find_spec("flash_attn") is None:
        assert whole.flash_path_runs(None) is False


def test_original_runs_where_the_flash_path_loads_and_the_query_is_off_cpu(monkeypatch):
    dispatcher = _transformers_original()
    monkeypatch.setattr(whole, "flash_path_runs", lambda implementation: True)
    assert not dispatcher.original_runs({"query": torch.zeros(1)})  # flash-attn has no CPU kernel
    assert dispatcher.original_runs({"query": torch.zeros(1, device="meta")})
    monkeypatch.setattr(whole, "flash_path_runs", lambda implementation: False)
    assert not dispatcher.original_runs({"query": torch.zeros(1, device="meta")})


@pytest.mark.parametrize("docs", [None, [3, 5]])
def test_original_without_a_flash_path_is_the_models_sdpa_on_the_local_tensors(docs):
    """Forward and backward equal SDPA on the same tensors (GQA, a scale, documents from position ids); the path
    is local_attention's, and the calls are counted under "original"."""
    dispatcher = _transformers_original()
    if docs is not None and "position_ids" not in inspect.signature(dispatcher.original).parameters:
        pytest.skip("this release's _flash_attention_forward takes no position_ids (4.43): no documents to split")
    q, k, v = _qkv()
    positions = None if docs is None else torch.cat([torch.arange(n) for n in docs])[None]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    call = hf_call(*leaves, scale=0.3, position_ids=positions)
    with hfpatch.switch("original"):
        out = dispatcher(call, {})
    assert torch.equal(out, whole.local_attention(call, {}, dispatcher.ctx))  # one path per behaviour
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    bounds = [0, q.shape[1]] if docs is None else [0, *torch.tensor(docs).cumsum(0).tolist()]
    want = torch.cat([_sdpa(*(t[:, a:b] for t in ref), scale=0.3) for a, b in zip(bounds, bounds[1:])], dim=1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    (out * dout).sum().backward()
    (want * dout).sum().backward()
    assert_close(out, want, tolerance("kernel", torch.float32, "out"), "out")
    for name, got, r in zip("qkv", leaves, ref):
        assert_close(got.grad, r.grad, tolerance("kernel", torch.float32, "grad"), f"d{name}")
    assert dispatcher.mode_calls == {"original": 1}


@pytest.mark.parametrize("more, parameter", [
    (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])), "attention_mask"),
    (dict(dropout=0.1), "dropout"),
])
def test_original_without_a_flash_path_refuses_what_plain_attention_cannot_honour(more, parameter):
    with hfpatch.switch("original"), pytest.raises(UnsupportedArgument) as info:
        _transformers_original()(hf_call(*_qkv(), **more), {})
    err = info.value
    assert err.parameter == parameter and "switch mode 'original'" in err.reason and "flash-attn" in err.fix
    assert isinstance(err.__cause__, UnsupportedArgument) and err.__cause__.fix in err.fix


def test_a_kv_cache_refusal_offers_fixes_that_work_without_flash_attn():
    q, k, v = _qkv()
    for mode in ("original", "local", "ring"):
        with hfpatch.switch(mode), pytest.raises(UnsupportedArgument) as info:
            _transformers_original()(hf_call(q[:, :1], k, v, query_length=1), {})  # a decode step
        assert info.value.parameter == "key", mode
        assert "patch.remove()" in info.value.fix and "use_cache=False" in info.value.fix, mode
        assert "RING_ATTN_SWITCH" not in info.value.fix, mode


# ----------------------------------------------------------------------------------- "local" on a shard


def test_local_on_a_shard_warns_once_per_patch_and_never_on_a_whole_sequence(caplog):
    live, match = _live_match()
    ctx = RingContext()

    def warnings_of(dispatcher, call, mode="local"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hfpatch"), hfpatch.switch(mode):
            for _ in range(2):
                dispatcher(call, {})
        return [r for r in caplog.records if "switch mode 'local'" in r.getMessage()]

    whole, shard = hf_call(*_qkv(seq=16)), hf_call(*_qkv(seq=8))
    first = dispatch.Dispatcher(original=live, match=match, ctx=ctx)
    assert warnings_of(first, whole) == [] and warnings_of(first, shard) == []  # no step: whole sequences
    ctx.set_step(StepState(kernel="zigzag", layout="zigzag", packed=False, batch_size=1, seq_len_global=16,
                           seq_len_local=8))
    assert warnings_of(first, whole) == []  # the whole sequence (the probe, the sweep)
    assert warnings_of(first, shard, mode="original") == []  # "original" is the non-CP computation
    warned = warnings_of(first, shard)
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING and "8 of 16 tokens" in warned[0].getMessage()
    assert warnings_of(first, shard) == []  # once per patch
    assert len(warnings_of(dispatch.Dispatcher(original=live, match=match, ctx=ctx), shard)) == 1  # another patch
    ctx.set_step(StepState(kernel="zigzag", layout="zigzag", packed=False, batch_size=1, seq_len_global=8,
                           seq_len_local=8))  # a world of one: nothing is sharded
    assert warnings_of(dispatch.Dispatcher(original=live, match=match, ctx=ctx), shard) == []
