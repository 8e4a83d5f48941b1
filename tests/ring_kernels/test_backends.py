"""Block backends, the LSE merge and the backend registry, in process (no ranks needed).

Each CPU backend is pinned and compared, forward (out, lse) and backward (dq, dk, dv), with float64 autograd on
a dense mask, over every mask kind; then blocks are split and merged to check the property the ring relies
on: merging per-block (out, lse) and summing per-block gradients computed from the *merged* out/lse equals
attention over all keys at once.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import ring_kernels as rk
from ring_kernels import entry, merge
from ring_kernels.backends import (CAUSAL, EMPTY, FULL, GENERAL, UnknownBackendError, UnsupportedBackendError,
                                   available_backends, get_backend)
from ring_kernels.backends import torch_cuda
from ring_kernels.backends.base import BlockMask
from ring_kernels.backends.flash_attn import FlashAttnBackend
from ring_kernels.backends.reference import ReferenceBackend
from ring_kernels.tolerances import assert_close, tolerance

CPU_BACKENDS = [n for n in available_backends("cpu") if n != "triton"]   # triton: its own tests


def dense_reference(q, k, v, visible, scale, softcap=0.0):
    """float64 attention with a dense (Sq, Sk) mask; rows with no visible key give out 0, lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


MASKS = {  # name -> (mask, Sq, Sk, expected kind)
    "full": (BlockMask(), 7, 9, FULL),
    "causal": (BlockMask(causal=True), 10, 10, CAUSAL),
    "causal-offset": (BlockMask(causal=True, q_start=4, k_start=0), 7, 9, GENERAL),
    "causal-past": (BlockMask(causal=True, q_start=20, k_start=0), 7, 9, FULL),
    "causal-future": (BlockMask(causal=True, q_start=0, k_start=20), 7, 9, EMPTY),
    "window": (BlockMask(causal=True, window=(2, 0)), 10, 10, GENERAL),
    "window-both": (BlockMask(window=(1, 3), q_start=3, k_start=0), 7, 9, GENERAL),
    # doc 3 (last query row) has no key: a fully masked row.
    "docs": (BlockMask(q_doc=torch.tensor([0, 0, 1, 1, 2, 2, 3]), k_doc=torch.tensor([0, 0, 1, 1, 1, 4, 4, 4, 2])),
             7, 9, GENERAL),
    "positions": (BlockMask(causal=True, q_pos=torch.tensor([0, 1, 2, 9, 10, 11]),
                            k_pos=torch.tensor([3, 4, 5, 6, 7, 8])), 6, 6, GENERAL),
}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_forward_backward_match_dense_reference(backend, mask_name, dtype):
    mask, sq, sk, kind = MASKS[mask_name]
    assert mask.kind(sq, sk) == kind
    torch.manual_seed(0)
    heads, heads_k, d = (8, 2, 80) if dtype == torch.float32 else (4, 4, 64)
    q, k, v = (torch.randn(2, s, h, d).to(dtype) for s, h in ((sq, heads), (sk, heads_k), (sk, heads_k)))
    impl = get_backend(backend, device="cpu", dtype=dtype, head_dim=d, mask_kind=GENERAL)
    out, lse = impl.forward(q, k, v, scale=0.2, mask=mask)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, heads, sq) and lse.dtype == torch.float32

    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    visible = mask.dense(sq, sk, "cpu")
    ref_out, ref_lse = dense_reference(qr, kr, vr, visible, 0.2)
    dout = torch.randn_like(ref_out)
    ref_out.backward(dout)
    dead_rows = ~visible.any(-1)
    assert torch.equal(torch.isinf(lse), dead_rows.expand_as(lse)), "lse = -inf exactly on rows with no key"
    assert bool((out[:, dead_rows] == 0).all())
    assert_close(out, ref_out, tolerance("kernel", dtype, "out"), "out")
    finite = ~dead_rows
    if bool(finite.any()):
        assert_close(lse[..., finite], ref_lse[..., finite], tolerance("kernel", dtype, "lse"), "lse")

    grads = impl.backward(dout.to(dtype), q, k, v, out, lse, scale=0.2, mask=mask)
    for got, want, x in zip(grads, (qr.grad, kr.grad, vr.grad), (q, k, v)):
        assert got.shape == x.shape and got.dtype == dtype and torch.isfinite(got).all()
        if kind != EMPTY:
            assert_close(got, want, tolerance("kernel", dtype, "grad"), "grad")
        else:
            assert bool((got == 0).all())


