"""ring / zigzag / stripe attention (batch layout) against plain float64 softmax(QK^T)V, forward and backward.

One gloo world per world size; each rank loops over a table of cases (variant x causal x backend x dtype x
GQA x head dim x window/softcap). Every case builds the *global* q, k, v from a seed (identical on all
ranks), runs the reference on the unsharded tensors, runs the ring on this rank's shard, and compares this
rank's slice of out, dq, dk, dv. Local shards are taken with positions written here (not ring_kernels.shard),
so the layouts are checked independently. The same worlds count the engine's communication schedule (every
``RingExchange.start``: direction, tag, bytes, content, order against the block computations).
"""
from __future__ import annotations

import itertools
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import ring_kernels as rk
from ring_kernels import comm, engine, options
from ring_kernels.backends import get_backend
from ring_kernels.comm import RingExchange
from ring_kernels.ring import ring_steps
from ring_kernels.stripe import stripe_steps
from ring_kernels.tolerances import Tolerance, assert_close, tolerance
from ring_kernels.zigzag import zigzag_steps
from _alloc import fp32_factories
from _dist import run_world
from _paths import BENCHMARKS

VARIANTS = {  # name -> (function, causal options)
    "ring": (rk.ring_attn_func, (False, True)),
    "zigzag": (rk.zigzag_ring_attn_func, (True,)),
    "stripe": (rk.stripe_attn_func, (True,)),
}


# ------------------------------------------------------------------------------------------ reference

def reference_attention(q, k, v, *, causal, scale, window=(-1, -1), softcap=0.0):
    """Plain attention in float64 on global tensors (B, S, H, D); K/V heads repeated for GQA."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(q.shape[1])
    visible = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool)
    if causal:
        visible &= pos[None, :] <= pos[:, None]
    if window[0] >= 0:
        visible &= pos[None, :] >= pos[:, None] - window[0]
    if window[1] >= 0:
        visible &= pos[None, :] <= pos[:, None] + window[1]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)


def local_positions(layout: str, rank: int, world: int, seqlen: int) -> torch.Tensor:
    """Global positions held by ``rank`` (written independently of ring_kernels.layout)."""
    if layout == "ring":
        local = seqlen // world
        return torch.arange(rank * local, (rank + 1) * local)
    if layout == "zigzag":
        chunk = seqlen // (2 * world)
        first = torch.arange(rank * chunk, (rank + 1) * chunk)
        second_start = (2 * world - 1 - rank) * chunk
        return torch.cat([first, torch.arange(second_start, second_start + chunk)])
    return torch.arange(rank, seqlen, world)  # stripe


def kernel_tolerance(dtype: torch.dtype, name: str) -> Tolerance:
    """The table's kernel-vs-float64 entry for ``name`` (out, or a gradient dq/dk/dv) of ``dtype``."""
    return tolerance("kernel", dtype, "out" if name == "out" else "grad")


