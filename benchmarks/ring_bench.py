"""Ring attention benchmark: every variant x backend against single-GPU attention and PyTorch's native CP.

Variants: the ring layouts (ring, zigzag, stripe; ring_varlen, zigzag_varlen, llama3), Ulysses (ulysses,
ulysses_varlen: the head split by all-to-all) and USP (usp: Ulysses groups of consecutive ranks x the zigzag ring
across them, on the squarest grid of the ranks with both sides >= 2 -- 4 ranks: 2 x 2; recorded as skipped where
there is none).

Run (2 GPUs; see benchmarks/README.md for what each number means):

    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --out benchmarks/results/
    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --tokens 8192 --variants zigzag --backends torch_cudnn

On CPU (gloo; what the test suite runs, at toy sizes):

    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --device cpu --tokens 256 --configs tiny:4:2:64

Every (variant, backend, causal, config) first passes a correctness gate against plain float64 attention
on the unsharded inputs (``_check``); only then is it timed. One JSON file (raw results + derived summary,
stamped with device, versions and the commit that ran: ``benchmarks/_stamp.py``) and a markdown table are written
under ``--out``; a plot too when matplotlib is importable (else run ``python benchmarks/report.py FILE.json``).
Every row that ring_kernels computed names the block backends that ran (``block_backends``) and why
(``block_backend_choices``, from ``ring_kernels.backends.recording()``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import sys
import time
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
# Sibling modules, and the checkout's ring_kernels even where the project is not pip-installed (GPU machine).
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

from _cases import (BATCH_VARIANTS, CAUSAL_ONLY, CONFIGS, GRID_VARIANTS, MODES, VARLEN_VARIANTS,  # noqa: E402
                    AttnConfig, attention_flops, global_document_mix, local_document_mix)
from _check import max_over_ranks, passes, reference_attention, relative_errors  # noqa: E402
from _nocomm import no_communication, nocomm_unavailable_reason, nothing_to_exchange  # noqa: E402
from _runners import (Inputs, input_bytes, make_backend_step, make_inputs,  # noqa: E402
                      make_ring_step, make_varlen_single_step, ring_outputs_and_grads, set_usp_grid, shard_inputs,
                      shard_tensors)
from _stamp import backend_choices, stamp  # noqa: E402
from _timing import peak_memory_bytes, time_callable  # noqa: E402
import native_cp  # noqa: E402
from ring_kernels.layout_costs import squarest_usp_grid  # noqa: E402
import report  # noqa: E402
from _summary import summarize  # noqa: E402

SCHEMA = "hfpatch-ring-bench/1"
# A hung collective fails after this instead of eating a 10-minute device call (no collective here takes
# more than seconds; the longest wait is rank 0 computing the float64 reference or writing the plot).
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=2)
# Exceptions by which the library (or torch) declines a combination: recorded as "refused", not "failed".
_REFUSALS = (ValueError, TypeError, NotImplementedError, LookupError)
# Result kinds computed by ring_kernels (their rows name the block backends that ran); the others are torch's SDPA.
_RING_KERNELS_KINDS = ("single", "ring", "ring_nocomm")
# Baselines that run on one GPU: their useful work is done by that GPU alone (TFLOP/s per GPU).
_SINGLE_KINDS = ("single", "sdpa_single")


# ------------------------------------------------------------------------------------------- arguments


def _csv(text: str) -> List[str]:
    return [t for t in text.split(",") if t]


def _parse_config(spec: str) -> AttnConfig:
    """A name from CONFIGS, or ``name:nheads:nheads_k:head_dim`` for a custom shape."""
    if spec in CONFIGS:
        return CONFIGS[spec]
    parts = spec.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        raise argparse.ArgumentTypeError(
            f"--configs: {spec!r} is neither a known config {sorted(CONFIGS)} nor name:nheads:nheads_k:head_dim")
    name, h, hk, d = parts[0], int(parts[1]), int(parts[2]), int(parts[3])
    if hk == 0 or h % hk:
        raise argparse.ArgumentTypeError(f"--configs: {spec!r}: nheads={h} must be a multiple of nheads_k={hk}")
    return AttnConfig(name, h, hk, d)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--tokens", default="8192,32768", help="tokens per GPU, comma-separated")
    p.add_argument("--configs", default="llama3-8b,mha", help=f"{sorted(CONFIGS)} or name:H:Hk:D, comma-separated")
    p.add_argument("--layouts", default="batch,varlen")
    p.add_argument("--variants", default=",".join(BATCH_VARIANTS + VARLEN_VARIANTS))
    p.add_argument("--backends", default="available",
                   help="ring_kernels backend names, or 'available' (on CUDA without 'reference': dense scores)")
    p.add_argument("--causal", default="causal,noncausal")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--native", default="flash,cudnn,efficient", help="SDPA backends for native CP ('' = none)")
    p.add_argument("--native-rotate", default="allgather", help="allgather and/or alltoall, comma-separated")
    p.add_argument("--no-nocomm", action="store_true", help="skip the runs without communication")
    p.add_argument("--skip-rank-check", action="store_true",
                   help="time with the option skip_rank_check (no per-call cross-rank shape check: one all_gather "
                        "and a host sync less per call); the correctness gate always runs with the check")
    p.add_argument("--warmup", type=int, default=None, help="default: 3 up to 8k tokens, 2 to 16k, 1 above")
    p.add_argument("--iters", type=int, default=None, help="default: 10 up to 8k tokens, 5 to 16k, 3 above, raised "
                   "to cover --min-timed-ms")
    p.add_argument("--min-timed-ms", type=float, default=300.0,
                   help="without --iters, time each case over at least this many ms of calls (at most 100 calls): "
                        "a packed row costs a tenth of a batch row of the same tokens, and 3 calls of ~20 ms vary "
                        "by more than the layouts differ (default 300; 0: the token-based counts alone)")
    p.add_argument("--check-tokens", type=int, default=1024, help="tokens per GPU of the correctness gate")
    p.add_argument("--max-minutes", type=float, default=None, help="start no new case group after this")
    p.add_argument("--out", default=os.path.join(_HERE, "results"))
    p.add_argument("--tag", default=None, help="file name stem (default: ring_bench_<device>_<date>)")
    p.add_argument("--no-plot", action="store_true", help="write no .png even where matplotlib is importable")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in _csv(args.tokens)]
    args.configs = [_parse_config(c) for c in _csv(args.configs)]
    for name in ("layouts", "variants", "causal", "modes", "native", "native_rotate"):
        setattr(args, name, _csv(getattr(args, name)))
    _validate_choices(args)
    return args


def _validate_choices(args) -> None:
    allowed = {"layouts": ("batch", "varlen"), "variants": BATCH_VARIANTS + VARLEN_VARIANTS,
               "causal": ("causal", "noncausal"), "modes": MODES, "native": native_cp.SDPA_BACKENDS,
               "native_rotate": ("allgather", "alltoall")}
    for name, ok in allowed.items():
        bad = [x for x in getattr(args, name) if x not in ok]
        if bad:
            raise SystemExit(f"--{name.replace('_', '-')}: {bad} not in {list(ok)}")


def _iters_for(tokens: int, args) -> tuple:
    """(warmup, timed calls, min timed ms) of a case of ``tokens`` per GPU: explicit --iters are taken as given."""
    warmup, iters = (3, 10) if tokens <= 8192 else (2, 5) if tokens <= 16384 else (1, 3)
    if args.iters is not None:
        return (args.warmup if args.warmup is not None else warmup, args.iters, 0.0)
    return (args.warmup if args.warmup is not None else warmup, iters, args.min_timed_ms)


# ------------------------------------------------------------------------------------------------ run


class Bench:
    """State of one run on this rank: process groups, device, results (rank 0 writes them)."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" \
            else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # torchrun: we create the group. A caller that already has one (the CPU test's gloo world) keeps it.
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            if self.device.type == "cuda":   # device_id: bind the communicator to our GPU from the start
                dist.init_process_group("nccl", timeout=_COLLECTIVE_TIMEOUT, device_id=self.device)
            else:
                dist.init_process_group("gloo", timeout=_COLLECTIVE_TIMEOUT)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # A group of one per rank: the library's own single-GPU path for the varlen baseline.
        self.solo_group, _ = dist.new_subgroups(group_size=1)
        self.usp_grid, self.usp_absent = self._usp_grid() if GRID_VARIANTS & set(args.variants) else (None, None)
        self.mesh = None
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.backends = self._backends()
        unit = 2 * self.world
        bad = [t for t in args.tokens if t % unit]
        if bad:
            raise SystemExit(f"--tokens: {bad} per GPU must be multiples of 2 x {self.world} ranks = {unit} "
                             f"(the zigzag layouts cut the sequence, and each varlen document, into 2N chunks)")
        if args.check_tokens % unit:
            raise SystemExit(f"--check-tokens {args.check_tokens} must be a multiple of {unit}")
        self.results: List[dict] = []
        self.aborted: Optional[str] = None
        self.started = time.time()

    def _backends(self) -> List[str]:
        from ring_kernels.backends import available_backends

        available = available_backends(self.device)
        self.backends_left_out = {}
        if self.args.backends == "available":
            if self.device.type == "cuda" and "reference" in available:
                self.backends_left_out["reference"] = (
                    "plain-math backend: dense fp32 scores (~8 GB per 8k block, OOM at 32k), minutes per run; "
                    "name it in --backends to include it")
            return [b for b in available if b not in self.backends_left_out]
        wanted = _csv(self.args.backends)
        missing = [b for b in wanted if b not in available]
        if missing:
            raise SystemExit(f"--backends: {missing} not available on {self.device.type}; available: {available}")
        return wanted

    def _usp_grid(self):
        """((U, R), None) after making usp's groups -- Ulysses groups of U consecutive ranks (one node's
        all-to-all), rings of R ranks across them -- or (None, why not)."""
        split = squarest_usp_grid(self.world)
        if split is None:
            return None, f"usp needs a grid of at least 2 x 2 ranks; {self.world} ranks make none"
        u, r = split
        ulysses, _ = dist.new_subgroups_by_enumeration([list(range(j * u, (j + 1) * u)) for j in range(r)])
        ring, _ = dist.new_subgroups_by_enumeration([list(range(i, self.world, u)) for i in range(u)])
        set_usp_grid(ulysses, ring)
        return (u, r), None

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{time.time() - self.started:7.1f}s] {msg}", flush=True)

    def agree(self, ok: bool) -> bool:
        """True only if ``ok`` on every rank (so that all ranks take the same branch)."""
        t = torch.tensor([0.0 if ok else 1.0], device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() == 0.0

    def record(self, **fields) -> dict:
        fields.setdefault("world_size", self.world)
        self.results.append(fields)
        return fields

    def free(self, collect: bool = False) -> None:
        """Give cached CUDA blocks back between cases (less fragmentation when sizes change).

        ``collect`` also runs the cyclic garbage collector: slow with torch loaded (~0.3-1 s), so only between
        case groups. Peak memory does not depend on it: it is counted above what is allocated just before.
        """
        if collect:
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def mesh_for_native(self):
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, (self.world,))
        return self.mesh