@pytest.mark.parametrize("softcap", [1.5, 30.0])
def test_reference_softcap_forward_backward(softcap):
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 6, 4, 16), torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16)
    mask = BlockMask(causal=True)
    impl = get_backend("reference", device="cpu", dtype=torch.float32, head_dim=16, mask_kind=CAUSAL, softcap=softcap)
    out, lse = impl.forward(q, k, v, scale=0.5, mask=mask, softcap=softcap)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = dense_reference(qr, kr, vr, mask.dense(6, 6, "cpu"), 0.5, softcap)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    assert_close(out, ref, tolerance("kernel", torch.float32, "out"), "out")
    assert_close(lse, ref_lse, tolerance("kernel", torch.float32, "lse"), "lse")
    grads = impl.backward(dout.float(), q, k, v, out, lse, scale=0.5, mask=mask, softcap=softcap)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert_close(got, want, tolerance("kernel", torch.float32, "grad"), "grad")


def _empty_accumulators(q):
    """fp32 (out, lse) for queries q (B, S, H, D) that have seen no key: out 0, lse -inf."""
    b, s, h, _ = q.shape
    return torch.zeros(q.shape), torch.full((b, h, s), float("-inf"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_split_keys_merge_and_backward_from_merged_lse(backend):
    """Three key blocks (FULL, GENERAL, EMPTY for some rows) merged == one block; block grads sum to the whole."""
    torch.manual_seed(2)
    sq, sk = 6, 15
    q, k, v = torch.randn(2, sq, 8, 64), torch.randn(2, sk, 2, 64), torch.randn(2, sk, 2, 64)
    impl = get_backend(backend, device="cpu", dtype=torch.float32, head_dim=64, mask_kind=GENERAL)
    whole = BlockMask(causal=True, q_start=8, k_start=0)      # rows see keys 0..8+i
    out_all, lse_all = impl.forward(q, k, v, scale=0.125, mask=whole)
    out_acc, lse_acc = _empty_accumulators(q)
    blocks = [(0, 5), (5, 11), (11, 15)]
    for a, b in blocks:
        part = BlockMask(causal=True, q_start=8, k_start=a)
        o, lse = impl.forward(q, k[:, a:b], v[:, a:b], scale=0.125, mask=part)
        merge.merge_(out_acc, out_acc, lse_acc, o, lse)
    assert_close(out_acc, out_all, tolerance("merged_blocks", torch.float32, "out"), "merged out")
    assert_close(lse_acc, lse_all, tolerance("merged_blocks", torch.float32, "lse"), "merged lse")
    out = out_acc.to(q.dtype)
    dout = torch.randn_like(out)
    dq_all, dk_all, dv_all = impl.backward(dout, q, k, v, out, lse_acc, scale=0.125, mask=whole)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for a, b in blocks:
        part = BlockMask(causal=True, q_start=8, k_start=a)
        g = impl.backward(dout, q, k[:, a:b], v[:, a:b], out, lse_acc, scale=0.125, mask=part)
        dq += g[0]
        dk[:, a:b] += g[1]
        dv[:, a:b] += g[2]
    for name, got, want in (("dq", dq, dq_all), ("dk", dk, dk_all), ("dv", dv, dv_all)):
        assert_close(got, want, tolerance("merged_blocks", torch.float32, "grad"), f"summed block {name}")


def test_merge_rows_without_keys_stay_zero_without_nan():
    out_acc, lse_acc = _empty_accumulators(torch.zeros(1, 3, 2, 4))
    block_out = torch.zeros(1, 3, 2, 4, dtype=torch.bfloat16)
    block_lse = torch.full((1, 2, 3), float("-inf"))
    block_lse[:, :, 1] = 0.5
    block_out[:, 1] = 2.0
    merge.merge_(out_acc, out_acc, lse_acc, block_out, block_lse)     # row 1 gets a block; rows 0, 2 none
    merge.merge_(out_acc, out_acc, lse_acc, torch.zeros_like(block_out), torch.full((1, 2, 3), float("-inf")))
    assert not out_acc.isnan().any() and not lse_acc.isnan().any()
    assert torch.equal(out_acc[:, 1], torch.full((1, 2, 4), 2.0)) and bool((out_acc[:, [0, 2]] == 0).all())
    assert torch.equal(lse_acc[:, :, 1], torch.full((1, 2), 0.5)) and torch.isinf(lse_acc[:, :, [0, 2]]).all()
    assert torch.equal(merge.safe_lse(lse_acc)[:, :, 0], torch.zeros(1, 2))


def test_merge_into_row_views_in_place():
    """Zigzag merges into half of the rows: the accumulators are views and must be updated in place."""
    out_acc, lse_acc = _empty_accumulators(torch.zeros(2, 4, 2, 3))
    out_acc.fill_(1.0)
    lse_acc.fill_(0.0)
    merge.merge_(out_acc[:, 2:], out_acc[:, 2:], lse_acc[:, :, 2:], torch.full((2, 2, 2, 3), 3.0),
                 torch.zeros(2, 2, 2))
    assert torch.equal(out_acc[:, :2], torch.ones(2, 2, 2, 3)) and torch.allclose(out_acc[:, 2:], torch.full((2, 2, 2, 3), 2.0))
    assert torch.allclose(lse_acc[:, :, 2:], torch.full((2, 2, 2), float(torch.log(torch.tensor(2.0)))))


@pytest.mark.parametrize("name", ["torch_flash", "torch_cudnn", "torch_efficient"])
@pytest.mark.parametrize("heads_k", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_backends_call_the_aten_ops_correctly_on_meta(name, heads_k, causal):
    """The CUDA ops' argument lists and output shapes, checked through their meta kernels (no GPU needed):
    catches a torch release that changes an op's schema; numerics are checked in tests/gpu."""
    impl = {"torch_flash": torch_cuda.TorchFlashBackend, "torch_cudnn": torch_cuda.TorchCudnnBackend,
            "torch_efficient": torch_cuda.TorchEfficientBackend}[name]()
    q = torch.empty(2, 16, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 16, heads_k, 64, device="meta", dtype=torch.bfloat16)
    mask = BlockMask(causal=causal)
    out, lse = impl.forward(q, k, k, scale=0.125, mask=mask)
    assert out.shape == q.shape and out.stride() == q.stride() and lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    dq, dk, dv = impl.backward(out, q, k, k, out, lse, scale=0.125, mask=mask)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_cudnn_one_query_one_key_backward_is_plain_math():
    """cuDNN's backward refuses s_q = s_kv = 1 (a one-token document piece in a packed batch); the backend routes
    that block to exact plain math. Checked here on CPU tensors (the routing happens before any aten call)
    against autograd of softmax(qk^T)v for one key, i.e. out = v."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, h, 16, dtype=torch.float32, requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(2, 1, 4, 16)
    out_ref = v.repeat_interleave(2, dim=2)                       # one visible key: weight 1, out = v
    lse = (torch.einsum("bqhd,bkhd->bhq", q, k.repeat_interleave(2, dim=2)) * 0.25).detach()
    dq, dk, dv = torch_cuda.TorchCudnnBackend().backward(
        dout, q.detach(), k.detach(), v.detach(), out_ref.detach(), lse, scale=0.25, mask=BlockMask(causal=True))
    want_dq, want_dk, want_dv = torch.autograd.grad(out_ref, (q, k, v), dout, allow_unused=True)
    assert want_dq is None and want_dk is None                    # out does not depend on q, k with one key
    # zero up to fp32 rounding of p = exp(s - lse) = 1 and rowsum(dO * V) - rowsum(dO * O) = 0
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5, (dq.abs().max(), dk.abs().max())
    assert torch.allclose(dv, want_dv, atol=1e-6)


def fake_flash_attn(generation: str):
    """A stand-in for flash-attn's private interface with the given release's parameter names and return
    tuple, computing with the reference backend, so the adapter's glue is tested without CUDA."""
    ref = ReferenceBackend()

    def mask_of(causal, window):
        assert tuple(window) == (-1, -1)
        return BlockMask(causal=causal)

    if generation == "2.7":
        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, return_softmax):
            out, lse = ref.forward(q, k, v, scale=softmax_scale, mask=mask_of(causal, (window_size_left, window_size_right)),
                                   softcap=softcap)
            return out, lse, None, torch.tensor([7])

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                 rng_state=None):
            assert rng_state is not None and int(rng_state) == 7
            grads = ref.backward(dout, q, k, v, out, softmax_lse, scale=softmax_scale,
                                 mask=mask_of(causal, (window_size_left, window_size_right)), softcap=softcap)
            for buf, g in zip((dq, dk, dv), grads):
                buf.copy_(g)
            return softmax_lse
    else:  # 2.6: window as a tuple, an 8-tuple from the forward
        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                return_softmax):
            out, lse = ref.forward(q, k, v, scale=softmax_scale, mask=mask_of(causal, window_size), softcap=softcap)
            return out, q, k, v, out, lse, None, torch.tensor([7])

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size, softcap, alibi_slopes, deterministic, rng_state=None):
            grads = ref.backward(dout, q, k, v, out, softmax_lse, scale=softmax_scale,
                                 mask=mask_of(causal, window_size), softcap=softcap)
            for buf, g in zip((dq, dk, dv), grads):
                buf.copy_(g)

    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward, iface._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = iface
    return package, iface


