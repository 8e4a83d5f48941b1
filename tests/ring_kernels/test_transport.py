"""ring_kernels.transport on the CPU: the transport choice (argument, environment, gloo/CPU always NCCL-style P2P),
its errors, the unavailable reason off CUDA, and the copy-engine exchange's pure parts (staging layout, byte
views, tensor checks, peer reasoning). The copy-engine data path itself runs in tests/gpu/test_transport_gpu.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

import ring_kernels as rk
from _dist import run_world
from ring_kernels import options
from ring_kernels import transport as tr
from ring_kernels.comm import RingExchange


@pytest.fixture(autouse=True)
def _options_read_from_this_tests_environment():
    """The options read the environment at their first use: each test starts and ends with nothing read (this
    fixture is set up before the test's monkeypatch, so its teardown runs after the environment is restored)."""
    options.reload_environment()
    yield
    options.reload_environment()


# --- transport choice ------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, expected", [(None, "nccl"), ("", "nccl"), ("nccl", "nccl"),
                                           ("copy_engine", "copy_engine"), (" copy_engine ", "copy_engine")])
def test_transport_from_environment(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv(tr.TRANSPORT_ENV, raising=False)
    else:
        monkeypatch.setenv(tr.TRANSPORT_ENV, env)
    assert tr.transport_choice(None) == expected


def test_argument_overrides_environment(monkeypatch):
    monkeypatch.setenv(tr.TRANSPORT_ENV, "copy_engine")
    assert tr.transport_choice("nccl") == "nccl"


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
    ({"signal": "kernel"}, ValueError, r"signal='kernel' is not one of \('barrier', 'stream_memop'\)"),
])
def test_copy_engine_exchange_argument_errors(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        tr.CopyEngineExchange(**kwargs)


@pytest.mark.parametrize("env, expected", [(None, "barrier"), ("barrier", "barrier"),
                                           ("stream_memop", "stream_memop")])
def test_signal_from_environment(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv(tr.SIGNAL_ENV, raising=False)
    else:
        monkeypatch.setenv(tr.SIGNAL_ENV, env)
    assert tr.signal_choice(None) == expected
    assert tr.signal_choice("barrier") == "barrier"     # the argument wins


def test_unknown_signal_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(tr.SIGNAL_ENV, "spin")
    with pytest.raises(ValueError, match=r"RING_KERNELS_CE_SIGNAL='spin' is not one of .*unset it") as info:
        tr.CopyEngineExchange()
    assert info.value.argument == tr.SIGNAL_ENV


def test_stream_memops_without_a_cuda_driver():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(RuntimeError, match="CUDA driver library cannot be loaded") as info:
            tr.StreamMemOps()
        assert isinstance(info.value, tr.CopyEngineUnavailableError)
    else:
        ops = tr.StreamMemOps()    # a driver is installed: its entry points resolve
        assert ops._wait is not None and ops._write is not None


# --- on a gloo world: make_exchange is RingExchange whatever was asked; CopyEngineExchange's data path on stand-ins

class _FakeStream:
    """A CUDA stream stand-in (CPU work is synchronous): records which events it was made to wait for."""

    def __init__(self):
        self.waited_events = []

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        self.waited_events.append(event)

    def synchronize(self):
        pass


class _FakeEvent:
    def __init__(self):
        self.recorded_on = []

    def record(self, stream=None):
        self.recorded_on.append(stream)

    def query(self):
        return True          # CPU work is done when it is enqueued


class _FakeHandle:
    """A symmetric-memory handle stand-in: rank r's buffer is a shared file every rank maps; barrier is gloo's."""

    def __init__(self, symm, index, nbytes):
        self.symm, self.index, self.nbytes = symm, index, nbytes
        self.rank, self.world_size = symm.rank, symm.world
        self.barriers = []

    def barrier(self, channel, timeout_ms):
        assert isinstance(timeout_ms, int) and timeout_ms > 0, timeout_ms
        self.barriers.append(channel)
        dist.barrier()

    def get_buffer(self, rank, sizes, dtype):
        assert dtype == torch.uint8 and tuple(sizes) == (self.nbytes,), (sizes, dtype)
        return torch.from_file(self.symm.path(self.index, rank), shared=True, size=self.nbytes, dtype=torch.uint8)


class _FakeSymm:
    """``torch.distributed._symmetric_memory`` stand-in for CPU processes (allocation k of rank r: one file)."""

    def __init__(self, root, rank, world):
        self.root, self.rank, self.world, self.count, self.handles = root, rank, world, 0, []

    def path(self, index, rank):
        return f"{self.root}/alloc{index}_rank{rank}"

    def empty(self, nbytes, dtype, device):
        assert dtype == torch.uint8 and device == torch.device("cpu")
        t = torch.from_file(self.path(self.count, self.rank), shared=True, size=nbytes, dtype=torch.uint8)
        t._fake_index, self.count = self.count, self.count + 1
        return t

    def rendezvous(self, tensor, group_name):
        dist.barrier()                  # collective: every rank's file exists after it
        self.handles.append(_FakeHandle(self, tensor._fake_index, tensor.numel()))
        return self.handles[-1]


class _FakeMemOps:
    """cuStreamWaitValue32/WriteValue32 stand-ins: host reads/writes of the shared files' mapped addresses."""

    def write(self, stream, address, value):
        ctypes.c_uint32.from_address(address).value = value & 0xFFFFFFFF

    def wait_geq(self, stream, address, value):
        deadline = time.monotonic() + 60
        while True:
            seen = ctypes.c_uint32.from_address(address).value
            if ((seen - value) & 0xFFFFFFFF) < 0x80000000:     # cyclic >=, as the driver's GEQ
                return
            assert time.monotonic() < deadline, f"flag at {address:#x} stuck at {seen}, waiting for {value}"
            time.sleep(0.0005)


def _install_stand_ins(tr, root, rank, world):
    current = _FakeStream()
    tr.cuda = types.SimpleNamespace(
        is_available=lambda: True, current_device=lambda: 0, Stream=lambda device=None, priority=0: _FakeStream(),
        Event=_FakeEvent, current_stream=lambda device=None: current, stream=lambda s: contextlib.nullcontext(),
        device=lambda d: contextlib.nullcontext(), synchronize=lambda device=None: None)
    tr.exchange_device = lambda: torch.device("cpu")
    symm = _FakeSymm(root, rank, world)
    tr.symmetric_memory = lambda: (symm, None)
    tr.copy_engine_unavailable_reason = lambda group=None, device=None: None
    memops = _FakeMemOps()
    tr.stream_memops = lambda: memops
    return symm, current


def _pattern(src, it, index, shape, dtype):
    n = torch.Size(shape).numel()
    x = torch.arange(n, dtype=torch.int64) * 2654435761 + src * 1000003 + it * 7919 + index * 104729
    return (x % 251).to(dtype).view(shape)


def _make_exchange_cases(rank, world_size):
    """make_exchange on gloo/CPU: RingExchange for every request, data from the right neighbour."""
    out = {"reason_cpu": tr.copy_engine_unavailable_reason(None, torch.device("cpu")),
           "reason_default": tr.copy_engine_unavailable_reason()}   # no CUDA here: the CPU reason, no collective
    os.environ[tr.TRANSPORT_ENV] = "copy_engine"
    options.reload_environment()
    for transport in (None, "nccl", "copy_engine"):
        for reverse in (False, True):
            ex = tr.make_exchange(None, tag=3, reverse=reverse, transport=transport)
            assert type(ex) is RingExchange and ex.tag == 3, (transport, reverse, type(ex))
            src = (rank + 1) % world_size if reverse else (rank - 1) % world_size
            recv = torch.empty(2, 3)
            ex.start([torch.full((2, 3), float(rank * 10 + reverse))], [recv])
            ex.wait()
            assert torch.equal(recv, torch.full((2, 3), float(src * 10 + reverse))), (rank, reverse, recv)
    sub = dist.new_group([0, 1])
    if rank < 2:
        out["reason_subgroup"] = tr.copy_engine_unavailable_reason(sub, torch.device("cpu"))
        assert type(tr.make_exchange(sub, transport="copy_engine")) is RingExchange
    return out


CE_CASES = [   # (shape, dtype) per tensor; sizes grow (the staging grows twice), then shrink
    [((5,), torch.float32)],
    [((3, 7), torch.bfloat16), ((11,), torch.int64), ((2, 2, 3), torch.float64)],
    [((300, 1000), torch.float32), ((1,), torch.int8), ((0, 4), torch.float32), ((9,), torch.bool)],
    [((600, 1000), torch.float16)],
    [((13,), torch.float32)],
]


def _copy_engine_exchange_cases(rank, world, tr, symm, current, signal):
    """CopyEngineExchange's logic (layout, source rank, direction, growth, tags, refusals) on stand-ins, with
    one ``signal`` mode, against the pattern each rank sends and RingExchange's result."""
    cpu = torch.device("cpu")

    def make(**kw):
        return tr.CopyEngineExchange(None, signal=signal, **kw)

    for reverse in (False, True):
        src = (rank + 1) % world if reverse else (rank - 1) % world
        ce = make(tag=0, reverse=reverse)
        assert (ce.send_rank, ce.recv_rank) == (((rank - 1) % world, src) if reverse else ((rank + 1) % world, src))
        try:
            ref = tr.ring_exchange(None, 0, reverse)
        except TypeError:              # RingExchange without reverse yet: compare with the pattern only
            ref = None
        for it, case in enumerate(CE_CASES):
            send = [_pattern(rank, it, i, sh, dt) for i, (sh, dt) in enumerate(case)]
            got = [torch.empty(sh, dtype=dt) for sh, dt in case]
            ce.start(send, got)
            assert ce.in_flight
            staging = tr.staging_for(None, 0, cpu, signal)
            assert staging.done.recorded_on[-1] is staging.stream and staging.owner() is ce
            ce.wait()
            assert current.waited_events[-1] is staging.done and not ce.in_flight and staging.owner is None
            for i, (sh, dt) in enumerate(case):
                assert torch.equal(got[i], _pattern(src, it, i, sh, dt)), (signal, reverse, it, i)
            if ref is not None:
                theirs = [torch.empty(sh, dtype=dt) for sh, dt in case]
                ref.start(send, theirs)
                ref.wait()
                assert all(torch.equal(a, b) for a, b in zip(got, theirs)), (signal, reverse, it)
    staging = tr.staging_for(None, 0, cpu, signal)
    assert staging.capacity == 2 << 20 and staging.seq == 2 * len(CE_CASES)   # 1.2 MB at most so far: 2 MiB
    # growth past 2 MiB: every rank re-allocates in the same call
    allocations = symm.count
    big = [_pattern(rank, 50, 0, (3 << 19,), torch.float32)]            # 6 MiB
    got = [torch.empty_like(big[0])]
    ce = make(tag=0)
    ce.start(big, got)
    ce.wait()
    assert torch.equal(got[0], _pattern((rank - 1) % world, 50, 0, (3 << 19,), torch.float32))
    assert staging.capacity == 6 << 20 and symm.count == allocations + 1
    assert symm.handles[-1].barriers == ([tr.READY, tr.DONE] if signal == "barrier" else [])

    # back to back, one send buffer overwritten after each wait()
    send, recvs = _pattern(rank, 0, 0, (64,), torch.float32), [torch.empty(64) for _ in range(6)]
    for it in range(6):
        ce.start([send], [recvs[it]])
        ce.wait()
        send.copy_(_pattern(rank, it + 1, 0, (64,), torch.float32))
    assert all(torch.equal(recvs[it], _pattern((rank - 1) % world, it, 0, (64,), torch.float32)) for it in range(6))

    # two tags in flight (forward tag 0, reverse tag 1): separate stagings
    kv, dkv = make(tag=0), make(tag=1, reverse=True)
    a, b = _pattern(rank, 70, 0, (8, 4), torch.bfloat16), _pattern(rank, 71, 0, (5,), torch.float32)
    ra, rb = torch.empty_like(a), torch.empty_like(b)
    kv.start([a], [ra])
    dkv.start([b], [rb])
    assert kv.in_flight and dkv.in_flight
    dkv.wait()
    kv.wait()
    assert torch.equal(ra, _pattern((rank - 1) % world, 70, 0, (8, 4), torch.bfloat16))
    assert torch.equal(rb, _pattern((rank + 1) % world, 71, 0, (5,), torch.float32))
    assert tr.staging_for(None, 1, cpu, signal) is not staging

    # refusals: start twice, the same tag from a second object; wait() when idle is a no-op
    first, second = make(tag=0), make(tag=0)
    first.start([a], [ra])
    with pytest.raises(RuntimeError, match="previous exchange was not waited for"):
        first.start([a], [ra])
    with pytest.raises(RuntimeError, match="tag=0 on this group is in flight"):
        second.start([a], [ra])
    first.wait()
    first.wait()
    # an exchange dropped without wait() (an exception unwound its ring) does not hold the tag forever
    lost = make(tag=0)
    lost.start([a], [ra])
    del lost
    second.start([a], [ra])
    second.wait()
    assert torch.equal(ra, _pattern((rank - 1) % world, 70, 0, (8, 4), torch.bfloat16))
    with pytest.raises(ValueError, match=r"recv\[0\] \(shape \(4, 8\)"):
        first.start([a], [torch.empty(8, 4, dtype=torch.bfloat16).t()])
    assert not first.in_flight
    return True


def swap_ring_exchanges(factory):
    """Point every ring_kernels module's exchange constructor at ``factory(group, *, tag, reverse)``: the
    ``RingExchange`` bound by ``from .comm import RingExchange`` (ring.py today) and the ``make_exchange``
    bound from ``.transport`` (once ring.py calls it). Returns (what was swapped, undo)."""
    def via_make_exchange(group=None, *, tag=0, reverse=False, transport=None):
        return factory(group, tag=tag, reverse=reverse)

    originals = {"RingExchange": (RingExchange, factory),
                 "make_exchange": (tr.make_exchange, via_make_exchange)}
    replaced = []
    for key, module in list(sys.modules.items()):
        if not key.startswith("ring_kernels.") or key in ("ring_kernels.comm", "ring_kernels.transport"):
            continue
        for attr, (original, replacement) in originals.items():
            if getattr(module, attr, None) is original:
                setattr(module, attr, replacement)
                replaced.append((module, attr, original))

    def undo():
        for module, attr, original in replaced:
            setattr(module, attr, original)
    return [f"{m.__name__}.{attr}" for m, attr, _ in replaced], undo


def _ring_on_stand_ins(rank, world, signal):
    """ring_attn_func / zigzag_ring_attn_func with ring.py's exchanges swapped for CopyEngineExchange (on the
    stand-ins): out, dq, dk, dv bitwise equal to the RingExchange run (CPU kernels are deterministic)."""
    starts = []

    class Counting(tr.CopyEngineExchange):
        def start(self, send, recv):
            starts.append((self.tag, self.reverse))
            return super().start(send, recv)

    def factory(group=None, *, tag=0, reverse=False):
        return Counting(group, tag=tag, reverse=reverse, signal=signal)

    results = {}
    for name, fn in (("ring", rk.ring_attn_func), ("zigzag", rk.zigzag_ring_attn_func)):
        gen = torch.Generator().manual_seed(7 + rank)
        q, k, v, dout = (torch.randn(1, 12, n, 16, generator=gen) for n in (2, 1, 1, 2))
        for transport in ("nccl", "copy_engine"):
            undo = None
            if transport == "copy_engine":
                swapped, undo = swap_ring_exchanges(factory)
                assert swapped, "no ring_kernels module binds RingExchange or make_exchange"
            try:
                ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
                out = fn(ql, kl, vl, causal=True)
                out.backward(dout)
                results[(name, transport)] = (out.detach(), ql.grad, kl.grad, vl.grad)
            finally:
                if undo is not None:
                    undo()
        for a, b in zip(results[(name, "copy_engine")], results[(name, "nccl")]):
            assert torch.equal(a, b), name
    assert (0, False) in starts and (1, True) in starts, starts   # K/V forward, dK/dV reverse in the backward
    return len(starts)


def _stand_in_world(rank, world, root):
    out = _make_exchange_cases(rank, world)
    symm, current = _install_stand_ins(tr, root, rank, world)
    assert tr.probe(None, torch.device("cpu")) is None
    for signal in tr.SIGNALS:
        out[f"exchange_cases_{signal}"] = _copy_engine_exchange_cases(rank, world, tr, symm, current, signal)
        out[f"ring_starts_{signal}"] = _ring_on_stand_ins(rank, world, signal)
    return out


def test_gloo_world_make_exchange_and_copy_engine_logic_on_stand_ins(tmp_path):
    """One world of 3 (a ring whose next and previous ranks differ): make_exchange on gloo, then
    CopyEngineExchange's whole data path with CPU stand-ins for CUDA streams and symmetric memory."""
    results = run_world(3, _stand_in_world, str(tmp_path))
    for rank, res in enumerate(results):
        keys = ("reason_cpu", "reason_default") + (("reason_subgroup",) if rank < 2 else ())
        for key in keys:
            assert "cpu is not a CUDA device" in res[key], (key, res[key])
        for signal in ("barrier", "stream_memop"):
            assert res[f"exchange_cases_{signal}"] is True and res[f"ring_starts_{signal}"] > 0


# --- pure parts of the copy-engine exchange -------------------------------------------------------------

def test_layout_aligns_every_tensor():
    tensors = [torch.empty(3, dtype=torch.bfloat16), torch.empty(0, dtype=torch.float32),
               torch.empty(2, 5, dtype=torch.float64), torch.empty(1, dtype=torch.uint8)]
    offsets, total = tr.layout(tensors)
    assert offsets == [0, 256, 256, 512] and total == 768
    assert all(o % tr.ALIGN == 0 for o in offsets)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64,
                                   torch.int8, torch.bool])
