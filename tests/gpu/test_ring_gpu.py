"""ring / zigzag / stripe on CUDA over NCCL with torch's flash, cuDNN and efficient backends (and flash_attn /
triton when installed), against float64 attention on the unsharded inputs, forward and backward.

Run either way (the ring test skips cleanly with fewer than 2 GPUs, the merge-kernel test without CUDA):
    python -m pytest tests/gpu/test_ring_gpu.py            # spawns 2 NCCL ranks itself
    torchrun --nproc-per-node 2 -m pytest tests/gpu/test_ring_gpu.py
The case runner and tolerances are the CPU suite's (tests/ring_kernels/test_ring_batch.py), moved to the GPU.
"""
from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import ring_kernels as rk
from _dist import run_world
from ring_kernels import merge
from ring_kernels.backends import UnsupportedBackendError, available_backends, get_backend

pytestmark = [pytest.mark.gpu]
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

WORLD = 2
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 5e-2), torch.float16: (1e-2, 5e-2)}


def _reference(q, k, v, *, causal, scale, window):
    """float64 attention on global (B, S, H, D) tensors (on the GPU: the global sequence is short)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    pos = torch.arange(q.shape[1], device=q.device)
    visible = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        visible &= pos[None, :] <= pos[:, None]
    if window[0] >= 0:
        visible &= pos[None, :] >= pos[:, None] - window[0]
    if window[1] >= 0:
        visible &= pos[None, :] <= pos[:, None] + window[1]
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(~visible, float("-inf")), -1), v)


def _positions(layout, rank, world, seqlen):
    if layout == "ring":
        n = seqlen // world
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":
        c = seqlen // (2 * world)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])
    return torch.arange(rank, seqlen, world)


def _error(got, ref, dtype):
    got, ref = got.detach().double(), ref.detach().double()
    if dtype == torch.float32:
        return float((got - ref).abs().max() / ref.abs().max())
    return float((got - ref).norm() / ref.norm())


def _run_case(rank, case):
    fn = {"ring": rk.ring_attn_func, "zigzag": rk.zigzag_ring_attn_func, "stripe": rk.stripe_attn_func}[case["variant"]]
    dev = torch.device("cuda", torch.cuda.current_device())
    b, h, hk, d, dtype, s_local = case["batch"], case["heads"], case["heads_k"], case["headdim"], case["dtype"], case["seqlen"]
    seqlen = s_local * WORLD
    gen = torch.Generator(device=dev).manual_seed(case["seed"])
    q, k, v, dout = (torch.randn(b, seqlen, n, d, device=dev, generator=gen).to(dtype) for n in (h, hk, hk, h))
    window = case.get("window", (-1, -1))
    qg, kg, vg = (x.double().requires_grad_() for x in (q, k, v))
    ref = _reference(qg, kg, vg, causal=case["causal"], scale=d ** -0.5, window=window)
    ref.backward(dout.double())
    pos = _positions(case["variant"], rank, WORLD, seqlen).to(dev)
    ql, kl, vl = (x[:, pos].detach().clone().requires_grad_() for x in (q, k, v))
    kind = "general" if window != (-1, -1) else ("causal" if case["causal"] else "full")
    try:
        get_backend(case["backend"], device=dev, dtype=dtype, head_dim=d, mask_kind=kind)
    except UnsupportedBackendError:
        # A pinned backend that cannot do this case (e.g. a head dim it lacks) must refuse, not compute.
        with pytest.raises(ValueError, match="cannot compute these blocks"):
            fn(ql, kl, vl, causal=case["causal"], backend=case["backend"], window_size=window)
        return
    out = fn(ql, kl, vl, causal=case["causal"], backend=case["backend"], window_size=window)
    out.backward(dout[:, pos])
    tol_out, tol_grad = TOLERANCE[dtype]
    for name, got, want, tol in (("out", out, ref, tol_out), ("dq", ql.grad, qg.grad, tol_grad),
                                 ("dk", kl.grad, kg.grad, tol_grad), ("dv", vl.grad, vg.grad, tol_grad)):
        assert torch.isfinite(got).all(), f"{name} not finite in {case}"
        err = _error(got, want[:, pos], dtype)
        assert err < tol, f"rank {rank}: {name} error {err:.2e} >= {tol:g} in {case}"


def _cases():
    backends = [n for n in available_backends("cuda") if n != "reference"] + ["auto"]
    head_dims = itertools.cycle([64, 128, 96])
    lengths = itertools.cycle([384, 1000, 258])      # local lengths, not powers of two (even for zigzag)
    cases = []
    for backend in backends:
        for (variant, causal), dtype, (h, hk) in itertools.product(
                (("ring", False), ("ring", True), ("zigzag", True), ("stripe", True)),
                (torch.bfloat16, torch.float16), ((8, 8), (8, 2))):
            cases.append(dict(backend=backend, variant=variant, causal=causal, dtype=dtype, heads=h, heads_k=hk,
                              headdim=next(head_dims), seqlen=next(lengths), batch=2, seed=len(cases)))
    for variant, causal in (("ring", False), ("ring", True), ("zigzag", True), ("stripe", True)):
        # fp32 and sliding windows: only the efficient kernel (and the reference) can; 'auto' must find it.
        cases.append(dict(backend="torch_efficient", variant=variant, causal=causal, dtype=torch.float32, heads=4,
                          heads_k=2, headdim=64, seqlen=200, batch=1, seed=500 + len(cases)))
        cases.append(dict(backend="auto", variant=variant, causal=causal, dtype=torch.bfloat16, heads=8, heads_k=2,
                          headdim=128, seqlen=300, batch=1, seed=600 + len(cases),
                          window=(100, 0) if causal else (64, 32)))
    return cases


def _pin_triton_blocks():
    """Correctness, not speed, is checked here: autotuning every case's shape would compile ~15 kernel
    configurations per shape (minutes). Pinned 64x64 blocks are one valid configuration (benchmarks autotune)."""
    try:
        # deferred (triton): the module imports triton; without it the blocks need no pinning
        from ring_kernels.backends import triton_attn
    except ImportError:
        return
    triton_attn.set_fixed_blocks({"fwd": (64, 64), "dkdv": (64, 64), "dq": (64, 64)})


def _rank_main(rank, world):
    _pin_triton_blocks()
    for case in _cases():
        _run_case(rank, case)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_merge_on_cuda_matches_eager():
    """The Triton merge kernel that ring forwards use on CUDA, against the eager formula (incl. -inf rows)."""
    if not merge.use_fused():
        pytest.skip("triton is not installed (or RING_KERNELS_FUSED_MERGE=0): the eager merge is used")
    torch.manual_seed(0)
    for b, s, h, d, rows in [(1, 4096, 32, 128, slice(None)), (2, 1000, 8, 96, slice(500, 1000))]:
        acc, lse = torch.randn(b, s, h, d, device="cuda"), torch.randn(b, h, s, device="cuda")
        lse[:, :, :7] = float("-inf")
        acc[:, :7] = 0
        blk, blk_lse = torch.randn(b, s, h, d, device="cuda").bfloat16(), torch.randn(b, h, s, device="cuda")
        blk_lse[:, :, 3:11] = float("-inf")
        eager, fused = (acc.clone(), lse.clone()), (acc.clone(), lse.clone())
        merge.merge_into_eager_(eager[0][:, rows], eager[0][:, rows], eager[1][:, :, rows], blk[:, rows],
                                blk_lse[:, :, rows])
        merge.merge_(fused[0][:, rows], fused[0][:, rows], fused[1][:, :, rows], blk[:, rows], blk_lse[:, :, rows])
        assert not fused[0].isnan().any() and not fused[1].isnan().any()
        torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.isinf(fused[1]), torch.isinf(eager[1]))
        finite = torch.isfinite(eager[1])
        torch.testing.assert_close(fused[1][finite], eager[1][finite], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generalised_merge_and_widening_add_on_cuda_match_eager():
    """The Triton ``dst = merge(a, b)`` (dst/a/b of any of fp32/bf16/fp16, dst aliasing a, row views, rows
    without keys) and the widening ``dst (fp32) = a + b (bf16/fp16)`` against the eager formula, on real
    shapes; a compile failure would fall back with a RuntimeWarning, which fails this test."""
    if not merge.use_fused():
        pytest.skip("triton is not installed (or RING_KERNELS_FUSED_MERGE=0): the eager merge is used")
    gen = torch.Generator(device="cuda").manual_seed(1)
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    combos = [(bf16, bf16, bf16, True), (bf16, bf16, fp32, False), (fp32, bf16, bf16, False), (fp32, bf16, fp32, True),
              (fp16, fp16, fp16, True), (fp32, fp16, fp16, False)]              # (a, b, dst, dst is a)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for (da, db, dd, alias), (b, s, h, d, rows) in itertools.product(
                combos, [(1, 8192, 32, 128, slice(None)), (2, 1000, 8, 96, slice(500, 1000))]):
            a = torch.randn(b, s, h, d, device="cuda", generator=gen).to(da)
            blk = torch.randn(b, s, h, d, device="cuda", generator=gen).to(db)
            lse, blk_lse = (torch.randn(b, h, s, device="cuda", generator=gen) for _ in range(2))
            lse[:, :, :7], blk_lse[:, :, 3:11] = float("-inf"), float("-inf")
            a[:, :7] = 0
            results = []
            for run in (merge.merge_into_eager_, merge.merge_into_fused_):
                dst = a.clone() if alias else torch.zeros(b, s, h, d, device="cuda", dtype=dd)
                src, l = (dst if alias else a), lse.clone()
                run(dst[:, rows], src[:, rows], l[:, :, rows], blk[:, rows], blk_lse[:, :, rows])
                results.append((dst, l))
            (eager, eager_lse), (fused, fused_lse) = results
            assert not fused.isnan().any() and not fused_lse.isnan().any()
            tol = 1e-5 if dd == torch.float32 else torch.finfo(dd).eps
            torch.testing.assert_close(fused.float(), eager.float(), rtol=tol, atol=tol)
            assert torch.equal(torch.isinf(fused_lse), torch.isinf(eager_lse))
            finite = torch.isfinite(eager_lse)
            torch.testing.assert_close(fused_lse[finite], eager_lse[finite], rtol=1e-5, atol=1e-5)
        for low in (torch.bfloat16, torch.float16):
            x, y = (torch.randn(2, 4096, 8, 128, device="cuda", generator=gen).to(low) for _ in range(2))
            widened = torch.empty(x.shape, device="cuda")
            merge.add_(widened[:, 1:], x[:, 1:], y[:, 1:])                # the fused path on CUDA
            assert torch.equal(widened[:, 1:], x[:, 1:].float() + y[:, 1:].float())


@needs_two_gpus
def test_ring_variants_on_cuda_match_reference():
    if "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == WORLD:   # under torchrun
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        for case in _cases():
            _run_case(rank, case)
        return
    run_world(WORLD, _rank_main, backend="nccl", timeout=600)
