"""RING_ATTN_SWITCH parsing, the runtime switch (process default + per-thread override), and per-call routing in
the dispatcher (ring / original / reference), including concurrent threads with different modes."""
from __future__ import annotations

import inspect
import threading

import pytest
import torch

import hfpatch
from hfpatch import modes, switch
from hfpatch.attention import dispatch, semantics
from hfpatch.attention.semantics import RingContext
from hfpatch.signatures import registry


@pytest.fixture(autouse=True)
def _default_ring():
    previous = switch.set_switch("ring")
    yield
    switch.set_switch(previous)


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
            if args and isinstance(args[0], dict):  # semantics functions get (call, extra, ctx)
                query = args[0]["query"]
            else:  # the original is re-called by parameter name
                query = kwargs["query_states"]
            return torch.full_like(query, value)

        return destination


def test_dispatcher_routes_every_call_by_the_current_mode(monkeypatch):
    live, match = _live_match()
    rec = _Recorder()
    monkeypatch.setattr(semantics, "ring_attention", rec.make("ring", 1.0))
    monkeypatch.setattr(semantics, "reference_attention", rec.make("reference", 2.0))
    dispatcher = dispatch.Dispatcher(original=rec.make("original", 3.0), match=match, ctx=RingContext())
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
    monkeypatch.setattr(semantics, "ring_attention", rec.make("ring", 1.0))
    monkeypatch.setattr(semantics, "reference_attention", rec.make("reference", 2.0))
    dispatcher = dispatch.Dispatcher(original=rec.make("original", 3.0), match=match, ctx=RingContext())
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
