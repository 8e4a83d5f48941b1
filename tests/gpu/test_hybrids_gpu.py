"""benchmarks/hybrid_step.py's two ~1B hybrids (``--size 1b``: Qwen3.5-text, Nemotron-H) under hfpatch CP on 2 GPUs
(NCCL) equal the same model without CP: the loss, this rank's logits and every parameter gradient.

    python -m pytest -s -rs tests/gpu/test_hybrids_gpu.py -k cuda     # one NCCL world of 2 ranks on GPUs 0 and 1

The CP side is the script's hfpatch step (``make_runner("hfpatch")``: ``apply(model=)``, FSDP2 over both ranks,
full activation checkpointing, ``shard_inputs``, the chunked LM-head loss, ``reduce_loss``; no optimizer step) on
one causal sequence of 2 x 1024 tokens (``TARGETS``); the gradients are the FSDP2-reduced ones
(``DTensor.full_tensor()``). The reference is the script's one-GPU step (``make_runner("single")``: no CP, no
FSDP, the same checkpointing and loss, causal SDPA pinned to the efficient backend, which takes fp32 and head
dim 256) on the whole sequence, computed on every rank. Logits: the decoder and LM head run once more under
``no_grad`` on this rank's shard (CP) and on the whole sequence (reference, kept at this rank's positions).
Every mixer module must be in ``Patch.mixers.modules`` and each of its sequence kernels must have run its CP form
once per mixer layer in the forward and once in the checkpoint's recomputation.

Tolerances (ring_kernels.tolerances, no other bound):

- the loss, bf16 (the benchmark's dtype) and fp32, and the logits in fp32: the "cp" entries ("loss", "out"). The
  bf16 logits are measured and printed, not held to the "cp" bf16 "out" bound: that bound was set on small models,
  and a free-running bf16 forward through a 1B hybrid's layers compounds the two sides' rounding past it (Qwen3.5
  1b on 2 H100s: 1.04 x the bound, the loss 5e-4 x its bound). Whether that difference is rounding is what
  apply(model=)'s probe decides, module by module (tests/model/test_model_probe_scale.py); here the fp32 logits and
  gradients show the CP step computes the non-CP function.
- the gradients, fp32 only: the "sweep" entry, the project's entry for these mixer families (each parameter within
  1e-4 of its own largest entry plus 1e-6 of the model's largest gradient; tests/tooling/test_hybrid_step_bench.py
  says why). The gates of the first mixer layer (``A_log``, ``dt_bias``) get gradients that are rounding noise at
  the model's scale, and without that floor a per-parameter bound cannot tell rounding from error there: in bf16 the
  "cp" entry's per-parameter bound (0.1, no floor) fails on Qwen3.5's first-layer ``A_log`` and ``dt_bias``
  already at ``--size tiny`` on CPU (relative errors 0.41 and 0.38) while every other gradient is within it. The
  table has no bf16 entry with a floor, so the gradients are compared in fp32.

``cpu-tiny``: the same code on 2 gloo CPU processes, ``--size tiny`` (a smoke of this module; the CPU suite's
tests/tooling/test_hybrid_step_bench.py is the CPU check). ``cuda-1b`` skips without 2 CUDA devices; a family this
transformers cannot build, or whose mixer hfpatch's registry does not know, skips with the reason.
"""
from __future__ import annotations

import faulthandler
import sys
import time

import pytest
import torch

from _dist import run_world
from _paths import BENCHMARKS
from ring_kernels.tolerances import assert_close, error_of, tolerance
from test_hybrid_step_bench import KERNEL_ROLES, family_skip_reason

_BENCH = str(BENCHMARKS)
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

import hybrid_step as hs  # noqa: E402
import train_step as ts  # noqa: E402

pytestmark = [pytest.mark.gpu]

WORLD = 2
FAMILIES = tuple(hs.FAMILIES)
DTYPES = ("bfloat16", "float32")
# target -> (device, process-group backend, --size, tokens per rank, seconds the world may take)
TARGETS = {"cuda-1b": ("cuda", "nccl", "1b", 1024, 420), "cpu-tiny": ("cpu", "gloo", "tiny", 64, 240)}
# (dtype, quantity) pairs compared (module docstring: the gradients need the fp32 "sweep" entry's floor)
COMPARED = (("bfloat16", "loss"), ("float32", "loss"), ("float32", "logits"), ("float32", "grads"))
_FLAG = {"bfloat16": "bf16", "float32": "fp32"}


# quantity -> (comparison, quantity) of its entry in ring_kernels.tolerances
_ENTRIES = {"loss": ("cp", "loss"), "logits": ("cp", "out"), "grads": ("sweep", "grad")}


