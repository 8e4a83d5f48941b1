"""CopyEngineExchange (ring_kernels/transport.py) on real GPUs, against RingExchange (NCCL) and known patterns.

    python -m pytest -s tests/gpu/test_transport_gpu.py     # spawns NCCL worlds of 2 (and 4 with 4 GPUs)

Every test runs once per signal mode of CopyEngineExchange: "barrier" (torch's barrier kernel) and
"stream_memop" (cuStreamWaitValue32/WriteValue32, no SM). Each rank prints what it is doing
(``[ce rank r] ...``, flushed) so one log shows where a failure or a hang happened; barriers time out after
TIMEOUT_MS (the kernel traps: a CUDA error instead of a hang); stream_memop has no device timeout, but its
first use probes the signal path with a host-side 60 s limit, and run_world stops a world after 400 s.

What is checked (every comparison bitwise, on the integer view of the bytes):
- exchanges of 1-4 tensors of bf16/fp32 (and int8, float64), sizes from 1 element to 32 MiB (K+V of 8192
  tokens x 8 heads x 128), forward and reverse, across staging growth, against the expected pattern (each rank
  sends values depending on its rank, the iteration and the tensor index) and against RingExchange's result;
- 24 exchanges back to back without a host sync, one send buffer overwritten right after each wait() (send
  may be reused) and fresh receive buffers, checked after one synchronize at the end;
- two tags in flight at once (tag 0 forward, tag 1 reverse, as K/V and dK/dV in the backward);
- a second exchange of the same tag while one is in flight is refused (RuntimeError), and the state survives;
- ring_attn_func / zigzag_ring_attn_func (bf16) with ring.py's exchanges swapped for CopyEngineExchange:
  the forward output equals the NCCL run's bit for bit (same kernels on the same bytes); dq/dk/dv agree to
  bf16 rounding (relative norm error <= 1e-2, backward kernels may accumulate with atomics) and the test
  prints whether they are bitwise equal too; the swap is proven by counting CopyEngineExchange starts.
"""
from __future__ import annotations

import statistics
import sys

import pytest
import torch
import torch.distributed as dist

import ring_kernels as rk
from _dist import run_world
from ring_kernels import transport as tr
from ring_kernels.comm import RingExchange
from test_transport import swap_ring_exchanges   # the CPU suite's swap (RingExchange or make_exchange bindings)

pytestmark = [pytest.mark.gpu]

TIMEOUT_MS = 60_000
ITERATIONS = 24
KV_32MB = (1, 8192, 8, 128)     # one of K/V: 16 MiB in bf16


