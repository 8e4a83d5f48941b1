"""The ring engine's communication schedule, counted: what each ``RingExchange.start`` sends, which way, with
which tag, how many bytes, and when relative to the block computations.

Forward: N-1 K/V hops r -> r+1. Backward (blocks visited in reverse order, starting from the K/V block the
forward ended on): N-2 K/V hops r -> r-1 (none with 2 ranks), N-1 dK/dV partial-sum hops r -> r-1 (k's dtype
with 2 ranks, fp32 with more), and nothing issued after the last block's backward computation. The K/V that
travel in the backward are checked by content (hop j sends the block of rank (r + 1 + j) mod N), and each case's out/dq/dk/dv are compared with float64 plain attention, so a schedule that moved the wrong
block would fail twice. One gloo world per world size; each rank loops over the cases.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import ring_kernels as rk
from _dist import run_world
from test_ring_batch import TOLERANCE, VARIANTS, local_positions, reference_attention, relative_error

# (variant, causal, window): causal contiguous ring has empty backward steps (keys after every query), the
# windowed case drops steps through _positional_steps; all must still pass K/V and partial sums along.
CASES = [("ring", False, (-1, -1)), ("ring", True, (-1, -1)), ("zigzag", True, (-1, -1)),
         ("stripe", True, (-1, -1)), ("ring", True, (3, 0))]
B, S, H, HK, D = 1, 6, 8, 2, 16


class _Recorder:
    """Wraps ``RingExchange.start`` and the backend's ``backward``: an ordered log of ("start", tag, reverse,
    [(shape, dtype, nbytes) sent], clones of what was sent) and ("compute",) events."""

    def __init__(self, backend_impl):
        from ring_kernels.comm import RingExchange

        self.events = []
        self._cls, self._start = RingExchange, RingExchange.__dict__["start"]
        self._impl = backend_impl
        recorder = self

        def start(exchange, send, recv):
            payload = [(tuple(t.shape), t.dtype, t.numel() * t.element_size()) for t in send]
            recorder.events.append(("start", exchange.tag, exchange.reverse, payload,
                                    [t.detach().clone() for t in send]))
            return recorder._start(exchange, send, recv)

        def backward(*args, **kwargs):
            recorder.events.append(("compute",))
            return type(backend_impl).backward(backend_impl, *args, **kwargs)

        self._wrapped_start, self._wrapped_backward = start, backward

    def __enter__(self):
        self._cls.start = self._wrapped_start
        self._impl.backward = self._wrapped_backward
        return self

    def __exit__(self, *exc):
        self._cls.start = self._start
        del self._impl.backward            # back to the class's method
        return False

    def mark(self) -> int:
        return len(self.events)


def _starts(events, tag, reverse):
    return [e for e in events if e[0] == "start" and e[1] == tag and e[2] == reverse]


def _check_case(rank, world, variant, causal, window, recorder) -> None:
    fn = VARIANTS[variant][0]
    gen = torch.Generator().manual_seed(11 + world)
    seqlen = S * world
    q, k, v, dout = (torch.randn(B, seqlen, n, D, generator=gen).bfloat16() for n in (H, HK, HK, H))
    pos = [local_positions(variant, j, world, seqlen) for j in range(world)]
    ql, kl, vl = (x[:, pos[rank]].clone().requires_grad_() for x in (q, k, v))

    start = recorder.mark()
    out = fn(ql, kl, vl, causal=causal, backend="torch_cpu", window_size=window)
    middle = recorder.mark()
    grads = torch.autograd.grad(out, (ql, kl, vl), dout[:, pos[rank]])
    forward, backward = recorder.events[start:middle], recorder.events[middle:]
    where = (variant, causal, window, rank, world)

    kv_bytes = 2 * B * S * HK * D * 2                 # k and v, bf16, only the Hk K/V heads
    partial_dtype = torch.bfloat16 if world == 2 else torch.float32
    partial_bytes = 2 * B * S * HK * D * (2 if world == 2 else 4)
    kv_payload = [((B, S, HK, D), torch.bfloat16, kv_bytes // 2)] * 2
    dkv_payload = [((B, S, HK, D), partial_dtype, partial_bytes // 2)] * 2

    # forward: K/V r -> r+1, N-1 hops, nothing else
    assert [e for e in forward if e[0] == "start"] == _starts(forward, 0, False), where
    assert [e[3] for e in _starts(forward, 0, False)] == [kv_payload] * (world - 1), where
    # backward: per direction and tag
    counts = Counter((e[1], e[2]) for e in backward if e[0] == "start")
    expected = {(0, True): world - 2, (1, True): world - 1}
    assert counts == Counter({key: n for key, n in expected.items() if n > 0}), (where, counts)
    kv_hops, dkv_hops = _starts(backward, 0, True), _starts(backward, 1, True)
    assert [e[3] for e in kv_hops] == [kv_payload] * (world - 2 if world > 2 else 0), where
    assert [e[3] for e in dkv_hops] == [dkv_payload] * (world - 1), where
    assert sum(sum(p[2] for p in e[3]) for e in kv_hops) == kv_bytes * max(0, world - 2), where
    assert sum(sum(p[2] for p in e[3]) for e in dkv_hops) == partial_bytes * (world - 1), where
    # backward hop j sends the block it computes on at step j: rank (r + 1 + j)'s (the saved one at j = 0)
    for j, event in enumerate(kv_hops):
        owner = (rank + 1 + j) % world
        assert torch.equal(event[4][0], k[:, pos[owner]]) and torch.equal(event[4][1], v[:, pos[owner]]), \
            (where, j, owner)
    # nothing is issued after the last block's backward computation (no final hop home)
    last_compute = max(i for i, e in enumerate(backward) if e[0] == "compute")
    assert all(e[0] == "compute" for e in backward[last_compute:]), (where, [e[:3] for e in backward])

    # the result is still right: out, dq, dk, dv against float64 plain attention
    qg, kg, vg = (x.double().requires_grad_() for x in (q, k, v))
    ref = reference_attention(qg, kg, vg, causal=causal, scale=D ** -0.5, window=window)
    ref.backward(dout.double())
    tol_out, tol_grad = TOLERANCE[torch.bfloat16]
    for name, got, want, tol in (("out", out, ref, tol_out), ("dq", grads[0], qg.grad, tol_grad),
                                 ("dk", grads[1], kg.grad, tol_grad), ("dv", grads[2], vg.grad, tol_grad)):
        err = relative_error(got, want[:, pos[rank]], torch.bfloat16)
        assert err < tol, (where, name, err)


def _schedule_world(rank: int, world: int) -> None:
    from ring_kernels.backends import get_backend

    impl = get_backend("torch_cpu", device="cpu", dtype=torch.bfloat16, head_dim=D, mask_kind="causal")
    with _Recorder(impl) as recorder:
        for variant, causal, window in CASES:
            _check_case(rank, world, variant, causal, window, recorder)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_communication_schedule(world):
    run_world(world, _schedule_world)