def bound(dtype: str, quantity: str):
    """The table entry ``quantity`` is compared with at ``dtype`` (module docstring)."""
    comparison, name = _ENTRIES[quantity]
    return tolerance(comparison, dtype, name)


def _args(family: str, dtype: str, device: str, size: str, tokens: int):
    # fp32 on CUDA: the ring on torch's efficient kernel, the one fp32 CUDA op the reference uses too; "auto" took
    # 41 s over its first fp32 call on an H100 (benchmarks/results/probe_margin_fp32_2xH100_b2deb62.txt)
    kernel = ["--kernel", "zigzag:torch_efficient"] if device == "cuda" and dtype == "float32" else []
    return hs.parse_args(["--family", family, "--device", device, "--dtype", _FLAG[dtype], "--size", size,
                          "--seq-per-gpu", str(tokens), "--optimizer", "none", "--sdpa-backend", "efficient",
                          *kernel])


def _logits(loss_module, input_ids, position_ids, keep=None) -> torch.Tensor:
    """(B, S, V) logits of ``loss_module.model`` (a ``ts.ChunkedLoss``), no grad; ``keep``: only those sequence
    positions. An FSDP2 root (the CP side) gathers its own parameters (embeddings, norm, LM head) meanwhile; the
    decoder layers gather theirs in their forward."""
    fsdp_root = hasattr(loss_module, "unshard")
    with torch.no_grad():
        if fsdp_root:
            loss_module.unshard()
        try:
            model = loss_module.model
            hidden = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            return model.lm_head(hidden if keep is None else hidden[:, keep])
        finally:
            if fsdp_root:
                loss_module.reshard()


def _cp_side(args, device, dtype, data) -> dict:
    spec = hs.FAMILIES[args.family]
    runner = hs.make_runner("hfpatch", args, device, dtype)
    try:
        mixers = runner.patch.mixers
        mixers.calls.clear()
        loss = runner.step(data)
        out = {"loss": loss, "calls": dict(mixers.calls), "mixer_paths": [p for p, _, _ in mixers.modules],
               "expected_mixers": [n.replace("_checkpoint_wrapped_module.", "")
                                   for n, m in runner.model.named_modules() if type(m).__name__ == spec.mixer_class],
               "grads": {n: p.grad.full_tensor() for n, p in runner.loss_module.named_parameters()}}
        batch = runner.patch.shard_inputs(data.input_ids, labels=data.labels)
        out["positions"] = batch["position_ids"][0]
        out["logits"] = _logits(runner.loss_module, batch["input_ids"], batch["position_ids"])
        info = runner.info()
        out["info"] = {"attention": info["attention"], "mixer_kernels": info["mixer_kernels"],
                       "layers": len(out["expected_mixers"])}
    finally:
        runner.close()
    return out


def _reference(args, device, dtype, data, positions) -> dict:
    runner = hs.make_runner("single", args, device, dtype)
    loss = runner.step(data)
    grads = {n: p.grad for n, p in runner.loss_module.named_parameters()}
    return {"loss": loss, "grads": grads, "logits": _logits(runner.loss_module, data.input_ids, data.position_ids,
                                                           keep=positions)}


def _measure(actual, expected, dtype: str, quantity: str, what: str, largest=None) -> dict:
    """``{"ratio": error / allowed error, "failure": assert_close's message or None}``."""
    entry = bound(dtype, quantity)
    ratio = error_of(actual, expected, entry, largest=largest)
    failure = None
    if ratio > 1.0:
        try:
            assert_close(actual, expected, entry, what, largest=largest)
        except AssertionError as exc:
            failure = str(exc)
    return {"ratio": ratio, "failure": failure}