def _log(rank, *msg):
    print(f"[ce rank {rank}]", *msg, flush=True)
    sys.stdout.flush()


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _pattern(src: int, it: int, index: int, shape, dtype, device) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` whose bytes depend on the sending rank, the iteration and the tensor's
    index, built as integers and viewed as ``dtype`` (every bit pattern, NaNs included, compared bitwise)."""
    n = 1
    for s in shape:
        n *= s
    size = torch.empty((), dtype=dtype).element_size()
    bits = 8 * size
    x = torch.arange(n, device=device, dtype=torch.int64) * 2654435761 + src * 1000003 + it * 7919 + index * 104729
    if bits < 64:
        x = x % (1 << bits) - (1 << (bits - 1))
    return x.to(_INT_VIEW[size]).view(dtype).view(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


# Each case: a list of (shape, dtype) per tensor. Sizes grow (the staging grows), then shrink.
CASES = [
    [((1,), torch.bfloat16)],
    [((3, 5), torch.float32), ((7,), torch.bfloat16)],
    [((4097,), torch.bfloat16), ((129, 3), torch.float32), ((5,), torch.int8), ((2, 3), torch.float64)],
    [((64, 1024), torch.float32)],
    [(KV_32MB, torch.bfloat16), (KV_32MB, torch.bfloat16)],     # K and V: 32 MiB
    [((2, 4096, 8, 128), torch.float32)],                        # 32 MiB in one fp32 tensor
    [((17,), torch.float32)],
]


def _run_pair(ex_ce, ex_ref, rank, world, case, it, reverse, device):
    """One exchange of ``case`` with both transports; returns a list of failure strings."""
    src = (rank + 1) % world if reverse else (rank - 1) % world
    send = [_pattern(rank, it, i, shape, dt, device) for i, (shape, dt) in enumerate(case)]
    got = {}
    for name, ex in (("copy_engine", ex_ce), ("nccl", ex_ref)):
        recv = [torch.empty(shape, dtype=dt, device=device) for shape, dt in case]
        ex.start(send, recv)
        ex.wait()
        got[name] = recv
    torch.cuda.synchronize(device)
    failures = []
    for i, (shape, dt) in enumerate(case):
        want = _pattern(src, it, i, shape, dt, device)
        for name in got:
            if not _same(got[name][i], want):
                bad = int((_bits(got[name][i]) != _bits(want)).sum())
                failures.append(f"{name} reverse={reverse} tensor {i} {tuple(shape)} {dt}: {bad} of "
                                f"{want.numel()} elements differ from rank {src}'s pattern")
    return failures


def _exchange_cases(rank, world, signal):
    from torch.distributed import _symmetric_memory as symm

    device = torch.device("cuda", torch.cuda.current_device())
    _log(rank, f"signal={signal}")
    _log(rank, f"torch {torch.__version__} cuda {torch.version.cuda} device {torch.cuda.get_device_name(device)}")
    reason = tr.copy_engine_unavailable_reason(None, device)
    _log(rank, f"copy_engine_unavailable_reason: {reason!r}; symmetric-memory backend "
               f"{symm.get_backend(device) if hasattr(symm, 'get_backend') else '?'}")
    assert reason is None, reason
    failures = []

    # 1. every case, both directions, against the pattern and RingExchange
    for reverse in (False, True):
        ce = tr.CopyEngineExchange(None, signal=signal, tag=0, reverse=reverse, timeout_ms=TIMEOUT_MS)
        ref = tr.ring_exchange(None, 0, reverse)     # NCCL P2P, same direction
        for c, case in enumerate(CASES):
            _log(rank, f"case {c} reverse={reverse}: {[(tuple(s), str(d)) for s, d in case]}")
            failures += _run_pair(ce, ref, rank, world, case, c, reverse, device)
    _log(rank, f"cases done, staging capacity {tr.staging_for(None, 0, device, signal).capacity} bytes")

    # 2. back to back without a host sync; send overwritten right after each wait()
    ce = tr.CopyEngineExchange(None, signal=signal, tag=0, timeout_ms=TIMEOUT_MS)
    shape = KV_32MB
    send = torch.empty(shape, dtype=torch.bfloat16, device=device)
    recvs = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(ITERATIONS)]
    send.copy_(_pattern(rank, 0, 0, shape, torch.bfloat16, device))
    for it in range(ITERATIONS):
        ce.start([send], [recvs[it]])
        torch.cuda._sleep(20_000)                # the "compute" the transfer hides behind (~10 us)
        ce.wait()
        send.copy_(_pattern(rank, it + 1, 0, shape, torch.bfloat16, device))   # reuse send at once
    torch.cuda.synchronize(device)
    src = (rank - 1) % world
    for it in range(ITERATIONS):
        if not _same(recvs[it], _pattern(src, it, 0, shape, torch.bfloat16, device)):
            failures.append(f"back-to-back iteration {it}: received data is not rank {src}'s iteration {it}")
    _log(rank, f"{ITERATIONS} back-to-back exchanges checked")

    # 3. two tags in flight: tag 0 forward (K/V), tag 1 reverse (dK/dV)
    kv = tr.CopyEngineExchange(None, signal=signal, tag=0, timeout_ms=TIMEOUT_MS)
    dkv = tr.CopyEngineExchange(None, signal=signal, tag=1, reverse=True, timeout_ms=TIMEOUT_MS)
    case = [((1, 4096, 8, 128), torch.bfloat16), ((1, 4096, 8, 128), torch.bfloat16)]
    results = []
    for it in range(8):
        s0 = [_pattern(rank, 100 + it, i, sh, dt, device) for i, (sh, dt) in enumerate(case)]
        s1 = [_pattern(rank, 200 + it, i, sh, torch.float32, device) for i, (sh, dt) in enumerate(case)]
        r0 = [torch.empty_like(t) for t in s0]
        r1 = [torch.empty_like(t) for t in s1]
        kv.start(s0, r0)
        dkv.start(s1, r1)
        assert kv.in_flight and dkv.in_flight
        if it % 2:
            kv.wait(); dkv.wait()
        else:
            dkv.wait(); kv.wait()
        results.append((it, r0, r1))
    torch.cuda.synchronize(device)
    for it, r0, r1 in results:
        for i, (sh, dt) in enumerate(case):
            if not _same(r0[i], _pattern((rank - 1) % world, 100 + it, i, sh, dt, device)):
                failures.append(f"two tags, iteration {it}: tag 0 tensor {i} wrong")
            if not _same(r1[i], _pattern((rank + 1) % world, 200 + it, i, sh, torch.float32, device)):
                failures.append(f"two tags, iteration {it}: tag 1 tensor {i} wrong")
    _log(rank, "two tags in flight checked")

    # 4. the same tag twice in flight is refused, and the first exchange still completes
    first, second = (tr.CopyEngineExchange(None, signal=signal, tag=2, timeout_ms=TIMEOUT_MS) for _ in range(2))
    x = _pattern(rank, 300, 0, (1000,), torch.float32, device)
    y, z = torch.empty_like(x), torch.empty_like(x)
    first.start([x], [y])
    with pytest.raises(RuntimeError, match="tag=2 on this group is in flight"):
        second.start([x], [z])
    assert not second.in_flight
    first.wait()
    second.start([x], [z])
    second.wait()
    torch.cuda.synchronize(device)
    for name, t in (("first", y), ("second", z)):
        if not _same(t, _pattern((rank - 1) % world, 300, 0, (1000,), torch.float32, device)):
            failures.append(f"same-tag refusal: the {name} exchange delivered wrong data")

    # 5. informational: one 32 MiB exchange alone, each transport (medians of 20, CUDA events)
    times = {}
    k, v = (torch.randn(KV_32MB, device=device).to(torch.bfloat16) for _ in range(2))
    rk, rv = torch.empty_like(k), torch.empty_like(v)
    for name, ex in (("copy_engine", tr.CopyEngineExchange(None, signal=signal, tag=0, timeout_ms=TIMEOUT_MS)),
                     ("nccl", RingExchange(None, tag=0))):
        samples = []
        for i in range(25):
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            ex.start([k, v], [rk, rv])
            ex.wait()
            b.record()
            torch.cuda.synchronize(device)
            if i >= 5:
                samples.append(a.elapsed_time(b))
        times[name] = statistics.median(samples)
    _log(rank, "32 MiB exchange alone, median ms: " + ", ".join(f"{n} {t:.3f}" for n, t in times.items()))
    for f in failures:
        _log(rank, "FAIL", f)
    return {"failures": failures, "times": times}


@pytest.mark.parametrize("signal", ["barrier", "stream_memop"])
@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_exchange_matches_patterns_and_nccl(world, signal):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    results = run_world(world, _exchange_cases, signal, backend="nccl", timeout=400)
    for rank, res in enumerate(results):
        print(f"rank {rank}: 32 MiB alone (ms) {res['times']}")
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------------- the ring on copy engines

def _relative(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _ring_cases(rank, world, signal):
    device = torch.device("cuda", torch.cuda.current_device())
    starts = {"n": 0}

    class Counting(tr.CopyEngineExchange):
        def start(self, send, recv):
            starts["n"] += 1
            return super().start(send, recv)

    def factory(group=None, *, tag=0, reverse=False):
        return Counting(group, tag=tag, reverse=reverse, timeout_ms=TIMEOUT_MS, signal=signal)

    report, failures = [], []
    for name, fn, causal in (("zigzag", rk.zigzag_ring_attn_func, True), ("ring", rk.ring_attn_func, True),
                             ("ring", rk.ring_attn_func, False)):
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        b, s, h, hk, d = 1, 512, 8, 2, 64
        q, k, v, dout = (torch.randn(b, s, n, d, device=device, generator=gen).to(torch.bfloat16)
                         for n in (h, hk, hk, h))
        runs = {}
        for transport in ("nccl", "copy_engine"):
            undo = None
            if transport == "copy_engine":
                swapped, undo = swap_ring_exchanges(factory)
                _log(rank, f"{name} causal={causal}: exchanges swapped: {swapped}")
            try:
                before = starts["n"]
                ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))
                out = fn(ql, kl, vl, causal=causal)
                out.backward(dout)
                torch.cuda.synchronize(device)
                runs[transport] = (out.detach(), ql.grad, kl.grad, vl.grad)
                if transport == "copy_engine" and starts["n"] == before:
                    failures.append(f"{name} causal={causal}: no CopyEngineExchange start: the swap missed")
            finally:
                if undo is not None:
                    undo()
        ref, got = runs["nccl"], runs["copy_engine"]
        if not _same(got[0], ref[0]):
            failures.append(f"{name} causal={causal}: forward output differs from NCCL's "
                            f"(relative {_relative(got[0], ref[0]):.2e}); same kernels on the same bytes must agree")
        for label, g, r in zip(("dq", "dk", "dv"), got[1:], ref[1:]):
            err = _relative(g, r)
            report.append(f"{name} causal={causal} {label}: bitwise={_same(g, r)} relative={err:.2e}")
            if not err <= 1e-2:
                failures.append(f"{name} causal={causal} {label}: relative error {err:.2e} > 1e-2 vs NCCL")
    for line in report:
        _log(rank, line)
    _log(rank, f"CopyEngineExchange starts: {starts['n']}")
    return {"failures": failures, "report": report}


@pytest.mark.parametrize("signal", ["barrier", "stream_memop"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_on_copy_engines_matches_nccl(world, signal):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    results = run_world(world, _ring_cases, signal, backend="nccl", timeout=400)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert not failures, "\n".join(failures)
