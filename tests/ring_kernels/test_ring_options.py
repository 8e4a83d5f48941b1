"""ring_kernels.options: defaults, the setter, the context manager, the environment as an override, validation."""
from __future__ import annotations

import dataclasses
import threading

import pytest

import ring_kernels as rk
from ring_kernels import options

_DEFAULTS = {"transport": "nccl", "copy_engine_signal": "barrier", "fused_merge": True, "skip_rank_check": False,
             "forward_yield_us": 25.0}


@pytest.fixture(autouse=True)
def _fresh_options(monkeypatch):
    """No RING_KERNELS_* variable and nothing read or set, before and after each test."""
    for variable in options.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    options.reload_environment()
    yield
    options.reload_environment()


def test_defaults_and_public_names():
    assert dataclasses.asdict(rk.get_options()) == _DEFAULTS == dataclasses.asdict(rk.RingOptions())
    assert {"RingOptions", "get_options", "set_options", "use_options", "RingInputError"} <= set(rk.__all__)
    assert set(options.ENVIRONMENT) == set(_DEFAULTS)                 # one variable per field, every field


def test_set_options_returns_the_previous_ones_and_restores():
    previous = rk.set_options(skip_rank_check=True, forward_yield_us=10)
    assert previous == rk.RingOptions()
    assert rk.get_options() == rk.RingOptions(skip_rank_check=True, forward_yield_us=10.0)
    rk.set_options(**dataclasses.asdict(previous))
    assert rk.get_options() == rk.RingOptions()


def test_use_options_nests_restores_and_stays_in_its_thread():
    seen_elsewhere = []
    with rk.use_options(fused_merge=False) as outer:
        assert outer is rk.get_options() and not outer.fused_merge
        with rk.use_options(transport="copy_engine"):
            assert rk.get_options() == rk.RingOptions(fused_merge=False, transport="copy_engine")
            thread = threading.Thread(target=lambda: seen_elsewhere.append(rk.get_options()))
            thread.start()
            thread.join()
        assert rk.get_options() == outer
        with pytest.raises(KeyError):
            with rk.use_options(skip_rank_check=True):
                raise KeyError("an exception passes through the scope")
        assert rk.get_options() == outer
    assert rk.get_options() == rk.RingOptions() and seen_elsewhere == [rk.RingOptions()]


def test_environment_overrides_defaults_and_code_overrides_environment(monkeypatch):
    for field, variable, raw, value in (("transport", "RING_KERNELS_TRANSPORT", " copy_engine ", "copy_engine"),
                                        ("copy_engine_signal", "RING_KERNELS_CE_SIGNAL", "stream_memop", "stream_memop"),
                                        ("fused_merge", "RING_KERNELS_FUSED_MERGE", "0", False),
                                        ("skip_rank_check", "RING_KERNELS_SKIP_RANK_CHECK", "1", True),
                                        ("forward_yield_us", "RING_KERNELS_FORWARD_YIELD_US", "12.5", 12.5)):
        assert options.ENVIRONMENT[field] == variable
        rk.get_options()                                                   # the environment is read here
        monkeypatch.setenv(variable, raw)
        assert getattr(rk.get_options(), field) == _DEFAULTS[field], "read once, at first use"
        options.reload_environment()
        assert getattr(rk.get_options(), field) == value, field
        with rk.use_options(**{field: _DEFAULTS[field]}):
            assert getattr(rk.get_options(), field) == _DEFAULTS[field], field
        rk.set_options(**{field: _DEFAULTS[field]})
        assert getattr(rk.get_options(), field) == _DEFAULTS[field], field
        monkeypatch.delenv(variable)
        options.reload_environment()
    monkeypatch.setenv("RING_KERNELS_TRANSPORT", "  ")                     # blank: unset
    options.reload_environment()
    assert rk.get_options() == rk.RingOptions()


@pytest.mark.parametrize("variable, raw, allowed", [
    ("RING_KERNELS_TRANSPORT", "NCCL", "one of ('nccl', 'copy_engine')"),
    ("RING_KERNELS_CE_SIGNAL", "spin", "one of ('barrier', 'stream_memop')"),
    ("RING_KERNELS_FUSED_MERGE", "yes", "0 or 1"),
    ("RING_KERNELS_SKIP_RANK_CHECK", "true", "0 or 1"),
    ("RING_KERNELS_FORWARD_YIELD_US", "5000", "between 0 and 1000"),
])
def test_bad_environment_value_raises_at_every_use_naming_the_variable(monkeypatch, variable, raw, allowed):
    monkeypatch.setenv(variable, raw)
    options.reload_environment()
    for _ in range(2):                                  # never cached
        with pytest.raises(rk.RingInputError) as info:
            rk.get_options()
        assert f"{variable}={raw!r}" in str(info.value) and allowed in str(info.value)
        assert info.value.argument == variable and info.value.value == raw


@pytest.mark.parametrize("changes, error, match", [
    ({"transport": "nvlink"}, rk.RingInputError, r"transport='nvlink' is not one of \('nccl', 'copy_engine'\)"),
    ({"transport": 1}, TypeError, "transport=1 must be a str"),
    ({"fused_merge": 0}, TypeError, "fused_merge=0 must be a bool"),
    ({"forward_yield_us": -1}, rk.RingInputError, "forward_yield_us=-1 must be between 0 and 1000"),
    ({"forward_yield_us": "25"}, TypeError, "forward_yield_us='25' must be a number"),
    ({"fused": True}, TypeError, "RingOptions has no field 'fused'; its fields are transport, "),
])
def test_bad_values_are_refused_before_anything_changes(changes, error, match):
    for attempt in (lambda: rk.set_options(**changes), lambda: rk.use_options(**changes).__enter__()):
        with pytest.raises(error, match=match):
            attempt()
        assert rk.get_options() == rk.RingOptions()
