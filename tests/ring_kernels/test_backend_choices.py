"""Block backends say what they do: every choice is recorded (``ring_kernels.backends.choices()``), logged once
per shape class and reason, and exposed on ``hfpatch.Patch.backend_choices``.

On CPU: ring calls through the real entry points record the backend that ran (torch_cpu, reference, and triton
under its interpreter in a subprocess); ``"auto"``'s reasons for a window / document mask / softcap choice are
recorded; CUDA's ranking and reasons are checked with the CUDA backends declared present (their support checks
need no GPU); torch_cuda's fallback to repeated K/V after a ``RuntimeError`` (injected) logs a WARNING with the
error text, is recorded, and still computes the right attention, forward and backward.
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import hfpatch
import ring_kernels as rk
from ring_kernels import backends
from ring_kernels.backends import CAUSAL, FULL, GENERAL, BlockMask, choices, get_backend, recording, reset_choices
from ring_kernels.backends import torch_cuda
from ring_kernels.backends import torch_cuda_varlen as tcv
from ring_kernels.backends.reference import ReferenceBackend
from ring_kernels.torch_releases import triton_unsupported_reason

from _dist import run_world
from _paths import ROOT
from test_backends import fake_flash_attn

LOGGER = "ring_kernels.backends"


@pytest.fixture(autouse=True)
def fresh_record():
    reset_choices()
    yield
    reset_choices()


def _by_backend():
    return {c.backend: c for c in choices()}


def _qkv(s=8, h=4, hk=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, s, n, d, generator=g, dtype=dtype) for n in (h, hk, hk))


# ------------------------------------------------------------------------------------ what ran, on CPU


def test_ring_calls_record_the_backend_that_ran_and_why():
    q, k, v = _qkv()
    with recording() as plain:
        rk.ring_attn_func(q, k, v, causal=True)                           # one process: world 1
    with recording() as window:
        rk.ring_attn_func(q, k, v, causal=True, window_size=(2, 0))
    with recording() as capped:
        rk.ring_attn_func(q, k, v, causal=True, softcap=5.0)
    with recording() as named:
        rk.ring_attn_func(q, k, v, causal=True, backend="reference")
    rk.ring_attn_func(q, k, v, causal=True)

    assert plain.backends() == ["torch_cpu"] and window.backends() == ["torch_cpu"]
    assert capped.backends() == ["reference"] and named.backends() == ["reference"]
    (w,) = window.choices()
    assert w.requested == "auto" and w.shape_class == "cpu float32 head_dim=16 mask=general"
    (c,) = capped.choices()
    assert c.shape_class == "cpu float32 head_dim=16 mask=causal softcap"
    assert c.reason.startswith("auto: higher-ranked backends cannot: torch_cpu: softcap is not supported")
    (n,) = named.choices()
    assert n.requested == "reference" and n.reason == "requested by name (backend='reference')"
    # The process-wide record: every choice once, in first-seen order, with its calls.
    assert [(x.backend, x.requested, x.shape_class, x.calls) for x in choices()] == [
        ("torch_cpu", "auto", "cpu float32 head_dim=16 mask=causal", 2),
        ("torch_cpu", "auto", "cpu float32 head_dim=16 mask=general", 1),
        ("reference", "auto", "cpu float32 head_dim=16 mask=causal softcap", 1),
        ("reference", "reference", "cpu float32 head_dim=16 mask=causal", 1)]
    assert not any(x.fallback for x in choices())


def test_packed_documents_record_their_block_kind():
    """Packed documents run as one aligned causal block per document (no mask tensor); with a sliding window
    the blocks need one (kind general). Both variants that take cu_seqlens record the same."""
    q, k, v = (x[0] for x in _qkv(s=12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    for fn in (rk.ring_attn_varlen_func, rk.llama3_attn_varlen_func):
        with recording() as docs:
            fn(q, k, v, cu, causal=True)
        with recording() as windowed:
            fn(q, k, v, cu, causal=True, window_size=(3, 0))
        assert [(c.backend, c.shape_class) for c in docs.choices()] == [
            ("torch_cpu", "cpu float32 head_dim=16 mask=causal")]
        assert [(c.backend, c.shape_class) for c in windowed.choices()] == [
            ("torch_cpu", "cpu float32 head_dim=16 mask=general")]


def test_each_choice_is_logged_once_per_shape_class_and_reason(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(3):
        get_backend("auto", device="cpu", dtype=torch.float32, head_dim=64, mask_kind=FULL, softcap=2.0)
    get_backend("auto", device="cpu", dtype=torch.float32, head_dim=32, mask_kind=FULL, softcap=2.0)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in caplog.records if r.name == LOGGER)
    assert "backend='auto' -> reference for cpu float32 head_dim=64 mask=full softcap" in lines[0]
    assert "softcap is not supported by aten's CPU flash kernel" in lines[0]
    assert [c.calls for c in choices()] == [3, 1]
    reset_choices()                                        # forgotten: logged again when next made
    get_backend("auto", device="cpu", dtype=torch.float32, head_dim=64, mask_kind=FULL, softcap=2.0)
    assert len([r for r in caplog.records if r.name == LOGGER]) == 3 and choices()[0].calls == 1


_TRITON_CHILD = textwrap.dedent("""
    import json, torch
    import ring_kernels as rk
    from ring_kernels.backends import choices
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, n, 16, generator=g) for n in (2, 1, 1))
    out = rk.ring_attn_func(q, k, v, causal=True, backend="triton")
    want = rk.ring_attn_func(q, k, v, causal=True, backend="reference")
    print(json.dumps({"close": bool(torch.allclose(out, want, atol=1e-4)),
                      "choices": [c.as_dict() for c in choices()]}))