def _compare(rank, family, dtype_name, device, size, tokens, world) -> dict:
    """One family at one dtype: the CP step, the reference, and each quantity's error / bound (module docstring);
    the gradients on rank 0 only (after ``full_tensor`` they are the same on every rank)."""
    dtype = getattr(torch, dtype_name)
    tag = f"{family} {dtype_name} rank {rank}"
    args = _args(family, dtype_name, device.type, size, tokens)
    data = ts.step_data("batch", tokens, world, args.vocab_size, device, args.seed)
    started = time.perf_counter()
    cp = _cp_side(args, device, dtype, data)
    cp_seconds = time.perf_counter() - started
    ts.free_memory(device)
    ref = _reference(args, device, dtype, data, cp["positions"])
    print(f"[hybrids {device.type}] {tag}: the CP side took {cp_seconds:.1f} s, the reference "
          f"{time.perf_counter() - started - cp_seconds:.1f} s", flush=True)
    result = {"info": cp["info"], "calls": cp["calls"], "mixer_paths": cp["mixer_paths"],
              "expected_mixers": cp["expected_mixers"], "loss_cp": float(cp["loss"]), "loss_ref": float(ref["loss"]),
              "loss": _measure(cp["loss"], ref["loss"], dtype_name, "loss", f"{tag}: loss"),
              "logits": _measure(cp["logits"], ref["logits"], dtype_name, "logits",
                                 f"{tag}: logits at this rank's positions")}
    if rank == 0 and (dtype_name, "grads") in COMPARED:
        assert set(cp["grads"]) == set(ref["grads"]), sorted(set(cp["grads"]) ^ set(ref["grads"]))
        largest = max(float(g.abs().max()) for g in ref["grads"].values())
        per_param = {n: _measure(cp["grads"][n], g, dtype_name, "grads", f"{tag}: gradient of {n}", largest=largest)
                     for n, g in ref["grads"].items()}
        worst = max(per_param, key=lambda n: per_param[n]["ratio"])
        result["grads"] = {"ratio": per_param[worst]["ratio"], "worst": worst, "parameters": len(per_param),
                           "failures": [m["failure"] for m in per_param.values() if m["failure"]]}
    print(f"[hybrids {device.type}] {tag}: loss CP {result['loss_cp']:.6f} vs non-CP {result['loss_ref']:.6f}, "
          f"error/bound {result['loss']['ratio']:.3g}; logits {result['logits']['ratio']:.3g}"
          + (f"; gradients: worst {result['grads']['ratio']:.3g} ({result['grads']['worst']}) of "
             f"{result['grads']['parameters']}" if "grads" in result else "")
          + f"; {cp['info']['attention']}", flush=True)
    del cp, ref
    return result


def _world(rank, world, device_type, size, tokens, families, timeout):
    # a rank still running 20 s before the world's limit prints every thread's stack (to see where it spends it)
    faulthandler.dump_traceback_later(max(timeout - 20, 1), exit=False)
    # fp32 must be fp32 on both sides: no TF32 in matmuls or in cuDNN's convolutions (the mixers' causal conv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    results = {}
    for family in families:
        for dtype_name in DTYPES:
            results[(family, dtype_name)] = _compare(rank, family, dtype_name, device, size, tokens, world)
            ts.free_memory(device)
    faulthandler.cancel_dump_traceback_later()
    return results


def _unavailable(target: str):
    device = TARGETS[target][0]
    if device == "cuda" and torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}"
    return None


@pytest.fixture(scope="module")
def worlds():
    """``worlds(target)``: the target's world, started by the first test that needs it: {"skipped": {family:
    reason}, "ranks": [rank 0's results, rank 1's]}."""
    started = {}

    def get(target: str):
        if target not in started:
            device, backend, size, tokens, timeout = TARGETS[target]
            skipped = {family: family_skip_reason(family) for family in FAMILIES}
            families = tuple(f for f in FAMILIES if skipped[f] is None)
            ranks = (run_world(WORLD, _world, device, size, tokens, families, timeout, backend=backend,
                               timeout=timeout)
                     if families else None)
            started[target] = {"skipped": skipped, "ranks": ranks}
        return started[target]

    return get


def _results(worlds, target, family):
    reason = _unavailable(target)
    if reason:
        pytest.skip(reason)
    world = worlds(target)
    if world["skipped"][family]:
        pytest.skip(world["skipped"][family])
    return world["ranks"]


@pytest.mark.parametrize("dtype,quantity", COMPARED, ids=[f"{d}-{q}" for d, q in COMPARED])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target", tuple(TARGETS))
def test_cp_equals_non_cp(worlds, target, family, dtype, quantity):
    ranks = _results(worlds, target, family)
    measured = [r[(family, dtype)][quantity] for r in ranks if quantity in r[(family, dtype)]]
    assert measured, f"no rank measured {quantity}"
    failures = [m["failure"] for m in measured if m.get("failure")]
    failures += [f for m in measured for f in m.get("failures", ())]
    assert not failures, "\n".join(failures[:20])
    assert all(m["ratio"] <= 1.0 for m in measured), measured   # NaN: error_of gives inf


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("target", tuple(TARGETS))
def test_every_mixer_ran_its_cp_form(worlds, target, family):
    for rank, result in enumerate(_results(worlds, target, family)):
        for dtype in DTYPES:
            got = result[(family, dtype)]
            paths = got["mixer_paths"]
            assert paths and paths == got["expected_mixers"], (rank, dtype, paths)
            layers = len(got["expected_mixers"])
            for role in KERNEL_ROLES[family]:   # each mixer layer: the forward and the checkpoint's recomputation
                assert got["calls"].get((role, "ring")) == 2 * layers, (rank, dtype, role, got["calls"])
            ran = {k["role"] for k in got["info"]["mixer_kernels"] if k["cp_calls"]}
            assert ran == set(KERNEL_ROLES[family]), (rank, dtype, got["info"]["mixer_kernels"])
