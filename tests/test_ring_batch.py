"""ring / zigzag / stripe attention (batch layout) against plain float64 softmax(QK^T)V, forward and backward.

One gloo world per world size; each rank loops over a table of cases (variant x causal x backend x dtype x
GQA x head dim x window/softcap). Every case builds the *global* q, k, v from a seed (identical on all
ranks), runs the reference on the unsharded tensors, runs the ring on this rank's shard, and compares this
rank's slice of out, dq, dk, dv. Local shards are taken with positions written here (not ring_kernels.shard),
so the layouts are checked independently.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import ring_kernels as rk
from _dist import run_world

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


def relative_error(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """fp32: max abs error / max abs reference; bf16: relative Frobenius error."""
    got, ref = got.detach().double(), ref.detach().double()
    if dtype == torch.float32:
        return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 5e-2)}  # (out, grads)


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
    tol_out, tol_grad = TOLERANCE[dtype]
    for name, got, want, tol in (("out", out, ref, tol_out), ("dq", ql.grad, qg.grad, tol_grad),
                                 ("dk", kl.grad, kg.grad, tol_grad), ("dv", vl.grad, vg.grad, tol_grad)):
        assert torch.isfinite(got).all(), f"{name} has NaN/Inf in case {case}"
        err = relative_error(got, want[:, pos], dtype)
        assert err < tol, f"rank {rank}: {name} relative error {err:.2e} >= {tol:g} in case {case}"


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
    if world in (2, 3):                              # the exchanges themselves: test_ring_schedule.py
        _fp32_buffers(rank, world)
        _count_blocks(rank, world)
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
    from ring_kernels.backends import get_backend
    from ring_kernels.ring import _ring_steps
    from ring_kernels.stripe import _stripe_steps
    from ring_kernels.zigzag import _zigzag_steps

    steps_of = {"ring": _ring_steps, "zigzag": _zigzag_steps, "stripe": _stripe_steps}
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
    from torch.utils._python_dispatch import TorchDispatchMode

    factories = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                 torch.ops.aten.zeros.default, torch.ops.aten.full.default, torch.ops.aten.empty_like.default,
                 torch.ops.aten.zeros_like.default, torch.ops.aten.new_empty.default, torch.ops.aten.new_zeros.default}

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32 = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in factories and out.dtype == torch.float32 and out.numel() >= k.numel():
                self.fp32.append((str(func), tuple(out.shape)))
            return out

    b, s, h, hk, d = 1, 6, 8, 2, 64
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(b, s, h, d, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(b, s, hk, d, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    for variant, causal in (("ring", False), ("zigzag", True), ("stripe", True)):
        with Allocations() as seen:
            out = VARIANTS[variant][0](q, k, v, causal=causal, backend="torch_cpu")
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        if world == 2:
            assert seen.fp32 == [], (variant, rank, seen.fp32)
        elif variant == "ring":                      # N = 3: the middle hop's dK/dV partial sums are fp32
            assert ("aten.empty.memory_format", (b, s, hk, d)) in seen.fp32, (variant, rank, seen.fp32)


def _count_blocks(rank: int, world: int) -> None:
    """The blocks each rank computes, by kind and size: causal ring does r+1 blocks on rank r (the imbalance
    zigzag and stripe exist to remove); zigzag and stripe do N blocks on every rank, of equal total work; and
    no standard block needs a dense mask (FULL or aligned CAUSAL only)."""
    from ring_kernels.backends import get_backend

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


def _subgroups(rank: int) -> None:
    """Two independent rings {0, 2} and {1, 3}: ring neighbours are mapped from group ranks to global ranks."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    for variant, causal in (("ring", False), ("zigzag", True), ("stripe", True)):
        case = dict(variant=variant, causal=causal, backend="torch_cpu", dtype=torch.float32, heads=8, heads_k=2,
                    headdim=64, seqlen_local=6, batch=1, seed=7 + rank % 2)
        run_case(rank, 4, case, group=group, group_rank=rank // 2, group_world=2)


# -------------------------------------------------------------------------------------------- tests

def test_world_of_one_without_process_group():
    """No process group and group=None: a world of one, i.e. plain attention (in process, no spawn)."""
    assert not dist.is_initialized()
    for case in standard_cases(1) + extension_cases(1):
        run_case(0, 1, case)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_variants_match_reference(world):
    # Window/softcap blocks go through the same engine; two world sizes suffice for them (start-up budget).
    extensions = extension_cases(world) if world != 3 else []
    run_world(world, _world_cases, standard_cases(world) + extensions)