def run_case(rank: int, world: int, case: dict, group=None, group_rank=None, group_world=None) -> None:
    """Run one case on this rank and assert out, dq, dk, dv match the float64 reference."""
    grank = rank if group_rank is None else group_rank
    gworld = world if group_world is None else group_world
    fn, _ = VARIANTS[case["variant"]]
    b, heads, heads_k, d, dtype = case["batch"], case["heads"], case["heads_k"], case["headdim"], case["dtype"]
    seqlen = case["seqlen_local"] * gworld
    gen = torch.Generator().manual_seed(case["seed"])
    q, k, v, dout = (torch.randn(b, seqlen, h, d, generator=gen).to(dtype) for h in (heads, heads_k, heads_k, heads))
    qg, kg, vg = (x.double().requires_grad_() for x in (q, k, v))
    scale = case.get("scale", d ** -0.5)
    window, softcap = case.get("window", (-1, -1)), case.get("softcap", 0.0)
    ref = reference_attention(qg, kg, vg, causal=case["causal"], scale=scale, window=window, softcap=softcap)
    ref.backward(dout.double())

    pos = local_positions(case["variant"], grank, gworld, seqlen)
    ql, kl, vl = (x[:, pos].detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(ql, kl, vl, group=group, causal=case["causal"], softmax_scale=case.get("scale"),
             backend=case["backend"], window_size=window, softcap=softcap)
    out.backward(dout[:, pos])
    assert out.dtype == dtype and ql.grad.dtype == dtype and kl.grad.dtype == dtype
    for name, got, want in (("out", out, ref), ("dq", ql.grad, qg.grad), ("dk", kl.grad, kg.grad),
                            ("dv", vl.grad, vg.grad)):
        assert torch.isfinite(got).all(), f"{name} has NaN/Inf in case {case}"
        assert_close(got, want[:, pos], kernel_tolerance(dtype, name), f"rank {rank}: {name} in case {case}")


# ------------------------------------------------------------------------------------------ case table

def standard_cases(world: int):
    """variant x causal x backend x dtype x (MHA | GQA), head dims and local lengths rotating over the table."""
    head_dims = itertools.cycle([64, 128, 80])
    lengths = itertools.cycle([6, 10, 12])          # not powers of two; even (zigzag needs two chunks)
    cases = []
    for variant, (_, causals) in VARIANTS.items():
        for causal, backend, dtype, (heads, heads_k) in itertools.product(
                causals, ("reference", "torch_cpu"), (torch.float32, torch.bfloat16), ((4, 4), (8, 2))):
            cases.append(dict(variant=variant, causal=causal, backend=backend, dtype=dtype, heads=heads,
                              heads_k=heads_k, headdim=next(head_dims), seqlen_local=next(lengths), batch=2,
                              seed=len(cases) + 100 * world))
    return cases


def extension_cases(world: int):
    """Sliding window (every variant; both CPU backends) and softcap (reference, and 'auto' picking it)."""
    cases = []
    base = dict(dtype=torch.float32, heads=8, heads_k=2, headdim=64, seqlen_local=10, batch=1)
    for variant, (_, causals) in VARIANTS.items():
        for causal in causals:
            window = (5, 0) if causal else (4, 3)
            for backend in ("reference", "torch_cpu"):
                cases.append(dict(base, variant=variant, causal=causal, backend=backend, window=window))
            cases.append(dict(base, variant=variant, causal=causal, backend="auto", softcap=3.0, scale=0.3))
    cases.append(dict(base, variant="zigzag", causal=True, backend="auto", softcap=2.0, window=(7, 0),
                      dtype=torch.bfloat16))
    for i, case in enumerate(cases):
        case["seed"] = 1000 + i + 100 * world
    return cases


def _world_cases(rank: int, world: int, cases) -> None:
    for case in cases:
        run_case(rank, world, case)
    if world == 2:
        _ranks_that_disagree_fail_together(rank)
        _bf16_rounded_once(rank, world)
    if world >= 2:
        _communication_schedule(rank, world)
    if world in (2, 3):
        _fp32_buffers(rank, world)
        _count_blocks(rank, world)
        _backward_twice(rank, world)
    if world == 4:
        _subgroups(rank)


def _ranks_that_disagree_fail_together(rank: int) -> None:
    """Different local lengths (or options) on different ranks: every rank raises, naming the field."""
    q = torch.randn(1, 6 + 2 * rank, 4, 64)
    with pytest.raises(ValueError, match=r"seqlen_local \(rank 0: 6, rank 1: 8\)") as info:
        rk.zigzag_ring_attn_func(q, q, q)
    assert (info.value.argument, info.value.value) == ("seqlen_local", [6, 8])
    q = torch.randn(1, 6, 4, 64)
    with pytest.raises(ValueError, match=r"ranks disagree on causal"):
        rk.ring_attn_func(q, q, q, causal=bool(rank))


def _bf16_rounded_once(rank: int, world: int) -> None:
    """With 2 ranks every row gets <= 2 contributions, and the ring rounds each value to bf16 exactly once: out,
    dq, dk, dv equal an fp32-accumulated reference written here (the same blocks from the same backend, merged
    and summed in fp32, cast once). Grads bit for bit; out to the bf16 rounding (fp32 operation order may move
    a handful of ties by one ulp), whereas a bf16 intermediate would change a large fraction of the values."""
    steps_of = {"ring": ring_steps, "zigzag": zigzag_steps, "stripe": stripe_steps}
    impl = get_backend("torch_cpu", device="cpu", dtype=torch.bfloat16, head_dim=64, mask_kind="causal")
    b, s, h, hk, d, scale = 2, 10, 8, 2, 64, 0.125
    for variant, causal in (("ring", False), ("ring", True), ("zigzag", True), ("stripe", True)):
        gen = torch.Generator().manual_seed(77)
        q, k, v, dout = (torch.randn(b, s * world, n, d, generator=gen).bfloat16() for n in (h, hk, hk, h))
        pos = [local_positions(variant, r, world, s * world) for r in range(world)]
        ql, kl, vl = (x[:, pos[rank]].clone().requires_grad_() for x in (q, k, v))
        out = VARIANTS[variant][0](ql, kl, vl, causal=causal, softmax_scale=scale, backend="torch_cpu")
        grads = torch.autograd.grad(out, (ql, kl, vl), dout[:, pos[rank]])
        assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)

        blocks = [((rank - step) % world, blk) for step, blk_list in
                  enumerate(steps_of[variant](rank, world, s, causal, (-1, -1))) for blk in blk_list]
        kv_of = lambda owner, blk: (k[:, pos[owner]][:, blk.kv_rows], v[:, pos[owner]][:, blk.kv_rows])  # noqa: E731
        acc = torch.zeros(b, s, h, d)
        lse = torch.full((b, h, s), float("-inf"))
        for owner, blk in blocks:                         # forward: fp32 accumulator, plain LSE merge
            o, l = impl.forward(ql.detach()[:, blk.q_rows], *kv_of(owner, blk), scale=scale, mask=blk.mask)
            new = torch.logaddexp(lse[:, :, blk.q_rows], l)
            weight = lambda x: torch.exp(x - new).transpose(1, 2).unsqueeze(-1)   # noqa: E731
            acc[:, blk.q_rows] = acc[:, blk.q_rows] * weight(lse[:, :, blk.q_rows]) + o.float() * weight(l)
            lse[:, :, blk.q_rows] = new
        want = acc.bfloat16()
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert bool(((out.float() - want.float()).abs() <= ulp).all()), (variant, causal)
        assert (out != want).float().mean() < 1e-3, (variant, causal, float((out != want).float().mean()))

        dq = torch.zeros(b, s, h, d)
        dkv = torch.zeros(2, world, b, s, hk, d)          # [dk|dv, owner]: every rank's contributions, fp32
        for owner, blk in blocks:                         # backward of each block from the merged out/lse
            gq, gk, gv = impl.backward(dout[:, pos[rank]][:, blk.q_rows], ql.detach()[:, blk.q_rows],
                                       *kv_of(owner, blk), out.detach()[:, blk.q_rows], lse[:, :, blk.q_rows],
                                       scale=scale, mask=blk.mask)
            dq[:, blk.q_rows] += gq.float()
            dkv[0, owner][:, blk.kv_rows] += gk.float()
            dkv[1, owner][:, blk.kv_rows] += gv.float()
        dist.all_reduce(dkv)
        for name, got, ref in (("dq", grads[0], dq), ("dk", grads[1], dkv[0, rank]), ("dv", grads[2], dkv[1, rank])):
            mismatch = float((got != ref.bfloat16()).float().mean())
            assert mismatch == 0.0, (variant, causal, name, mismatch)


