"""ring_kernels.transport on the CPU: the transport choice (argument, environment, gloo/CPU always NCCL-style P2P),
its errors, the unavailable reason off CUDA, and the copy-engine exchange's pure parts (staging layout, byte
views, tensor checks, peer reasoning). The copy-engine data path itself runs in tests/gpu/test_transport_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_world
from ring_kernels import transport as tr
from ring_kernels.comm import RingExchange


# --- transport choice ------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, expected", [(None, "nccl"), ("", "nccl"), ("nccl", "nccl"),
                                           ("copy_engine", "copy_engine"), (" copy_engine ", "copy_engine")])
def test_transport_from_environment(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv(tr.TRANSPORT_ENV, raising=False)
    else:
        monkeypatch.setenv(tr.TRANSPORT_ENV, env)
    assert tr._transport_choice(None) == expected


def test_argument_overrides_environment(monkeypatch):
    monkeypatch.setenv(tr.TRANSPORT_ENV, "copy_engine")
    assert tr._transport_choice("nccl") == "nccl"


@pytest.mark.parametrize("bad", ["NCCL", "ce", "copy-engine", "p2p"])
def test_unknown_environment_value_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv(tr.TRANSPORT_ENV, bad)
    with pytest.raises(ValueError) as info:
        tr.make_exchange()
    msg = str(info.value)
    assert tr.TRANSPORT_ENV in msg and repr(bad) in msg and "copy_engine" in msg and "nccl" in msg
    assert info.value.argument == tr.TRANSPORT_ENV and info.value.value == bad


def test_unknown_transport_argument_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(tr.TRANSPORT_ENV, raising=False)
    with pytest.raises(ValueError, match=r"transport='nvlink' is not one of \('nccl', 'copy_engine'\)"):
        tr.make_exchange(transport="nvlink")


@pytest.mark.parametrize("transport", [None, "nccl", "copy_engine"])
def test_without_a_process_group_make_exchange_is_ring_exchange(monkeypatch, transport):
    monkeypatch.setenv(tr.TRANSPORT_ENV, "copy_engine")
    ex = tr.make_exchange(transport=transport)
    assert type(ex) is RingExchange and ex.world_size == 1
    x, y = torch.arange(5.0), torch.zeros(5)
    ex.start([x], [y])
    ex.wait()
    assert torch.equal(x, y)


def test_unavailable_reason_off_cuda():
    assert "not initialised" in tr.copy_engine_unavailable_reason(None, torch.device("cpu"))


def test_copy_engine_exchange_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this checks the error raised where CUDA is absent")
    with pytest.raises(RuntimeError, match="CUDA is not available") as info:
        tr.CopyEngineExchange()
    assert isinstance(info.value, tr.CopyEngineUnavailableError) and "CUDA" in info.value.reason


@pytest.mark.parametrize("kwargs, exc, text", [
    ({"reverse": 1}, TypeError, "reverse=1 must be a bool"),
    ({"tag": -1}, ValueError, "tag=-1 must be an int >= 0"),
    ({"timeout_ms": 1.5}, ValueError, "timeout_ms=1.5 must be an int >= 0"),
])
def test_copy_engine_exchange_argument_errors(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        tr.CopyEngineExchange(**kwargs)


# --- on a gloo world: always RingExchange, whatever was asked -----------------------------------------------

def _gloo_cases(rank, world_size):
    import os

    import torch.distributed as dist
    from ring_kernels import transport as tr
    from ring_kernels.comm import RingExchange

    out = {}
    reason = tr.copy_engine_unavailable_reason(None, torch.device("cpu"))
    out["reason_cpu"] = reason
    out["reason_default"] = tr.copy_engine_unavailable_reason()   # no CUDA here: the CPU reason, no collective
    for transport in (None, "nccl", "copy_engine"):
        os.environ[tr.TRANSPORT_ENV] = "copy_engine"
        for reverse in (False, True):
            try:
                ex = tr.make_exchange(None, tag=3, reverse=reverse, transport=transport)
            except TypeError as exc:   # comm.RingExchange before its reverse flag landed: a clear error
                assert reverse and "has no reverse flag" in str(exc), exc
                continue
            assert type(ex) is RingExchange, (transport, reverse, type(ex))
            assert ex.tag == 3
            src = (rank + 1) % world_size if reverse else (rank - 1) % world_size
            send = torch.full((2, 3), float(rank * 10 + reverse))
            recv = torch.empty(2, 3)
            ex.start([send], [recv])
            ex.wait()
            # the data came from the rank the direction names
            assert torch.equal(recv, torch.full((2, 3), float(src * 10 + reverse))), (rank, reverse, recv)
    sub = dist.new_group([0, 1])
    out["reason_subgroup"] = tr.copy_engine_unavailable_reason(sub, torch.device("cpu"))
    assert type(tr.make_exchange(sub, transport="copy_engine")) is RingExchange
    return out


def test_gloo_world_picks_ring_exchange_for_every_request():
    results = run_world(2, _gloo_cases)
    for res in results:
        for key in ("reason_cpu", "reason_default", "reason_subgroup"):
            assert "cpu is not a CUDA device" in res[key], (key, res[key])


# --- pure parts of the copy-engine exchange -------------------------------------------------------------

def test_layout_aligns_every_tensor():
    tensors = [torch.empty(3, dtype=torch.bfloat16), torch.empty(0, dtype=torch.float32),
               torch.empty(2, 5, dtype=torch.float64), torch.empty(1, dtype=torch.uint8)]
    offsets, total = tr._layout(tensors)
    assert offsets == [0, 256, 256, 512] and total == 768
    assert all(o % tr._ALIGN == 0 for o in offsets)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64,
                                   torch.int8, torch.bool])
def test_view_round_trips_bytes(dtype):
    """What one rank writes through _view at its offsets is what the other reads back with the same layout."""
    like = [torch.randn(4, 3).to(dtype), torch.randn(7).to(dtype), torch.randn(2, 2, 2).to(dtype)]
    offsets, total = tr._layout(like)
    raw = torch.zeros(total, dtype=torch.uint8)
    for t, at in zip(like, offsets):
        tr._view(raw, at, t).copy_(t)
    for t, at in zip(like, offsets):
        got = tr._view(raw, at, torch.empty_like(t))
        assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t)


def test_check_tensors_errors():
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    fn = "CopyEngineExchange.start"
    with pytest.raises(ValueError, match="1 tensors to send but 2 receive buffers") as info:
        tr._check_tensors(fn, [a], [a, b], None)
    assert info.value.argument == "recv"
    with pytest.raises(ValueError, match="send has 5 tensors; between 1 and 4"):
        tr._check_tensors(fn, [a] * 5, [b] * 5, None)
    with pytest.raises(ValueError, match="send has 0 tensors"):
        tr._check_tensors(fn, [], [], None)
    with pytest.raises(ValueError, match=r"recv\[1\] \(shape \(4, 4\), stride \(1, 4\)\) is not; pass recv\[1\]"):
        tr._check_tensors(fn, [a, a], [b, b.t()], None)
    with pytest.raises(TypeError, match=r"send\[0\] is a list, expected a torch.Tensor"):
        tr._check_tensors(fn, [[1.0]], [b], None)
    with pytest.raises(ValueError, match=r"send\[0\] is on cpu, the exchange runs on meta"):
        tr._check_tensors(fn, [a], [b], torch.device("meta"))
    tr._check_tensors(fn, [a, a, a, a], [b, b, b, b], torch.device("cpu"))   # the accepted case passes


def test_peer_reason():
    ok = [{"host": "h", "device": 0, "reason": None}, {"host": "h", "device": 0, "reason": None}]
    assert tr._peer_reason(0, ok) is None       # equal indices: hidden devices, left to the probe
    bad = [dict(ok[0]), dict(ok[1], reason="this torch build has no symmetric memory")]
    assert tr._peer_reason(0, bad) == "rank 1 of the group: this torch build has no symmetric memory"
    far = [dict(ok[0]), dict(ok[1], host="other")]
    assert "spans several hosts ['h', 'other']" in tr._peer_reason(1, far)