@pytest.mark.parametrize("generation", ["2.6", "2.7"])
def test_flash_attn_adapter_maps_arguments_of_each_release(generation, monkeypatch):
    package, iface = fake_flash_attn(generation)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    impl = FlashAttnBackend()
    assert impl.unsupported_reason(device="cuda", dtype=torch.bfloat16, head_dim=128, mask_kind=CAUSAL, softcap=5.0) is None
    assert "mask kind" in impl.unsupported_reason(device="cuda", dtype=torch.bfloat16, head_dim=128,
                                                   mask_kind=GENERAL, softcap=0.0)
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    mask = BlockMask(causal=True)
    out, lse = impl.forward(q, k, v, scale=0.3, mask=mask, softcap=5.0)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = dense_reference(qr, kr, vr, mask.dense(8, 8, "cpu"), 0.3, 5.0)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    assert_close(out, ref, tolerance("kernel", torch.float32, "out"), "out")
    assert_close(lse, ref_lse, tolerance("kernel", torch.float32, "lse"), "lse")
    grads = impl.backward(dout.float(), q, k, v, out, lse, scale=0.3, mask=mask, softcap=5.0)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert_close(got, want, tolerance("kernel", torch.float32, "grad"), "grad")


# --------------------------------------------------------------------------------------------- registry

