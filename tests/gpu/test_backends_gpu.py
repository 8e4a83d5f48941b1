"""Every CUDA block backend on one GPU against float64 attention: forward (out, lse), backward, and the ring's use of
it (key blocks merged by LSE, each block's backward from the merged out/LSE, gradients summed).

The backends are those ``available_backends("cuda")`` lists on the machine -- torch's flash, cuDNN and efficient
ops, the Triton kernel where triton is importable, and ``flash_attn`` where the flash-attn package is (build one
for these head dims with ``scripts/build_flash_attn.py`` and put it on PYTHONPATH). Each case runs on every backend
that says it supports it (``unsupported_reason`` is None); every backend must support the plain cases (fp16/bf16,
full and aligned-causal blocks, head dims 64 and 128). The tolerances are the CPU suite's (ring_kernels.tolerances).

    python -m pytest tests/gpu/test_backends_gpu.py     # skips without a CUDA device
"""
from __future__ import annotations

import pytest
import torch

from ring_kernels import merge
from ring_kernels.backends import (CAUSAL, EMPTY, FULL, BlockMask, UnsupportedBackendError, available_backends,
                                   get_backend)
from ring_kernels.tolerances import assert_close, tolerance
from test_backends import dense_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = [n for n in available_backends("cuda") if n != "reference"] if torch.cuda.is_available() else []
HALF = [torch.bfloat16, torch.float16]
# (name, mask, Sq, Sk, kind): what a ring step hands a backend -- the diagonal block (aligned causal), a block of
# past keys (full), a block of future keys (empty).
BLOCKS = [
    ("diagonal", BlockMask(causal=True), 256, 256, CAUSAL),
    ("past", BlockMask(causal=True, q_start=384, k_start=0), 256, 384, FULL),
    ("future", BlockMask(causal=True, q_start=0, k_start=512), 256, 256, EMPTY),
    ("non-causal", BlockMask(), 192, 320, FULL),
]


def _backend(name, dtype, head_dim, kind):
    """The backend pinned for a full, aligned-causal or empty block (every CUDA backend takes these: a refusal,
    ``UnsupportedBackendError``, fails the test)."""
    return get_backend(name, device="cuda", dtype=dtype, head_dim=head_dim, mask_kind=kind)


def _forward(impl, q, k, v, **kwargs):
    """``impl.forward``; a flash-attn built for other head dims or dtypes (scripts/build_flash_attn.py's dispatch
    refuses them by name) skips the case, saying so."""
    try:
        return impl.forward(q, k, v, **kwargs)
    except RuntimeError as exc:
        if "scripts/build_flash_attn.py" not in str(exc):
            raise
        pytest.skip(f"{impl.name}: {exc}")


