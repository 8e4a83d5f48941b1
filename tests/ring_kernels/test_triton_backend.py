"""The Triton block backend on CPU, through Triton's interpreter, against a float64 plain-math reference.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the kernels run in one subprocess
(this file run as a script) over every case at once: the parent builds seeded inputs, the child runs
``TritonBackend.forward``/``backward`` and saves the results, and each pytest case compares its own
out, lse, dq, dk, dv with autograd through float64 attention. Shapes are tiny but cover ragged tails,
several blocks, diagonal blocks split into sub-blocks, GQA/MQA, softcap, strided inputs, fp16, head dims
16..128, an EMPTY block, and the ring contract (two blocks merged by LSE, backward from the merged result).

A second child, run at the same time, compiles the three main kernels for sm_90 (Hopper) ahead of time, with
no GPU: the interpreter does not see GPU-only compile errors, register spills or shared-memory overflow.

bf16 is covered on the GPU only (tests/gpu/test_triton_gpu.py): the interpreter computes tl.dot on bf16 as
integers (numpy has no bfloat16). fp32 and fp16 cover the same code here.

Needs triton; triton < 3.7's interpreter fails with numpy >= 2.4 (triton-lang/triton#9171), so CI installs
triton 3.8 (the GPU kernels use only APIs that exist in 3.6). Skipped only when triton cannot be imported.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import traceback

import pytest
import torch

from ring_kernels.backends.base import BlockMask
from ring_kernels.tolerances import assert_close, tolerance
from ring_kernels.torch_releases import triton_unsupported_reason

# No triton, or one older than the kernels are tested with (tests/ring_kernels/test_torch_releases.py checks that
# refusal).
pytestmark = pytest.mark.skipif(triton_unsupported_reason() is not None, reason=str(triton_unsupported_reason()))

# Fixed launch blocks per kernel: (BLOCK_M, BLOCK_N). "mixed" splits the causal diagonal into sub-blocks.
_B16 = {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16), "delta": (16, 0)}
_MIXED = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16), "delta": (32, 0)}
_WIDE_N = {"fwd": (16, 32), "dkdv": (32, 32), "dq": (16, 32), "delta": (16, 0)}

# id: (B, Sq, Sk, H, Hk, D, causal, softcap, dtype, layout, blocks). layout: "contiguous", "strided",
# "merged" (ring contract: the keys split into an earlier FULL block and the diagonal CAUSAL block), "empty".
CASES = {
    "full_mha_ragged": (2, 40, 40, 2, 2, 16, False, 0.0, "float32", "contiguous", _B16),
    "causal_gqa_subblocks": (1, 48, 48, 4, 2, 32, True, 0.0, "float32", "contiguous", _MIXED),
    "causal_mqa_ragged": (1, 37, 37, 2, 1, 16, True, 0.0, "float32", "contiguous", _B16),
    "full_cross_lengths_mqa": (1, 24, 50, 4, 1, 16, False, 0.0, "float32", "contiguous", _WIDE_N),
    "softcap_full": (1, 40, 40, 2, 2, 16, False, 2.0, "float32", "contiguous", _B16),
    "softcap_causal_gqa": (1, 33, 33, 4, 2, 16, True, 1.5, "float32", "contiguous", _MIXED),
    "strided_causal": (1, 32, 32, 4, 2, 16, True, 0.0, "float32", "strided", _B16),
    "strided_full_d64": (1, 20, 28, 2, 2, 64, False, 0.0, "float32", "strided", _B16),
    "fp16_causal_d128": (1, 32, 32, 2, 1, 128, True, 0.0, "float16", "contiguous", _MIXED),
    "ring_merged_gqa": (1, 24, 48, 4, 2, 16, True, 0.0, "float32", "merged", _MIXED),
    "ring_merged_softcap": (1, 16, 32, 2, 1, 32, True, 3.0, "float32", "merged", _B16),
    "empty_block": (1, 16, 16, 2, 1, 16, True, 0.0, "float32", "empty", _B16),
    # The CUDA launch path: autotuner (fake timer) -> heuristics (EVEN_*) -> kernel, grid from the chosen config.
    "autotuned_launch_causal_mqa": (1, 70, 70, 2, 1, 16, True, 0.0, "float32", "contiguous", "autotune"),
    # Then another length in the same autotune bucket (70 and 100 -> 128): the tuners' choice is reused, not re-timed.
    "autotuned_same_bucket_causal_mqa": (1, 100, 100, 2, 1, 16, True, 0.0, "float32", "contiguous", "autotune_again"),
}


def _tolerance(dtype: str, name: str):
    """The table's kernel-vs-float64 entry (ring_kernels.tolerances) for ``name`` (out, lse, dq/dk/dv)."""
    return tolerance("kernel", dtype, name if name in ("out", "lse") else "grad")