def test_available_backends_on_cpu_in_auto_order():
    names = available_backends("cpu")
    assert names[:2] == ["torch_cpu", "reference"]
    assert set(names) <= {"torch_cpu", "reference", "triton"}
    if not torch.cuda.is_available():   # importable CUDA-only packages (triton) are no backend without a GPU
        assert available_backends("cuda") == ["reference"]


def test_auto_ranking_leaves_out_flash_attn():
    """auto's ranking per device. flash_attn is not in it: its adapter is tested (the stand-in module above,
    ``fake_flash_attn``, and the real library in tests/gpu/test_backends_gpu.py) but not timed against the ranked
    backends, so auto must not pick it; ``backend="flash_attn"`` still does
    (tests/ring_kernels/test_backend_choices.py), and ``available_backends`` lists it after the ranking where
    flash-attn is importable."""
    assert rk.backends.auto_ranking("cpu") == ["torch_cpu", "reference", "triton"]
    assert rk.backends.auto_ranking("cuda") == ["torch_cudnn", "torch_flash", "triton", "torch_efficient",
                                                "reference"]
    assert "flash_attn" not in rk.backends.auto_ranking("cuda")


def test_auto_ranking_in_fp32_puts_torch_efficient_before_triton():
    """fp32 on CUDA: torch's efficient kernel before Triton, whose fp32 tiles compile and autotune per shape (the
    backends package docstring has the measured wait); every other dtype and device keeps the general order."""
    assert rk.backends.auto_ranking("cuda", torch.float32) == ["torch_cudnn", "torch_flash", "torch_efficient",
                                                               "triton", "reference"]
    for dtype in (torch.bfloat16, torch.float16):
        assert rk.backends.auto_ranking("cuda", dtype) == rk.backends.auto_ranking("cuda")
    assert rk.backends.auto_ranking("cpu", torch.float32) == rk.backends.auto_ranking("cpu")