def _inputs(sq, sk, heads, heads_k, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, sq, heads, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(2, sk, heads_k, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(2, sk, heads_k, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def test_every_cuda_backend_takes_the_plain_cases():
    """Full and aligned-causal fp16/bf16 blocks of head dim 64 and 128 are every CUDA backend's job (the ring's
    common case); a backend that refuses one is a regression, not a skip."""
    assert BACKENDS, "no CUDA block backend besides the reference"
    for name in BACKENDS:
        for dtype in HALF:
            for d in (64, 128):
                for kind in (FULL, CAUSAL):
                    get_backend(name, device="cuda", dtype=dtype, head_dim=d, mask_kind=kind)


@pytest.mark.parametrize("block", [b[0] for b in BLOCKS])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_forward_backward_match_float64(backend, dtype, head_dim, block):
    _, mask, sq, sk, kind = next(b for b in BLOCKS if b[0] == block)
    assert mask.kind(sq, sk) == kind
    impl = _backend(backend, dtype, head_dim, kind)
    q, k, v = _inputs(sq, sk, 8, 2, head_dim, dtype, seed=head_dim + sq)
    scale = head_dim ** -0.5
    out, lse = _forward(impl, q, k, v, scale=scale, mask=mask)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 8, sq) and lse.dtype == torch.float32

    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = dense_reference(qr, kr, vr, mask.dense(sq, sk, "cuda"), scale)
    dout = torch.randn_like(ref_out)
    ref_out.backward(dout)
    grads = impl.backward(dout.to(dtype), q, k, v, out, lse, scale=scale, mask=mask)
    if kind == EMPTY:
        assert bool((out == 0).all()) and bool(torch.isinf(lse).all())
        assert all(bool((g == 0).all()) for g in grads)
        return
    assert_close(out, ref_out, tolerance("kernel", dtype, "out"), f"{backend} out")
    assert_close(lse, ref_lse, tolerance("kernel", dtype, "lse"), f"{backend} lse")
    for label, got, want, x in zip(("dq", "dk", "dv"), grads, (qr.grad, kr.grad, vr.grad), (q, k, v)):
        assert got.shape == x.shape and got.dtype == dtype
        assert_close(got, want, tolerance("kernel", dtype, "grad"), f"{backend} {label}")


@pytest.mark.parametrize("softcap", [30.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_where_supported(backend, softcap):
    """A backend that says it takes a softcap computes ``softcap * tanh(s / softcap)`` scores exactly."""
    mask, dtype, d = BlockMask(causal=True), torch.bfloat16, 128
    try:
        impl = get_backend(backend, device="cuda", dtype=dtype, head_dim=d, mask_kind=CAUSAL, softcap=softcap)
    except UnsupportedBackendError as exc:   # this backend has no softcap: its refusal says so
        assert "softcap" in str(exc)
        pytest.skip(f"{backend}: {exc}")
    q, k, v = _inputs(256, 256, 8, 2, d, dtype, seed=7)
    out, lse = _forward(impl, q, k, v, scale=0.5, mask=mask, softcap=softcap)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = dense_reference(qr, kr, vr, mask.dense(256, 256, "cuda"), 0.5, softcap)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    assert_close(out, ref, tolerance("kernel", dtype, "out"), f"{backend} softcap out")
    assert_close(lse, ref_lse, tolerance("kernel", dtype, "lse"), f"{backend} softcap lse")
    grads = impl.backward(dout.to(dtype), q, k, v, out, lse, scale=0.5, mask=mask, softcap=softcap)
    for label, got, want in zip(("dq", "dk", "dv"), grads, (qr.grad, kr.grad, vr.grad)):
        assert_close(got, want, tolerance("kernel", dtype, "grad"), f"{backend} softcap {label}")


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_use_merged_blocks_and_backward_from_merged_lse(backend, dtype):
    """A query block against three key blocks as a ring hands them over (two past blocks: full; its own: aligned
    causal), merged by LSE in fp32, then each block's backward from the merged out/LSE: equal to float64 attention
    over all keys, forward and the summed gradients."""
    d, sq = 128, 256
    q, k, v = _inputs(sq, 3 * sq, 8, 2, d, dtype, seed=11)
    scale = d ** -0.5
    blocks = [(0, sq, BlockMask(causal=True, q_start=2 * sq, k_start=0)),
              (sq, 2 * sq, BlockMask(causal=True, q_start=2 * sq, k_start=sq)),
              (2 * sq, 3 * sq, BlockMask(causal=True, q_start=2 * sq, k_start=2 * sq))]
    out_acc = torch.zeros(q.shape, device="cuda")
    lse_acc = torch.full((2, 8, sq), float("-inf"), device="cuda")
    for a, b, mask in blocks:
        impl = _backend(backend, dtype, d, mask.kind(sq, b - a))
        o, lse = _forward(impl, q, k[:, a:b], v[:, a:b], scale=scale, mask=mask)
        merge.merge_(out_acc, out_acc, lse_acc, o, lse)

    whole = BlockMask(causal=True, q_start=2 * sq, k_start=0)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = dense_reference(qr, kr, vr, whole.dense(sq, 3 * sq, "cuda"), scale)
    dout = torch.randn_like(ref_out)
    ref_out.backward(dout)
    out = out_acc.to(dtype)
    assert_close(out, ref_out, tolerance("kernel", dtype, "out"), f"{backend} merged out")
    assert_close(lse_acc, ref_lse, tolerance("kernel", dtype, "lse"), f"{backend} merged lse")

    dq = torch.zeros(q.shape, device="cuda")
    dk, dv = torch.zeros(k.shape, device="cuda"), torch.zeros(v.shape, device="cuda")
    for a, b, mask in blocks:
        impl = _backend(backend, dtype, d, mask.kind(sq, b - a))
        g = impl.backward(dout.to(dtype), q, k[:, a:b], v[:, a:b], out, lse_acc, scale=scale, mask=mask)
        dq += g[0].float()
        dk[:, a:b] += g[1].float()
        dv[:, a:b] += g[2].float()
    for label, got, want in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert_close(got.to(dtype), want, tolerance("kernel", dtype, "grad"), f"{backend} summed block {label}")