""")


def test_triton_interpreter_run_is_recorded():
    """Triton runs on CPU only under TRITON_INTERPRET=1 set before it is imported: a child process."""
    if triton_unsupported_reason() is not None:
        pytest.skip(triton_unsupported_reason())
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _TRITON_CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["close"]
    assert [(c["backend"], c["requested"], c["shape_class"], c["calls"]) for c in result["choices"]] == [
        ("triton", "triton", "cpu float32 head_dim=16 mask=causal", 1),
        ("reference", "reference", "cpu float32 head_dim=16 mask=causal", 1)]


# ---------------------------------------------------------------------------- CUDA's ranking and reasons


@pytest.fixture
def cuda_declared(monkeypatch):
    """The CUDA backends (not triton) declared present, on fresh instances; their support checks need no GPU.
    flash_attn is present too, as a stand-in package (tests/ring_kernels/test_backends.py's), to show auto never
    picks it."""
    package, iface = fake_flash_attn("2.7")
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    present = {"torch_cudnn", "torch_flash", "torch_efficient", "reference", "flash_attn"}
    monkeypatch.setattr(backends, "is_present", lambda name, dt: dt == "cuda" and name in present)
    monkeypatch.setattr(backends, "INSTANCES", {})


@pytest.mark.parametrize("mask_kind,softcap,dtype,expected,skipped", [
    (CAUSAL, 0.0, torch.bfloat16, "torch_cudnn", []),
    (GENERAL, 0.0, torch.bfloat16, "torch_efficient", ["torch_cudnn", "torch_flash"]),      # window / documents
    (CAUSAL, 30.0, torch.bfloat16, "reference", ["torch_cudnn", "torch_flash", "torch_efficient"]),  # softcap
    (FULL, 0.0, torch.float32, "torch_efficient", ["torch_cudnn", "torch_flash"]),
])
def test_auto_on_cuda_records_why_it_passed_over_faster_backends(cuda_declared, mask_kind, softcap, dtype,
                                                                 expected, skipped):
    chosen = get_backend("auto", device="cuda", dtype=dtype, head_dim=128, mask_kind=mask_kind, softcap=softcap)
    assert chosen.name == expected
    (c,) = choices()
    assert c.backend == expected and c.requested == "auto"
    if not skipped:
        assert c.reason == ("auto: the first present and capable backend of cuda's ranking "
                            "['torch_cudnn', 'torch_flash', 'triton', 'torch_efficient', 'reference']")
        return
    assert c.reason.startswith("auto: higher-ranked backends cannot: ")
    named = [part.split(":")[0] for part in c.reason[len("auto: higher-ranked backends cannot: "):].split("; ")]
    assert named == skipped                              # flash_attn (present) is not in the ranking
    if mask_kind == GENERAL:
        assert "mask kind 'general' not supported" in c.reason and c.shape_class.endswith("mask=general")
    if softcap:
        assert "softcap is not supported" in c.reason and c.shape_class.endswith("softcap")


def test_flash_attn_is_chosen_by_name_only(cuda_declared):
    assert backends.available_backends("cuda") == ["torch_cudnn", "torch_flash", "torch_efficient", "reference",
                                                   "flash_attn"]
    chosen = get_backend("flash_attn", device="cuda", dtype=torch.bfloat16, head_dim=128, mask_kind=CAUSAL)
    assert chosen.name == "flash_attn"
    assert [(c.backend, c.requested, c.reason) for c in choices()] == [
        ("flash_attn", "flash_attn", "requested by name (backend='flash_attn')")]


def test_varlen_kernel_choice_is_recorded(monkeypatch):
    monkeypatch.setattr(tcv, "op_available", lambda device: True)
    monkeypatch.setattr(tcv, "CUDNN_SHAPES", tcv.CudnnShapes())
    tcv.CUDNN_SHAPES.built.add((("cuda", torch.bfloat16, 128), 8192, 8192))   # as if cuDNN had built it before
    common = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, softcap=0.0)
    assert tcv.varlen_kernel_for("torch_flash", "torch_flash", document_lengths=[(64, 64)], **common) is not None
    many_short = [(32, 32)] * 40
    assert tcv.varlen_kernel_for("auto", "torch_cudnn", document_lengths=many_short, **common) is not None
    assert tcv.varlen_kernel_for("auto", "torch_cudnn", document_lengths=[(8192, 8192)], **common) is None
    got = [(c.backend, c.requested, c.shape_class) for c in choices()]
    assert got == [("torch_flash_varlen", "torch_flash", "cuda bfloat16 head_dim=128 mask=documents"),
                   ("torch_flash_varlen", "auto", "cuda bfloat16 head_dim=128 mask=documents")]
    assert "estimated faster than per-document torch_cudnn calls" in choices()[1].reason


KEY = ("cuda:0", torch.bfloat16, 128)


def test_new_document_lengths_go_to_flash_until_they_pay_for_cudnn_graphs():
    """Rent or buy: a shape cuDNN has no graph for costs its build (0.3 s), less what flash already lost on it."""
    shapes = tcv.CudnnShapes()
    long_doc = [(8192, 8192)]           # cuDNN's kernel saves ~6 ms a call on it against flash
    decisions = [shapes.per_block_calls_cost_more(long_doc, KEY) for _ in range(80)]
    switch = decisions.index(False)
    loss = shapes.flash_loss(8192, 8192)
    assert 5e-3 < loss < 7e-3
    assert all(decisions[:switch]) and not any(decisions[switch:])
    assert switch == math.ceil(shapes.build_s / loss - 1)    # regret + this call's loss reach the build cost
    assert (KEY, 8192, 8192) in shapes.built and not shapes.regret
    # built for this device, dtype and head dim only
    assert shapes.per_block_calls_cost_more(long_doc, ("cuda:0", torch.bfloat16, 64))


def test_varied_short_documents_never_buy_graphs():
    """SFT-like rows: ~2k-token documents of lengths that change at every step stay on one flash varlen call,
    since no length comes back often enough to repay its graph; a row of one long document is built at once."""
    shapes = tcv.CudnnShapes()
    g = torch.Generator().manual_seed(0)
    for step in range(20):
        lengths = torch.randint(1024, 3072, (16,), generator=g).tolist()
        docs = [(n, n) for n in lengths]
        for layer_call in range(48):       # 16 layers: forward, recomputation, backward
            assert shapes.per_block_calls_cost_more(docs, KEY), (step, layer_call)
    assert not shapes.built
    assert not shapes.per_block_calls_cost_more([(131072, 131072)], KEY)


def test_shape_memory_is_bounded():
    shapes = tcv.CudnnShapes(limit=64)
    for n in range(1, 500):
        shapes.per_block_calls_cost_more([(n, n)] * 40, KEY)
    assert len(shapes.regret) <= 64 and not shapes.built


# ------------------------------------------------------------------------- torch_cuda's GQA fallback


def _refusing_gqa(impl, monkeypatch, message="cudnn: heads of key must equal heads of query (injected)"):
    """``impl``'s aten calls replaced by the reference backend, refusing fewer K/V heads like old torch."""
    ref = ReferenceBackend()
    seen = []

    def fwd(q, k, v, scale, kind, mask):
        seen.append(k.shape[2])
        if k.shape[2] != q.shape[2]:
            raise RuntimeError(message)
        return ref.forward(q, k, v, scale=scale, mask=mask)

    def bwd(dout, q, k, v, out, lse, scale, kind, mask):
        seen.append(k.shape[2])
        if k.shape[2] != q.shape[2]:
            raise RuntimeError(message)
        return ref.backward(dout, q, k, v, out, lse, scale=scale, mask=mask)

    monkeypatch.setattr(impl, "_fwd", fwd)
    monkeypatch.setattr(impl, "_bwd", bwd)
    return seen


def test_gqa_fallback_logs_a_warning_records_it_and_stays_exact(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    impl = torch_cuda.TorchCudnnBackend()
    seen = _refusing_gqa(impl, monkeypatch)
    q, k, v = _qkv(s=6, h=4, hk=2, d=16)
    mask = BlockMask(causal=True)
    out, lse = impl.forward(q, k, v, scale=0.25, mask=mask)
    want_out, want_lse = ReferenceBackend().forward(q, k, v, scale=0.25, mask=mask)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert seen == [2, 4]                                       # refused with 2 K/V heads, then expanded to 4

    dout = torch.randn_like(out)
    grads = impl.backward(dout, q, k, v, out, lse, scale=0.25, mask=mask)
    want = ReferenceBackend().backward(dout, q, k, v, out, lse, scale=0.25, mask=mask)
    for got, expected in zip(grads, want):                      # dK/dV folded back to the 2 K/V heads
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)
    assert seen == [2, 4, 4]                                    # decided once: the backward expands directly

    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "torch_cudnn falls back" in warnings[0].getMessage()
    assert "RuntimeError: cudnn: heads of key must equal heads of query (injected)" in warnings[0].getMessage()
    (c,) = choices()
    assert c.fallback and c.backend == "torch_cudnn" and c.calls == 2
    assert "repeats K/V heads" in c.reason and "4 query heads over 2 K/V heads" in c.reason
    assert "(injected)" in c.reason and c.shape_class == "cpu float32 head_dim=16 mask=any"


def test_an_error_that_expanding_does_not_fix_propagates_and_decides_nothing(monkeypatch):
    impl = torch_cuda.TorchFlashBackend()

    def broken(q, k, v, scale, kind, mask):
        raise RuntimeError(f"bad input with {k.shape[2]} K/V heads")

    monkeypatch.setattr(impl, "_fwd", broken)
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="with 4 K/V heads") as info:
        impl.forward(q, k, v, scale=0.25, mask=BlockMask())
    assert "with 2 K/V heads" in str(info.value.__context__)   # the first refusal stays in the chain
    assert impl._native_gqa is None and choices() == []


def test_efficient_backend_expands_by_design_at_info(monkeypatch, caplog):
    """The efficient op never takes fewer K/V heads: noted (INFO), not a fallback (no WARNING)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    impl = torch_cuda.TorchEfficientBackend()
    _refusing_gqa(impl, monkeypatch)
    q, k, v = _qkv()
    impl.forward(q, k, v, scale=0.25, mask=BlockMask())
    (c,) = choices()
    assert not c.fallback and "the op needs as many K/V heads as query heads" in c.reason
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------------- on hfpatch's Patch


def _patch_world(rank, world_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(1))
    reset_choices()
    with hfpatch.apply(dist.group.WORLD, kernel="zigzag:reference", model=model, verify=False) as patch:
        batch = patch.shard_inputs(ids)
        with torch.no_grad():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        got = [(c.backend, c.requested, c.shape_class, c.calls) for c in patch.backend_choices]
        same = patch.backend_choices == choices()
    return got, same


def test_patch_exposes_the_backend_choices():
    for got, same in run_world(2, _patch_world, timeout=180):
        assert same
        assert got == [("reference", "reference", "cpu float32 head_dim=16 mask=causal", 2)]   # 2 layers