def test_view_round_trips_bytes(dtype):
    """What one rank writes through view at its offsets is what the other reads back with the same layout."""
    like = [torch.randn(4, 3).to(dtype), torch.randn(7).to(dtype), torch.randn(2, 2, 2).to(dtype)]
    offsets, total = tr.layout(like)
    raw = torch.zeros(total, dtype=torch.uint8)
    for t, at in zip(like, offsets):
        tr.view(raw, at, t).copy_(t)
    for t, at in zip(like, offsets):
        got = tr.view(raw, at, torch.empty_like(t))
        assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t)


def test_check_tensors_errors():
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    fn = "CopyEngineExchange.start"
    with pytest.raises(ValueError, match="1 tensors to send but 2 receive buffers") as info:
        tr.check_tensors(fn, [a], [a, b], None)
    assert info.value.argument == "recv"
    with pytest.raises(ValueError, match="send has 5 tensors; between 1 and 4"):
        tr.check_tensors(fn, [a] * 5, [b] * 5, None)
    with pytest.raises(ValueError, match="send has 0 tensors"):
        tr.check_tensors(fn, [], [], None)
    with pytest.raises(ValueError, match=r"recv\[1\] \(shape \(4, 4\), stride \(1, 4\)\) is not; pass recv\[1\]"):
        tr.check_tensors(fn, [a, a], [b, b.t()], None)
    with pytest.raises(TypeError, match=r"send\[0\] is a list, expected a torch.Tensor"):
        tr.check_tensors(fn, [[1.0]], [b], None)
    with pytest.raises(ValueError, match=r"send\[0\] is on cpu, the exchange runs on meta"):
        tr.check_tensors(fn, [a], [b], torch.device("meta"))
    tr.check_tensors(fn, [a, a, a, a], [b, b, b, b], torch.device("cpu"))   # the accepted case passes


def test_peer_reason():
    ok = [{"host": "h", "device": 0, "reason": None}, {"host": "h", "device": 0, "reason": None}]
    assert tr.peer_reason(0, ok) is None       # equal indices: hidden devices, left to the probe
    bad = [dict(ok[0]), dict(ok[1], reason="this torch build has no symmetric memory")]
    assert tr.peer_reason(0, bad) == "rank 1 of the group: this torch build has no symmetric memory"
    far = [dict(ok[0]), dict(ok[1], host="other")]
    assert "spans several hosts ['h', 'other']" in tr.peer_reason(1, far)