@pytest.mark.parametrize("mask_kind,softcap,dtype,expected", [
    (CAUSAL, 0.0, torch.float32, "torch_cpu"),
    (GENERAL, 0.0, torch.bfloat16, "torch_cpu"),
    (FULL, 2.0, torch.float32, "reference"),          # softcap: only the reference does it on CPU
])
def test_auto_picks_fastest_capable(mask_kind, softcap, dtype, expected):
    impl = get_backend("auto", device="cpu", dtype=dtype, head_dim=64, mask_kind=mask_kind, softcap=softcap)
    assert impl.name == expected


def test_registry_errors_name_the_problem():
    with pytest.raises(UnknownBackendError, match=r"backend='nope' is not a known backend.*torch_cudnn"):
        get_backend("nope", device="cpu", dtype=torch.float32, head_dim=64, mask_kind=FULL)
    with pytest.raises(UnsupportedBackendError, match=r"'torch_cudnn' is not available on device type 'cpu'"):
        get_backend("torch_cudnn", device="cpu", dtype=torch.float32, head_dim=64, mask_kind=FULL)
    with pytest.raises(UnsupportedBackendError, match=r"'torch_cpu' cannot compute these blocks: softcap"):
        get_backend("torch_cpu", device="cpu", dtype=torch.float32, head_dim=64, mask_kind=FULL, softcap=1.0)
    with pytest.raises(ValueError, match=r"mask_kind='diagonal'"):
        get_backend("auto", device="cpu", dtype=torch.float32, head_dim=64, mask_kind="diagonal")
    assert issubclass(UnknownBackendError, ValueError) and issubclass(UnsupportedBackendError, ValueError)


# ------------------------------------------------------------------------------------------ bad input

def _t(*shape):
    return torch.randn(*shape)


BAD_INPUT = [
    (rk.ring_attn_func, (_t(1, 6, 4, 8), _t(1, 6, 2, 8), _t(1, 6, 4, 8)), {}, r"k has shape \(1, 6, 2, 8\) but v has"),
    (rk.ring_attn_func, (_t(1, 6, 4, 8), _t(1, 5, 4, 8), _t(1, 5, 4, 8)), {}, r"q has \(batch, seqlen_local\) \(1, 6\)"),
    (rk.ring_attn_func, (_t(1, 6, 6, 8), _t(1, 6, 4, 8), _t(1, 6, 4, 8)), {}, r"6 heads .* 4; nheads % nheads_k"),
    (rk.ring_attn_func, (_t(1, 6, 4, 8), _t(1, 6, 4, 16), _t(1, 6, 4, 16)), {}, r"head dim 8 but k/v have 16"),
    (rk.ring_attn_func, (_t(6, 4, 8), _t(6, 4, 8), _t(6, 4, 8)), {}, r"expected 4 dims \(batch, seqlen_local"),
    (rk.ring_attn_func, (_t(1, 6, 4, 8),) * 3, {"dropout_p": 0.1}, r"dropout_p=0.1; .*pass 0.0"),
    (rk.ring_attn_func, (_t(1, 6, 4, 8),) * 3, {"window_size": (3,)}, r"window_size=\(3,\); expected a pair"),
    (rk.ring_attn_func, (_t(1, 6, 4, 8),) * 3, {"window_size": (-2, 0)}, r"must be >= 0 or -1"),
    (rk.ring_attn_func, (_t(1, 6, 4, 8),) * 3, {"softcap": -1.0}, r"softcap=-1.0; expected a float >= 0"),
    (rk.ring_attn_func, (_t(1, 6, 4, 8),) * 3, {"backend": "torch_flash"}, r"not available on device type 'cpu'"),
    (rk.zigzag_ring_attn_func, (_t(1, 7, 4, 8),) * 3, {}, r"seqlen_local=7; the zigzag layout needs an even"),
    (rk.ring_attn_func, (_t(1, 0, 4, 8),) * 3, {}, r"shape \(1, 0, 4, 8\); batch and seqlen_local must be >= 1"),
    (rk.zigzag_ring_attn_func, (_t(1, 6, 4, 8),) * 3, {"causal": False}, r"causal=False .* use ring_attn_func"),
    (rk.stripe_attn_func, (_t(1, 6, 4, 8),) * 3, {"causal": False}, r"causal=False .* use ring_attn_func"),
]