def _fp32_buffers(rank: int, world: int) -> None:
    """Count the fp32 buffers the engine allocates (factory ops of at least one K/V tensor's size) in a bf16
    forward + backward: none with 2 ranks (every row gets <= 2 contributions), and some with 3 (the dK/dV
    partial sums of the middle hop, and the output/dq accumulators of rows with 3 contributions)."""
    b, s, h, hk, d = 1, 6, 8, 2, 64
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(b, s, h, d, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(b, s, hk, d, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    for variant, causal in (("ring", False), ("zigzag", True), ("stripe", True)):
        with fp32_factories() as seen:
            out = VARIANTS[variant][0](q, k, v, causal=causal, backend="torch_cpu")
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        big = [(op, shape) for op, shape, numel in seen.fp32 if numel >= k.numel()]
        if world == 2:
            assert big == [], (variant, rank, big)
        elif variant == "ring":                      # N = 3: the middle hop's dK/dV partial sums are fp32
            assert ("aten.empty.memory_format", (b, s, hk, d)) in big, (variant, rank, big)


def _count_blocks(rank: int, world: int) -> None:
    """The blocks each rank computes, by kind and size: causal ring does r+1 blocks on rank r (the imbalance
    zigzag and stripe exist to remove); zigzag and stripe do N blocks on every rank, of equal total work; and
    no standard block needs a dense mask (FULL or aligned CAUSAL only)."""
    impl = get_backend("torch_cpu", device="cpu", dtype=torch.float32, head_dim=64, mask_kind="causal")
    calls = []
    original = impl.forward

    def counting(q, k, v, *, scale, mask, softcap=0.0):
        calls.append((mask.kind(q.shape[1], k.shape[1]), q.shape[1], k.shape[1]))
        return original(q, k, v, scale=scale, mask=mask, softcap=softcap)

    s = 6
    q = torch.randn(1, s, 4, 64)
    expected = {
        "ring": [("causal", s, s)] + [("full", s, s)] * rank,
        "zigzag": [("causal", s, s)] + [("full", s, s // 2) if (rank - i) % world < rank else ("full", s // 2, s)
                                        for i in range(1, world)],
        "stripe": [("causal", s, s) if (rank - i) % world <= rank else ("causal", s - 1, s - 1) for i in range(world)],
    }
    impl.forward = counting
    try:
        for variant, want in expected.items():
            calls.clear()
            VARIANTS[variant][0](q, q, q, causal=True, backend="torch_cpu")
            assert calls == want, (variant, rank, calls)
    finally:
        del impl.forward            # back to the class's method


def _backward_twice(rank: int, world: int) -> None:
    """With 2 ranks the backward receives its dK/dV partial sum into the kept last K/V block of the forward (one
    buffer less at the peak); a second backward through the same graph (retain_graph=True) fetches that block again
    (one more K/V hop) and returns the same gradients, bit for bit. With 3 ranks nothing is reused or refetched."""
    starts = []
    original = comm.RingExchange.start

    def recording(self, send, recv):
        starts.append((self.tag, self.reverse, [r.data_ptr() for r in recv]))
        return original(self, send, recv)

    comm.RingExchange.start = recording
    try:
        for variant, causal, dtype in (("zigzag", True, torch.bfloat16), ("ring", False, torch.float32)):
            gen = torch.Generator().manual_seed(31 + rank)
            q, k, v, dout = (torch.randn(1, 8, n, 16, generator=gen).to(dtype) for n in (4, 2, 2, 4))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            starts.clear()
            out = VARIANTS[variant][0](q, k, v, causal=causal, backend="torch_cpu")
            forward_recv = [s for s in starts if s[0] == 0 and not s[1]][-1][2]    # the last block's buffers
            starts.clear()
            first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            first_starts = list(starts)
            starts.clear()
            second = torch.autograd.grad(out, (q, k, v), dout)
            for a, b in zip(first, second):
                assert torch.equal(a, b), (variant, rank)
            kv_hops = lambda events: [s for s in events if s[0] == 0]    # noqa: E731
            dkv = [s for s in first_starts if s[0] == 1]
            if world == 2:
                assert kv_hops(first_starts) == [] and len(dkv) == 1
                assert dkv[0][2] == forward_recv, "the partial sum is received into the kept K/V block"
                assert [(t, r) for t, r, _ in kv_hops(starts)] == [(0, True)], starts   # fetched again
            else:
                assert all(p not in forward_recv for s in dkv for p in s[2])
                assert len(kv_hops(starts)) == len(kv_hops(first_starts)) == world - 2
    finally:
        comm.RingExchange.start = original


def _subgroups(rank: int) -> None:
    """Two independent rings {0, 2} and {1, 3}: ring neighbours are mapped from group ranks to global ranks."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    for variant, causal in (("ring", False), ("zigzag", True), ("stripe", True)):
        case = dict(variant=variant, causal=causal, backend="torch_cpu", dtype=torch.float32, heads=8, heads_k=2,
                    headdim=64, seqlen_local=6, batch=1, seed=7 + rank % 2)
        run_case(rank, 4, case, group=group, group_rank=rank // 2, group_world=2)


# ------------------------------------------------------------------------------ communication schedule
# What each RingExchange.start sends, which way, with which tag, how many bytes, and when relative to the block
# computations. Forward: N-1 K/V hops r -> r+1. Backward (blocks visited in reverse order, starting from the
# K/V block the forward ended on): N-2 K/V hops r -> r-1 (none with 2 ranks), N-1 dK/dV partial-sum hops
# r -> r-1 (k's dtype with 2 ranks, fp32 with more), nothing issued after the last block's backward compute.
# The K/V that travel in the backward are checked by content (hop j sends the block of rank (r + 1 + j) mod N)
# and each case's out/dq/dk/dv against float64 plain attention. Runs inside the worlds of 2, 3, 4 ranks above.

# (variant, causal, window): causal contiguous ring has empty backward steps (keys after every query), the
# windowed case drops steps through _positional_steps; all must still pass K/V and partial sums along.
SCHEDULE_CASES = [("ring", False, (-1, -1)), ("ring", True, (-1, -1)), ("zigzag", True, (-1, -1)),
                  ("stripe", True, (-1, -1)), ("ring", True, (3, 0))]
_B, _S, _H, _HK, _D = 1, 6, 8, 2, 16
_BENCH = str(BENCHMARKS)


class _Recorder:
    """Wraps ``RingExchange.start`` and the backend's ``backward``: an ordered log of ("start", tag, reverse,
    [(shape, dtype, nbytes) sent], clones of what was sent) and ("compute",) events."""

    def __init__(self, backend_impl):
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


def _check_schedule_case(rank, world, variant, causal, window, recorder) -> None:
    """One bf16 GQA case: its exchanges (forward, backward) and its result against float64 attention."""
    fn = VARIANTS[variant][0]
    gen = torch.Generator().manual_seed(11 + world)
    seqlen = _S * world
    q, k, v, dout = (torch.randn(_B, seqlen, n, _D, generator=gen).bfloat16() for n in (_H, _HK, _HK, _H))
    pos = [local_positions(variant, j, world, seqlen) for j in range(world)]
    ql, kl, vl = (x[:, pos[rank]].clone().requires_grad_() for x in (q, k, v))

    start = recorder.mark()
    out = fn(ql, kl, vl, causal=causal, backend="torch_cpu", window_size=window)
    middle = recorder.mark()
    # the forward keeps the block it ended on (rank r+1's K/V) for the backward's first step: one K/V block
    saved = out.grad_fn.saved_tensors
    nxt = (rank + 1) % world
    assert len(saved) == 7 and torch.equal(saved[5], k[:, pos[nxt]]) and torch.equal(saved[6], v[:, pos[nxt]])
    grads = torch.autograd.grad(out, (ql, kl, vl), dout[:, pos[rank]])
    forward, backward = recorder.events[start:middle], recorder.events[middle:]
    where = (variant, causal, window, rank, world)

    kv_bytes = 2 * _B * _S * _HK * _D * 2                 # k and v, bf16, only the Hk K/V heads
    partial_dtype = torch.bfloat16 if world == 2 else torch.float32
    partial_bytes = 2 * _B * _S * _HK * _D * (2 if world == 2 else 4)
    kv_payload = [((_B, _S, _HK, _D), torch.bfloat16, kv_bytes // 2)] * 2
    dkv_payload = [((_B, _S, _HK, _D), partial_dtype, partial_bytes // 2)] * 2

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
    ref = reference_attention(qg, kg, vg, causal=causal, scale=_D ** -0.5, window=window)
    ref.backward(dout.double())
    for name, got, want in (("out", out, ref), ("dq", grads[0], qg.grad), ("dk", grads[1], kg.grad),
                            ("dv", grads[2], vg.grad)):
        assert_close(got, want[:, pos[rank]], kernel_tolerance(torch.bfloat16, name), f"{where} {name}")


def _nocomm_covers_every_transfer(rank: int, world: int) -> None:
    """benchmarks/_nocomm.py's stand-in replaces every transfer of forward and backward: it is called once per
    exchange of the schedule above, and no point-to-point operation reaches torch.distributed."""
    if _BENCH not in sys.path:
        sys.path.insert(0, _BENCH)
    from _nocomm import no_communication

    p2p = []
    original = comm.dist.batch_isend_irecv

    def counting(ops):
        p2p.append(len(ops))
        return original(ops)

    q = torch.randn(_B, _S, _H, _D, requires_grad=True)
    k, v = (torch.randn(_B, _S, _HK, _D, requires_grad=True) for _ in range(2))
    comm.dist.batch_isend_irecv = counting
    try:
        with no_communication("zigzag") as counter:
            out = rk.zigzag_ring_attn_func(q, k, v, backend="torch_cpu")
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        comm.dist.batch_isend_irecv = original
    assert p2p == [] and counter.calls == (world - 1) + max(0, world - 2) + (world - 1), (rank, p2p, counter.calls)


def _communication_schedule(rank: int, world: int) -> None:
    """Every schedule case on this rank with exchanges and backward computations recorded, then the no-comm
    stand-in's coverage."""
    impl = get_backend("torch_cpu", device="cpu", dtype=torch.bfloat16, head_dim=_D, mask_kind="causal")
    with _Recorder(impl) as recorder:
        for variant, causal, window in SCHEDULE_CASES:
            _check_schedule_case(rank, world, variant, causal, window, recorder)
    _nocomm_covers_every_transfer(rank, world)


# -------------------------------------------------------------------------------------------- tests

def test_world_of_one_without_process_group():
    """No process group and group=None: a world of one, i.e. plain attention (in process, no spawn)."""
    assert not dist.is_initialized()
    for case in standard_cases(1) + extension_cases(1):
        run_case(0, 1, case)
    # a world of one saves nothing beyond q, k, v, out, lse (no K/V block for the backward to start from)
    q = torch.randn(1, 6, 4, 16, requires_grad=True)
    assert len(rk.ring_attn_func(q, q, q).grad_fn.saved_tensors) == 5


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_variants_match_reference(world):
    # Window/softcap blocks go through the same engine; two world sizes suffice for them (start-up budget).
    extensions = extension_cases(world) if world != 3 else []
    run_world(world, _world_cases, standard_cases(world) + extensions)


def test_forward_yield_setting():
    """The option forward_yield_us (RING_KERNELS_FORWARD_YIELD_US): default 25 us, 0 turns the pause off,
    anything else is refused by name; on CPU tensors no kernel is launched whatever the setting."""
    variable = options.ENVIRONMENT["forward_yield_us"]
    assert options.from_environment({}).forward_yield_us == options.RingOptions().forward_yield_us == 25.0
    for raw, value in (("0", 0.0), (" 40 ", 40.0), ("12.5", 12.5)):
        assert options.from_environment({variable: raw}).forward_yield_us == value
    for raw in ("fast", "-1", "5000"):
        with pytest.raises(ValueError, match=variable):
            options.from_environment({variable: raw})
    with options.use_options(forward_yield_us=25):
        engine.yield_to_transfer(torch.zeros(1))       # CPU: nothing to hold, no error