# --------------------------------------------------------------------------------------------- inputs
def _inputs(case_id: str) -> dict:
    """Seeded q (B,Sq,H,D), k/v (B,Sk,Hk,D), dout like q, in the case's dtype (contiguous)."""
    b, sq, sk, h, hk, d, _causal, softcap, dtype, _layout, _blocks = CASES[case_id]
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    amp = 2.0 if softcap > 0 else 1.0  # larger scores so that the tanh cap really bends them
    dt = getattr(torch, dtype)
    return {
        "q": (amp * torch.randn(b, sq, h, d, generator=gen)).to(dt),
        "k": (amp * torch.randn(b, sk, hk, d, generator=gen)).to(dt),
        "v": torch.randn(b, sk, hk, d, generator=gen).to(dt),
        "dout": torch.randn(b, sq, h, d, generator=gen).to(dt),
    }


def _reference(case_id: str, inp: dict) -> dict:
    """float64 attention with autograd: out, lse (B,H,Sq), dq, dk, dv (K/V grads summed over each group)."""
    b, sq, sk, h, hk, d, causal, softcap, _dtype, layout, _blocks = CASES[case_id]
    q, k, v = (inp[n].double().requires_grad_() for n in ("q", "k", "v"))
    scale = 1.0 / math.sqrt(d)
    kk, vv = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    # Query i sits at global position (Sk - Sq) + i: the merged case is the second half of a causal sequence.
    q_pos = torch.arange(sq) + (sk - sq)
    visible = torch.arange(sk)[None, :] <= q_pos[:, None] if causal else torch.ones(sq, sk, dtype=torch.bool)
    if layout == "empty":
        visible = torch.zeros(sq, sk, dtype=torch.bool)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    out.backward(inp["dout"].double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


# ------------------------------------------------------------------------------ child (interpreter)
def _strided(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values through a non-contiguous view: a slice of a packed qkv, or a transposed (B,H,S,D)."""
    if kind == "packed":
        packed = torch.zeros(x.shape[0], x.shape[1], 3, x.shape[2], x.shape[3], dtype=x.dtype)
        packed[:, :, 1] = x
        return packed[:, :, 1]
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _run_case(backend, case_id: str, inp: dict) -> dict:
    b, sq, sk, h, hk, d, causal, softcap, _dtype, layout, _blocks = CASES[case_id]
    scale = 1.0 / math.sqrt(d)
    q, k, v, dout = inp["q"], inp["k"], inp["v"], inp["dout"]
    if layout == "strided":
        q, k, v, dout = _strided(q, "packed"), _strided(k, "bhsd"), _strided(v, "packed"), _strided(dout, "bhsd")
        assert not any(x.is_contiguous() for x in (q, k, v, dout))
    if layout == "merged":
        # Queries are the last Sq positions; keys split where the queries start: [0, Sk-Sq) is FULL for every
        # query, [Sk-Sq, Sk) is the aligned CAUSAL diagonal. Merge by LSE in fp32, then backward both blocks.
        q0, split = sk - sq, sk - sq
        blocks = [(slice(0, split), BlockMask(causal=True, q_start=q0, k_start=0)),
                  (slice(split, sk), BlockMask(causal=True, q_start=q0, k_start=split))]
        assert [m.kind(sq, sl.stop - sl.start) for sl, m in blocks] == ["full", "causal"]
        parts = [backend.forward(q, k[:, sl], v[:, sl], scale=scale, mask=m, softcap=softcap) for sl, m in blocks]
        lse = torch.logaddexp(parts[0][1], parts[1][1])
        out = sum(o.float() * torch.exp(l - lse).transpose(1, 2)[..., None] for o, l in parts).to(q.dtype)
        grads = [backend.backward(dout, q, k[:, sl], v[:, sl], out, lse, scale=scale, mask=m, softcap=softcap)
                 for sl, m in blocks]
        dq = grads[0][0] + grads[1][0]
        dk = torch.cat([grads[0][1], grads[1][1]], dim=1)
        dv = torch.cat([grads[0][2], grads[1][2]], dim=1)
        return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    mask = BlockMask(causal=causal)
    if layout == "empty":
        mask = BlockMask(causal=True, q_start=0, k_start=sq)   # every key after every query
        assert mask.kind(sq, sk) == "empty"
    out, lse = backend.forward(q, k, v, scale=scale, mask=mask, softcap=softcap)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, scale=scale, mask=mask, softcap=softcap)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _autotune_with_fake_timer(triton_attn) -> None:
    """Launch through the autotuners as on CUDA: each tries its two smallest configs, timed by a stand-in
    (the interpreter has no GPU timer); the second config tried "wins", so the grid must follow it."""
    def fake_bench(fn, *args, quantiles=None, **kwargs):
        fn()
        fake_bench.calls += 1
        ms = 1.0 / fake_bench.calls
        return [ms, ms, ms] if quantiles else ms
    fake_bench.calls = 0
    for tuner in (triton_attn.attn_fwd_tuned, triton_attn.attn_bwd_dkdv_tuned, triton_attn.attn_bwd_dq_tuned):
        tuner.configs = sorted(tuner.configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])[:2]
        tuner.do_bench = fake_bench
    triton_attn.fixed_blocks = None


def _tuning_state(tuners) -> dict:
    """How many timings the fake timer took, and each tuner's cache keys (the key's first four entries are the
    names in ``TUNE_KEY``: tune_sq, tune_sk, HEAD_DIM, IS_CAUSAL; then the tensors' dtypes)."""
    return {"bench_calls": tuners[0].do_bench.calls, "keys": [[tuple(k[:4]) for k in t.cache] for t in tuners]}


def _child_main(in_path: str, out_path: str) -> None:
    """Run every case under the interpreter; a failing case records its traceback, the others still run."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "the child must run with TRITON_INTERPRET=1"
    # deferred (triton): this module is collected where triton is absent; the child runs only where it is
    from ring_kernels.backends import triton_attn

    backend = triton_attn.TritonBackend()
    tuners = (triton_attn.attn_fwd_tuned, triton_attn.attn_bwd_dkdv_tuned, triton_attn.attn_bwd_dq_tuned)
    results = {}
    for case_id, inp in torch.load(in_path).items():
        start = time.process_time()   # CPU seconds: the work itself, not how busy the machine is
        blocks, before = CASES[case_id][-1], None
        try:
            if blocks == "autotune":
                _autotune_with_fake_timer(triton_attn)
            elif blocks == "autotune_again":   # the tuners as the previous case left them (cache, fake timer)
                before = _tuning_state(tuners)
            else:
                triton_attn.set_fixed_blocks(blocks)
            results[case_id] = {"tensors": _run_case(backend, case_id, inp)}
        except Exception:  # reported by that case's test, with the child's traceback
            results[case_id] = {"error": traceback.format_exc()}
        results[case_id]["seconds"] = time.process_time() - start
        if blocks in ("autotune", "autotune_again"):
            if "tensors" in results[case_id]:
                results[case_id]["best_configs"] = [str(t.best_config) for t in tuners]
            results[case_id]["tuning"] = (before, _tuning_state(tuners))
    torch.save(results, out_path)


# ------------------------------------------------------------------------------- child (AOT for sm_90)
# One launch configuration per kernel, chosen so that together they compile every loop variant: causal
# (diagonal + interior), ragged tails (EVEN_* False), softcap. The configs are the autotuner's first choices.
_AOT_KERNELS = {
    "fwd": ("_attn_fwd", dict(IS_CAUSAL=True, SOFTCAP=False, EVEN_N=False, BLOCK_M=128, BLOCK_N=64), 8, 3),
    "dkdv": ("_attn_bwd_dkdv", dict(IS_CAUSAL=True, SOFTCAP=False, EVEN_M=False, BLOCK_M=32, BLOCK_N=128), 8, 3),
    "dq": ("_attn_bwd_dq", dict(IS_CAUSAL=False, SOFTCAP=True, EVEN_N=False, BLOCK_M=128, BLOCK_N=64), 8, 3),
}
_HOPPER_SMEM = 232448  # bytes of shared memory one block may use on sm_90


def _aot_main(out_path: str) -> None:
    """Compile for sm_90 as the GPU launch would (bf16, D=128, strides divisible by 16); save metadata."""
    import triton
    from triton.backends.compiler import GPUTarget

    # deferred (triton): this module is collected where triton is absent; the child runs only where it is
    from ring_kernels.backends import triton_attn

    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    results = {}
    for label, (name, consts, warps, stages) in _AOT_KERNELS.items():
        start = time.perf_counter()
        try:
            fn = getattr(triton_attn, name).fn           # the JITFunction under the heuristics wrapper
            consts = dict(consts, HEAD_DIM=128, DOT_PRECISION="tf32")
            if "stride_ls" in fn.arg_names:
                consts["stride_ls"] = 1                      # a contiguous lse: the launcher specialises 1
            signature, attrs = {}, {}
            for i, arg in enumerate(fn.arg_names):
                if arg in consts:
                    signature[arg] = "constexpr"
                elif arg in ("Lse", "Delta"):
                    signature[arg] = "*fp32"
                elif arg in ("Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"):
                    signature[arg] = "*bf16"
                elif arg in ("scale", "cap_in", "score_scale2"):
                    signature[arg] = "fp32"
                else:
                    signature[arg] = "i32"
                if signature[arg][0] == "*" or arg.startswith("stride"):
                    attrs[(i,)] = [["tt.divisibility", 16]]   # what the launcher specialises on at run time
            src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
            options = backend.parse_options({"num_warps": warps, "num_stages": stages}).__dict__
            compiled = triton.compile(src, target=target, options=options)
            results[label] = {"shared": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"]}
        except Exception:
            results[label] = {"error": traceback.format_exc()}
        results[label]["seconds"] = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump(results, f)


# ------------------------------------------------------------------------------------- parent (pytest)
def _has_nvidia_backend() -> bool:
    try:
        return importlib.util.find_spec("triton.backends.nvidia") is not None
    except ImportError:
        return False


@pytest.fixture(scope="module")
def _children(tmp_path_factory):
    """Start both children at once (2 cores on CI): the interpreter cases and the sm_90 compile."""
    tmp = tmp_path_factory.mktemp("triton_interp")
    paths = {"in": str(tmp / "inputs.pt"), "interp": str(tmp / "results.pt"), "aot": str(tmp / "aot.json")}
    torch.save({cid: _inputs(cid) for cid in CASES}, paths["in"])
    me = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("TRITON_INTERPRET", None)
    procs = {"interp": subprocess.Popen([sys.executable, me, paths["in"], paths["interp"]], text=True,
                                        env=dict(env, TRITON_INTERPRET="1"),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)}
    if _has_nvidia_backend():
        procs["aot"] = subprocess.Popen([sys.executable, me, "--aot", paths["aot"]], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    yield procs, paths
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait(children, which: str):
    procs, paths = children
    output, _ = procs[which].communicate(timeout=300)
    if procs[which].returncode != 0:
        pytest.fail(f"{which} child failed (rc={procs[which].returncode}):\n{output}")
    return paths[which]


@pytest.fixture(scope="module")
def interpreter_results(_children):
    return torch.load(_wait(_children, "interp"))


@pytest.fixture(scope="module")
def aot_results(_children):
    if "aot" not in _children[0]:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    with open(_wait(_children, "aot")) as f:
        return json.load(f)


@pytest.mark.parametrize("kernel", list(_AOT_KERNELS))
def test_compiles_for_hopper(aot_results, kernel):
    """The GPU path compiles for sm_90, uses wgmma (tensor cores) and fits in shared memory."""
    result = aot_results[kernel]
    assert "error" not in result, f"{kernel} failed to compile for sm_90:\n{result.get('error')}"
    assert result["wgmma"], f"{kernel}: no wgmma instruction in the sm_90 PTX (tensor cores unused)"
    assert 0 < result["shared"] <= _HOPPER_SMEM, f"{kernel}: {result['shared']} bytes of shared memory"


@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_float64_reference(interpreter_results, case_id):
    result = interpreter_results[case_id]
    assert "error" not in result, f"{case_id} raised in the interpreter:\n{result.get('error')}"
    got = result["tensors"]
    inp = _inputs(case_id)
    ref = _reference(case_id, inp)
    dtype = CASES[case_id][8]
    for name in ("out", "lse", "dq", "dk", "dv"):
        g, r = got[name], ref[name]
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != reference {tuple(r.shape)}"
        want_dtype = torch.float32 if name == "lse" else getattr(torch, dtype)
        assert g.dtype == want_dtype, f"{name}: dtype {g.dtype}, expected {want_dtype}"
        assert not torch.isnan(g).any(), f"{name} has NaN"
        if name == "lse":
            inf = torch.isinf(r)
            assert torch.equal(torch.isinf(g), inf) and bool((g[inf] < 0).all()), "lse -inf rows differ"
            g, r = g[~inf], r[~inf]
        assert_close(g, r, _tolerance(dtype, name), f"{case_id}: {name}")
    if CASES[case_id][9] == "empty":
        assert all(bool((got[n] == 0).all()) for n in ("out", "dq", "dk", "dv")), "empty block must give zeros"
    if CASES[case_id][10] == "autotune":
        assert len(result["best_configs"]) == 3 and "None" not in result["best_configs"], result["best_configs"]


def test_autotune_is_keyed_by_length_bucket(interpreter_results):
    """Sq = Sk = 70 tunes each kernel once, under the key (128, 128, head dim 16, causal); Sq = Sk = 100, in the
    same bucket, reuses those choices: no new key, no new timing (a packed batch does not tune per document)."""
    tuned = interpreter_results["autotuned_launch_causal_mqa"]["tuning"][1]
    before, after = interpreter_results["autotuned_same_bucket_causal_mqa"]["tuning"]
    assert tuned["keys"] == [[(128, 128, 16, True)]] * 3, tuned
    assert tuned["bench_calls"] == 3 * 2, tuned          # three kernels, two configurations each
    assert before == tuned and after == tuned, (before, after)


def test_tune_bucket_table(triton_attn):
    """Lengths share a key with every length up to the same power of two, within [16, 16384]."""
    table = {0: 16, 1: 16, 16: 16, 17: 32, 70: 128, 100: 128, 128: 128, 129: 256, 4097: 8192, 8192: 8192,
             8193: 16384, 16384: 16384, 100_000: 16384}
    assert {n: triton_attn.tune_bucket(n) for n in table} == table
    assert triton_attn.TUNE_KEY == ["tune_sq", "tune_sk", "HEAD_DIM", "IS_CAUSAL"]
    for tuner in (triton_attn.attn_fwd_tuned, triton_attn.attn_bwd_dkdv_tuned, triton_attn.attn_bwd_dq_tuned):
        assert tuner.keys == triton_attn.TUNE_KEY and {"tune_sq", "tune_sk"} <= set(tuner.arg_names)


def test_interpreter_budget(interpreter_results):
    """All cases together stay small enough for CI (2 cores): CPU seconds per case, listed on failure."""
    seconds = {cid: round(r["seconds"], 2) for cid, r in interpreter_results.items()}
    assert sum(seconds.values()) < 30, f"interpreter cases too slow (CPU seconds): {seconds}"


# ---------------------------------------------------------------------------- errors (no kernel launch)
@pytest.fixture()
def triton_attn():
    return importlib.import_module("ring_kernels.backends.triton_attn")


def test_unsupported_reasons(triton_attn):
    be = triton_attn.TritonBackend()
    ok = dict(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128, mask_kind="causal", softcap=0.0)
    assert be.unsupported_reason(**ok) is None
    assert be.unsupported_reason(**{**ok, "softcap": 30.0}) is None
    for d in (16, 32, 64, 256):
        assert be.unsupported_reason(**{**ok, "head_dim": d}) is None
    cases = [({"head_dim": 96}, "head_dim 96"), ({"head_dim": 8}, "head_dim 8"),
             ({"mask_kind": "general"}, "general"), ({"dtype": torch.float64}, "float64"),
             ({"softcap": -1.0}, "softcap")]
    if not triton_attn.INTERPRET:
        cases.append(({"device": torch.device("cpu")}, "TRITON_INTERPRET"))
    for change, needle in cases:
        reason = be.unsupported_reason(**{**ok, **change})
        assert reason is not None and needle in reason, (change, reason)


def test_bad_inputs_raise_clear_errors(triton_attn):
    be = triton_attn.TritonBackend()
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 3, 16)
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k/v heads \(3\)"):
        be.forward(q, k, k, scale=0.25, mask=BlockMask())
    with pytest.raises(ValueError, match=r"head_dim=16"):
        be.forward(q, torch.randn(1, 8, 4, 32), torch.randn(1, 8, 4, 32), scale=0.25, mask=BlockMask())
    with pytest.raises(TypeError, match="share one dtype"):
        be.forward(q, q.half(), q, scale=0.25, mask=BlockMask())
    with pytest.raises(ValueError, match=r"\(batch, seqlen, heads, head_dim\)"):
        be.forward(q[0], q[0], q[0], scale=0.25, mask=BlockMask())
    with pytest.raises(TypeError, match="mask must be a BlockMask"):
        be.forward(q, q, q, scale=0.25, mask=True)
    with pytest.raises(TypeError, match="scale must be a finite float"):
        be.forward(q, q, q, scale=float("nan"), mask=BlockMask())
    with pytest.raises(ValueError, match=r"scale must be > 0 .*got -0.25"):
        be.forward(q, q, q, scale=-0.25, mask=BlockMask())
    with pytest.raises(ValueError, match="cannot compute this block: .*general"):
        be.forward(q, q, q, scale=0.25, mask=BlockMask(causal=True, q_start=0, k_start=4))
    with pytest.raises(ValueError, match="lse must be a float32 tensor"):
        be.backward(q, q, q, q, q, torch.zeros(1, 4, 8, dtype=torch.float64), scale=0.25, mask=BlockMask())


@pytest.mark.parametrize("installed, expected", [
    (None, r"triton is not installed \(pip install 'hfpatch\[triton\]'\)"),
    ("3.3.1", r"triton 3\.3\.1 is older than 3\.6, .*TRITON_OLDEST\)\. Fix: pip install 'triton>=3\.6'")])
def test_import_without_a_tested_triton_is_a_clean_import_error(monkeypatch, installed, expected):
    """No triton, or one older than TRITON_OLDEST (read from the distribution's metadata): a named ImportError."""
    from importlib import metadata

    real_version = metadata.version

    def version(name):
        if name != "triton":
            return real_version(name)
        if installed is None:
            raise metadata.PackageNotFoundError(name)
        return installed

    name = "ring_kernels.backends.triton_attn"
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ImportError, match=expected):
        importlib.import_module(name)


if __name__ == "__main__":
    if sys.argv[1] == "--aot":
        _aot_main(sys.argv[2])
    else:
        _child_main(sys.argv[1], sys.argv[2])