def _attempt(bench: Bench, fn):
    """Run ``fn()`` on every rank; return (value, None) or (None, (status, reason)) agreed by all ranks."""
    value, err = None, None
    try:
        value = fn()
    except _REFUSALS as exc:
        err = ("refused", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # e.g. CUDA out of memory: recorded, the run goes on
        err = ("failed", f"{type(exc).__name__}: {exc}")
    if bench.device.type == "cuda" and err is not None and "out of memory" in err[1]:
        bench.free()
    if not bench.agree(err is None):
        return None, err or ("failed", "another rank failed this case")
    return value, None


@contextlib.contextmanager
def _rank_check_skipped(skip: bool) -> Iterator[None]:
    """Within: ring_kernels' per-call cross-rank shape check off when ``skip`` (the option skip_rank_check)."""
    if not skip:
        yield
        return
    from ring_kernels import use_options
    with use_options(skip_rank_check=True):
        yield


def _timing_fields(bench: Bench, step, mode: str, tokens: int, flops: float, mem_baseline: Optional[int],
                   gpus: int) -> dict:
    with _rank_check_skipped(bench.args.skip_rank_check):
        return _timed(bench, step, mode, tokens, flops, mem_baseline, gpus)


def _timed(bench: Bench, step, mode: str, tokens: int, flops: float, mem_baseline: Optional[int], gpus: int) -> dict:
    """Time ``step(mode)``; ``flops``: the useful work of the call, done by ``gpus`` GPUs (1 for a single-GPU
    baseline, the group for a ring or native CP)."""
    warmup, iters, min_timed_ms = _iters_for(tokens, bench.args)
    timing = time_callable(lambda: step(mode), device=bench.device, warmup=warmup, iters=iters,
                           min_total_ms=min_timed_ms)
    fields = {"time_ms": timing.as_dict(), "tflops_per_gpu": flops / gpus / (timing.median_ms * 1e-3) / 1e12}
    if mem_baseline is not None:
        fields["peak_mem_bytes"] = peak_memory_bytes(lambda: step(mode), device=bench.device,
                                                     baseline_bytes=mem_baseline)
    return fields


def _mem_baseline(bench: Bench, local: Inputs) -> Optional[int]:
    if bench.device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(bench.device) - input_bytes(local)


def run_group(bench: Bench, cfg: AttnConfig, layout: str, causal: bool, tokens: int) -> None:
    """All measurements of one (config, layout, causality, tokens per GPU) point."""
    args, n = bench.args, bench.world
    varlen = layout == "varlen"
    variants = [v for v in (VARLEN_VARIANTS if varlen else BATCH_VARIANTS)
                if v in args.variants and (causal or v not in CAUSAL_ONLY)]
    common = dict(config=cfg.name, layout=layout, causal=causal, tokens_per_rank=tokens, dtype=args.dtype)
    tag = f"{cfg.name} {layout} {'causal' if causal else 'noncausal'} {tokens}/GPU"
    if not variants and (varlen or not args.native):
        bench.log(f"{tag}: no variant selected for this point, skipped")
        return

    local_mix = local_document_mix(tokens, n) if varlen else None
    doc_global = global_document_mix(local_mix, n) if varlen else None
    doc_lengths_global = doc_global if varlen else [tokens * n]
    doc_lengths_local = local_mix if varlen else [tokens]
    check = _CheckData(bench, cfg, varlen, causal, min(args.check_tokens, tokens))
    if varlen:
        common["documents_global"] = len(doc_global)

    # Single-GPU baselines on this GPU's share (same backends), then every variant x backend on the ring.
    single_in = make_inputs(cfg, tokens, dtype=bench.dtype, device=bench.device, seed=1, doc_lengths=local_mix)
    for backend in bench.backends if variants else ():
        make = (lambda b=backend, x=single_in: make_varlen_single_step(x, causal=causal, backend=b,
                                                                        solo_group=bench.solo_group)) if varlen \
            else (lambda b=backend, x=single_in: make_backend_step(b, x, causal=causal))
        _measure(bench, make, single_in, dict(common, kind="single", variant="single", backend=backend),
                 doc_lengths_local, tag)
    if not varlen:
        _sdpa_and_native(bench, cfg, causal, tokens, common, single_in, check, tag)
    single_in = None   # free it before the N-times larger global inputs exist
    bench.free()

    global_in = make_inputs(cfg, tokens * n, dtype=bench.dtype, device=bench.device, seed=2, doc_lengths=doc_global)
    for variant in variants:
        if variant in GRID_VARIANTS and bench.usp_grid is None:
            for backend in bench.backends:
                for mode in args.modes:
                    bench.record(**common, kind="ring", variant=variant, backend=backend, mode=mode,
                                 status="skipped", reason=bench.usp_absent)
            continue
        local, err = _attempt(bench, lambda x=global_in, v=variant: shard_inputs(x, v))
        for backend in bench.backends:
            base = dict(common, kind="ring", variant=variant, backend=backend)
            if variant in GRID_VARIANTS:
                base["grid"] = "{} ulysses x {} ring".format(*bench.usp_grid)
            if err is not None:
                bench.record(**base, status=err[0], reason=err[1])
                continue
            verdict = check.ring(variant, backend)
            if verdict["status"] != "ok":
                bench.record(**base, **verdict)
                bench.log(f"{tag} {variant}/{backend}: {verdict['status']} ({verdict['reason'][:160]})")
                continue
            kv = local.k.numel() * local.k.element_size() + local.v.numel() * local.v.element_size()
            base.update(check=verdict["check"], kv_double_buffer_bytes=2 * kv)
            make = lambda v=variant, b=backend, x=local: make_ring_step(  # noqa: E731
                v, x, causal=causal, backend=b, global_doc_lengths=doc_global)
            _measure(bench, make, local, base, doc_lengths_global, tag)
            if not args.no_nocomm:
                _measure_nocomm(bench, make, local, base, doc_lengths_global, tag)
        local = None
        bench.free()
    global_in = None
    bench.free(collect=bench.device.type == "cuda")


def _ran(*recorders) -> dict:
    """A row's block backends: the distinct backends ring_kernels chose while the step was built and timed
    (``block_backends``) and those choices in full (backend, requested, reason, shape class, calls)."""
    rows: Dict[tuple, dict] = {}
    for recorder in recorders:
        for c in backend_choices(recorder):
            key = (c["backend"], c["requested"], c["reason"], c["shape_class"])
            if key in rows:
                rows[key]["calls"] += c["calls"]
            else:
                rows[key] = dict(c)
    return {"block_backends": list(dict.fromkeys(c["backend"] for c in rows.values())),
            "block_backend_choices": list(rows.values())}


def _measure(bench: Bench, make, local: Inputs, base: dict, doc_lengths, tag: str) -> None:
    """Time ``make()``'s step in every mode and record it (or record why it could not run), with the block
    backends that ran (``_ran``)."""
    from ring_kernels.backends import recording

    with recording() as built:
        step, err = _attempt(bench, make)
    for mode in bench.args.modes:
        fields = dict(base, mode=mode)
        if err is None:
            flops = attention_flops(doc_lengths, nheads=local.q.shape[-2], head_dim=local.q.shape[-1],
                                    causal=base["causal"], mode=mode)
            with recording() as timed:
                gpus = 1 if base["kind"] in _SINGLE_KINDS else bench.world
                timing, err_t = _attempt(bench, lambda: _timing_fields(
                    bench, step, mode, base["tokens_per_rank"], flops, _mem_baseline(bench, local), gpus))
            if err_t is None:
                ran = _ran(built, timed) if base["kind"] in _RING_KERNELS_KINDS else {}
                bench.record(**fields, status="ok", **timing, **ran)
                bench.log(f"{tag} {base['kind']} {base['variant']}/{base['backend']} {mode}: "
                          f"{timing['time_ms']['median_ms']:.3f} ms, {timing['tflops_per_gpu']:.3g} TFLOP/s/GPU")
                continue
            bench.record(**fields, status=err_t[0], reason=err_t[1])
        else:
            bench.record(**fields, status=err[0], reason=err[1])
        bench.log(f"{tag} {base['kind']} {base['variant']}/{base['backend']} {mode}: {(err or err_t)[0]}")


def _measure_nocomm(bench: Bench, make, local: Inputs, base: dict, doc_lengths, tag: str) -> None:
    reason = nocomm_unavailable_reason(base["variant"])
    nbase = dict(base, kind="ring_nocomm")
    nbase.pop("check", None)
    if reason is not None:
        for mode in bench.args.modes:
            bench.record(**nbase, mode=mode, status="skipped", reason=reason)
        return
    with no_communication(base["variant"]) as counter:
        before = len(bench.results)
        _measure(bench, make, local, nbase, doc_lengths, tag)
    if counter.calls == 0 and nothing_to_exchange(base["variant"], doc_lengths, bench.world):
        for r in bench.results[before:]:
            r.update(note="no document crosses a rank boundary: the run had nothing to communicate")
    elif counter.calls == 0:   # the variant bypassed the stand-ins: it communicated, so the time is not no-comm
        for r in bench.results[before:]:
            r.update(status="skipped", time_ms=None,
                     reason="the variant never called the patched communication (it bypassed the stand-in)")


class _CheckData:
    """The correctness gate of one (config, layout, causality): global inputs at check size and the reference.

    Built lazily (the float64 reference is the expensive part) and shared by every variant x backend.
    """

    def __init__(self, bench: Bench, cfg: AttnConfig, varlen: bool, causal: bool, tokens: int):
        self.bench, self.cfg, self.varlen, self.causal, self.tokens = bench, cfg, varlen, causal, tokens
        self._inputs: Optional[Inputs] = None
        self._ref: Optional[Dict[str, torch.Tensor]] = None

    def inputs(self) -> Inputs:
        if self._inputs is None:
            n = self.bench.world
            docs = global_document_mix(local_document_mix(self.tokens, n), n) if self.varlen else None
            self._inputs = make_inputs(self.cfg, self.tokens * n, dtype=self.bench.dtype, device=self.bench.device,
                                       seed=3, doc_lengths=docs)
        return self._inputs

    def reference(self) -> Dict[str, torch.Tensor]:
        if self._ref is None:
            x = self.inputs()
            add = (lambda t: t.unsqueeze(0)) if self.varlen else (lambda t: t)
            ref = reference_attention(add(x.q), add(x.k), add(x.v), add(x.dout), causal=self.causal,
                                      scale=self.cfg.head_dim ** -0.5, doc_lengths=x.doc_lengths)
            self._ref = {k: (t.squeeze(0) if self.varlen else t) for k, t in ref.items()}
        return self._ref

    def _sharded_reference(self, variant: str) -> Dict[str, torch.Tensor]:
        return shard_tensors(self.reference(), variant, self.inputs().doc_lengths)

    def ring(self, variant: str, backend: str) -> dict:
        """``{"status": "ok", "check": errors}`` or ``{"status": ..., "reason": ...}``, agreed by all ranks."""
        def run():
            x = self.inputs()
            local = shard_inputs(x, variant)
            got = ring_outputs_and_grads(variant, local, causal=self.causal, backend=backend,
                                         global_doc_lengths=x.doc_lengths)
            return relative_errors(got, self._sharded_reference(variant))

        errors, err = _attempt(self.bench, run)
        if err is not None:
            return {"status": err[0], "reason": err[1]}
        return self._verdict(errors)

    def _verdict(self, errors) -> dict:
        errors = max_over_ranks(errors, self.bench.device)
        check = {"tokens_per_rank": self.tokens, "errors": errors, "passed": passes(errors, self.bench.dtype)}
        if not check["passed"]:
            return {"status": "wrong", "reason": f"correctness gate failed: {errors}", "check": check}
        return {"status": "ok", "check": check}

    def native(self, sdpa_backend: str, rotate: str) -> dict:
        x = self.inputs()

        def run():
            with native_cp.native_cp_session(self.cfg, x.q, x.k, x.v, x.dout, causal=self.causal,
                                             sdpa_backend=sdpa_backend, rotate=rotate,
                                             mesh=self.bench.mesh_for_native()) as session:
                got = session["outputs_and_grads"]()
            # Every rank holds the whole unsharded result: compare it all.
            return relative_errors(got, self.reference())

        errors, err = _attempt(self.bench, run)
        if err is not None:
            return {"status": err[0], "reason": err[1]}
        return self._verdict(errors)


def _sdpa_and_native(bench: Bench, cfg, causal: bool, tokens: int, common: dict, single_in: Inputs,
                     check: _CheckData, tag: str) -> None:
    """SDPA on one GPU (the local shard) and PyTorch's native context_parallel, per SDPA backend."""
    reason = native_cp.native_cp_unavailable_reason(bench.device)
    for sdpa in bench.args.native:
        sbase = dict(common, kind="sdpa_single", variant="sdpa", backend=sdpa)
        nbase = dict(common, kind="native_cp", variant="native_cp", backend=sdpa)
        if reason is not None:
            for mode in bench.args.modes:
                bench.record(**sbase, mode=mode, status="skipped",
                             reason=f"the SDPA baselines are native CP's denominators, measured with it: {reason}")
                bench.record(**nbase, mode=mode, status="skipped", reason=reason)
            continue
        _measure(bench, lambda s=sdpa: native_cp.make_sdpa_single_step(
            cfg, single_in.q, single_in.k, single_in.v, single_in.dout, causal=causal, sdpa_backend=s),
            single_in, sbase, [tokens], tag)
        for rotate in bench.args.native_rotate:
            _measure_native(bench, cfg, causal, tokens, dict(nbase, rotate=rotate), check, sdpa, rotate, tag)


def _measure_native(bench: Bench, cfg, causal, tokens, base, check: _CheckData, sdpa, rotate, tag) -> None:
    verdict = check.native(sdpa, rotate)
    if verdict["status"] != "ok":
        for mode in bench.args.modes:
            bench.record(**base, mode=mode, **verdict)
        bench.log(f"{tag} native_cp/{sdpa}/{rotate}: {verdict['status']} ({verdict['reason'][:160]})")
        return
    base["check"] = verdict["check"]
    with contextlib.ExitStack() as stack:
        def enter():
            x = make_inputs(cfg, tokens * bench.world, dtype=bench.dtype, device=bench.device, seed=2)
            # The session keeps its own sharded (1, H, S/N, D) copies; x dies with this function.
            return stack.enter_context(native_cp.native_cp_session(
                cfg, x.q, x.k, x.v, x.dout, causal=causal, sdpa_backend=sdpa, rotate=rotate,
                mesh=bench.mesh_for_native()))

        session, err = _attempt(bench, enter)
        if err is not None:
            for mode in bench.args.modes:
                bench.record(**base, mode=mode, status=err[0], reason=err[1])
            bench.log(f"{tag} native_cp/{sdpa}/{rotate}: {err[0]} ({err[1][:160]})")
        else:
            bench.free()
            baseline = None if bench.device.type != "cuda" else \
                torch.cuda.memory_allocated(bench.device) - session["local_bytes"]
            _measure_with(bench, session["step"], base, [tokens * bench.world], tag, cfg, baseline)
    bench.free()


def _measure_with(bench: Bench, step, base: dict, doc_lengths, tag: str, cfg: AttnConfig, baseline) -> None:
    for mode in bench.args.modes:
        flops = attention_flops(doc_lengths, nheads=cfg.nheads, head_dim=cfg.head_dim, causal=base["causal"],
                                mode=mode)
        timing, err = _attempt(bench, lambda: _timing_fields(bench, step, mode, base["tokens_per_rank"], flops,
                                                             baseline, bench.world))
        if err is None:
            bench.record(**base, mode=mode, status="ok", **timing)
            bench.log(f"{tag} native_cp {base['backend']}/{base['rotate']} {mode}: "
                      f"{timing['time_ms']['median_ms']:.3f} ms")
        else:
            bench.record(**base, mode=mode, status=err[0], reason=err[1])
            bench.log(f"{tag} native_cp {base['backend']}/{base['rotate']} {mode}: {err[0]} ({err[1][:160]})")


# ---------------------------------------------------------------------------------------------- output


def _document(bench: Bench) -> dict:
    args = bench.args
    return {
        "schema": SCHEMA,
        "stamp": stamp(bench.device, bench.world),
        "settings": {
            "tokens_per_rank": args.tokens, "configs": [dataclasses.asdict(c) for c in args.configs],
            "layouts": args.layouts, "variants": args.variants, "backends": bench.backends,
            "backends_left_out": bench.backends_left_out,
            "causal": args.causal, "modes": args.modes, "native": args.native, "native_rotate": args.native_rotate,
            "usp_grid": bench.usp_grid, "nocomm": not args.no_nocomm, "skip_rank_check": args.skip_rank_check, "dtype": args.dtype, "check_tokens_per_rank": args.check_tokens,
            "iters": {str(t): dict(zip(("warmup", "iters", "min_timed_ms"), _iters_for(t, args)))
                      for t in args.tokens},
            "argv": sys.argv[1:],
        },
        "results": bench.results,
        "summary": summarize(bench.results, bench.world),
    }


def _write(bench: Bench, stem: str, complete: bool) -> Optional[str]:
    """Rank 0 writes ``<stem>.json`` and ``<stem>.md``; ``complete`` is False for partial or stopped runs."""
    if bench.rank != 0:
        return None
    import json

    os.makedirs(bench.args.out, exist_ok=True)
    doc = _document(bench)
    doc["complete"] = complete
    if bench.aborted:
        doc["aborted"] = bench.aborted
    path = os.path.join(bench.args.out, stem + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)   # a run killed mid-write leaves the previous complete file
    with open(os.path.join(bench.args.out, stem + ".md"), "w") as f:
        f.write(report.markdown(doc))
    return path


def _points(args):
    for tokens in args.tokens:
        for cfg in args.configs:
            for layout in args.layouts:
                for causal in (c == "causal" for c in args.causal):
                    yield cfg, layout, causal, tokens


def main(argv=None) -> int:
    args = _parse_args(argv)
    bench = Bench(args)
    stem = args.tag or f"ring_bench_{_slug(stamp(bench.device, bench.world)['device_name'])}_" \
                       f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    bench.log(f"{bench.world} ranks on {bench.device.type}, backends {bench.backends}, dtype {args.dtype}")
    complete = False
    try:
        for point in _points(args):
            if args.max_minutes is not None and time.time() - bench.started > 60 * args.max_minutes:
                bench.log(f"--max-minutes {args.max_minutes} reached: stopping before {point[:3]}")
                break
            run_group(bench, *point)
            _write(bench, stem, complete=False)
        else:
            complete = True
    except BaseException as exc:   # keep what was measured, say why the run ended, then fail loudly
        bench.aborted = f"{type(exc).__name__}: {exc}"
        _write(bench, stem, complete=False)
        raise
    path = _write(bench, stem, complete=complete)
    if path:
        print(report.compact(_document(bench)), flush=True)
        bench.log(f"wrote {path} and {path[:-5]}.md")
        if not args.no_plot:
            bench.log(report.try_plot(path))
    dist.barrier()
    if bench.owns_group:
        dist.destroy_process_group()
    return 0


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


if __name__ == "__main__":
    sys.exit(main())