@pytest.mark.parametrize("fn,args,kwargs,message", BAD_INPUT)
def test_bad_input_raises_value_error_naming_it(fn, args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fn(*args, **kwargs)


def test_input_errors_carry_the_argument_and_value():
    q = torch.randn(1, 6, 4, 8)
    with pytest.raises(ValueError) as info:
        rk.ring_attn_func(q, q, q, dropout_p=0.5)
    assert (info.value.argument, info.value.value) == ("dropout_p", 0.5)
    with pytest.raises(ValueError) as info:
        rk.stripe_attn_func(q, q, q, causal=False)
    assert (info.value.argument, info.value.value) == ("causal", False)


# Every public kernel, batch then packed (the USP ones on a world of one); USP runs its ring variant inside.
_BATCH_KERNELS = (rk.ring_attn_func, rk.zigzag_ring_attn_func, rk.stripe_attn_func, rk.ulysses_attn_func,
                  rk.usp_attn_func)
_VARLEN_KERNELS = (rk.ring_attn_varlen_func, rk.zigzag_ring_attn_varlen_func, rk.llama3_attn_varlen_func,
                   rk.ulysses_attn_varlen_func, rk.usp_attn_varlen_func)
_INNER = {"usp_attn_func": ["zigzag_ring_attn_func"], "usp_attn_varlen_func": ["zigzag_ring_attn_varlen_func"]}


def test_every_kernel_runs_the_one_prologue(monkeypatch):
    """Each kernel checks its arguments and agrees with its group through ``entry.KernelCall``, once per call (USP:
    once for its own arguments, once in the ring variant it runs)."""
    seen = []
    init = entry.KernelCall.__init__

    def counting(self, fn, *args, **kwargs):
        seen.append(fn)
        init(self, fn, *args, **kwargs)

    monkeypatch.setattr(entry.KernelCall, "__init__", counting)
    q, cu = torch.randn(1, 8, 4, 8), torch.tensor([0, 4, 8], dtype=torch.int32)
    for fn in _BATCH_KERNELS + _VARLEN_KERNELS:
        seen.clear()
        fn(q, q, q, *((cu,) if fn in _VARLEN_KERNELS else ()), causal=True)
        assert seen == [fn.__name__, *_INNER.get(fn.__name__, [])], (fn.__name__, seen)


@pytest.mark.parametrize("fn", _BATCH_KERNELS, ids=lambda fn: fn.__name__)
def test_every_batch_kernel_refuses_an_empty_shard_alike(fn):
    q = torch.randn(0, 8, 4, 8)
    with pytest.raises(rk.RingInputError, match=rf"^{fn.__name__}: q has shape \(0, 8, 4, 8\); batch and "
                       r"seqlen_local must be >= 1 on every rank$") as info:
        fn(q, q, q)
    assert (info.value.argument, info.value.value) == ("q", (0, 8, 4, 8))


def test_mixed_dtypes_rejected():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"dtypes differ"):
        rk.ring_attn_func(q, q.bfloat16(), q)
