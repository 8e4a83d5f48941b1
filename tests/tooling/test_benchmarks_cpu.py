"""The GPU benchmark harness, run end to end on CPU: 2 gloo processes, toy sizes.

One world runs ``benchmarks/ring_bench.py``'s ``main`` (the torchrun entry) on every rank, plus a check that
the timer reports the slowest rank; the parent then checks the JSON it wrote: schema, stamp, that every
variant x backend was measured (or says why not) and that every measured ring run passed the correctness
gate against plain attention. The derived numbers (efficiency, overlap, memory ratio) are checked against
hand-computed values on a small synthetic result list.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time

import pytest

from _dist import run_world
from _paths import BENCHMARKS

_BENCH = str(BENCHMARKS)
sys.path.insert(0, _BENCH)

from _nocomm import nothing_to_exchange  # noqa: E402
from _summary import summarize  # noqa: E402
import _stamp  # noqa: E402
import report  # noqa: E402

RING_VARIANTS = {"batch": {"ring", "zigzag", "stripe", "ulysses"},
                 "varlen": {"ring_varlen", "zigzag_varlen", "llama3", "ulysses_varlen"}}
CAUSAL_ONLY = {"zigzag", "stripe", "zigzag_varlen", "usp"}
BACKENDS = ("torch_cpu", "reference")
ARGV = ["--device", "cpu", "--tokens", "64", "--configs", "tiny:4:2:32", "--iters", "1", "--warmup", "0",
        "--check-tokens", "64", "--backends", ",".join(BACKENDS), "--tag", "cpu_test"]

FAULTY_ARGV = ARGV[:-2] + ["--tag", "cpu_faulty", "--layouts", "batch", "--variants", "ring", "--causal", "causal",
                           "--native", "", "--no-nocomm", "--no-plot"]


def _world(rank, world_size, out_dir):
    import torch

    sys.path.insert(0, _BENCH)
    from _timing import time_callable

    # The step time is the slowest rank's: rank 1 sleeps 30 ms per call, rank 0 not at all.
    t = time_callable(lambda: time.sleep(0.03 if rank == 1 else 0.0), device=torch.device("cpu"), warmup=0,
                      iters=2)
    assert t.median_ms >= 30.0 and t.min_ms >= 30.0, t

    # min_total_ms raises the timed calls to cover it, the same count on every rank (the slowest rank's probe
    # decides: rank 1's >= 10 ms per call -> at most 60 calls for 600 ms, on rank 0 too; more than the minimum 2
    # unless a 10-ms sleep took over 200 ms), and never above max_iters.
    t = time_callable(lambda: time.sleep(0.01 if rank == 1 else 0.0), device=torch.device("cpu"), warmup=0,
                      iters=2, min_total_ms=600.0)
    assert 3 <= t.iters <= 60 and t.median_ms >= 10.0, t
    counts = [torch.zeros(1) for _ in range(world_size)]
    torch.distributed.all_gather(counts, torch.tensor([float(t.iters)]))
    assert len({c.item() for c in counts}) == 1, counts
    capped = time_callable(lambda: time.sleep(0.001), device=torch.device("cpu"), warmup=0, iters=2,
                           min_total_ms=1000.0, max_iters=5)
    assert capped.iters == 5, capped

    import ring_bench

    assert ring_bench.main(ARGV + ["--out", out_dir]) == 0

    # The gate itself: a backend that refuses is recorded as such, a wrong result is never timed.
    real = ring_bench.ring_outputs_and_grads

    def faulty(variant, local, *, backend, **kw):
        if backend == "reference":
            raise ValueError("backend='reference' refuses (injected by the test)")
        got = real(variant, local, backend=backend, **kw)
        got["dv"] = got["dv"] * 1.1          # 10% off: far outside bf16's 5e-2
        return got

    ring_bench.ring_outputs_and_grads = faulty
    try:
        assert ring_bench.main(FAULTY_ARGV + ["--out", out_dir]) == 0
    finally:
        ring_bench.ring_outputs_and_grads = real

    # Out of time before the first case group: an honest, empty, incomplete file.
    assert ring_bench.main(ARGV[:-2] + ["--tag", "cpu_timeout", "--max-minutes", "0", "--no-plot", "--out", out_dir]) == 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def bench_doc(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench"))
    run_world(2, _world, out, timeout=240)
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(out, "cpu_test.*")))
    # The plot is optional (matplotlib may be absent, as on the GPU machine); JSON and markdown never are.
    assert files == ["cpu_test.json", "cpu_test.md"] + (["cpu_test.png"] if _has_matplotlib() else [])
    with open(os.path.join(out, "cpu_test.json")) as f:
        doc = json.load(f)
    with open(os.path.join(out, "cpu_test.md")) as f:
        doc["_markdown"] = f.read()
    with open(os.path.join(out, "cpu_faulty.json")) as f:
        doc["_faulty"] = json.load(f)
    with open(os.path.join(out, "cpu_timeout.json")) as f:
        doc["_timeout"] = json.load(f)
    return doc


def test_stamp_and_settings(bench_doc):
    assert bench_doc["schema"] == "hfpatch-ring-bench/1" and bench_doc["complete"] is True
    st = bench_doc["stamp"]
    for key in ("device_name", "device_type", "gpu_count", "world_size", "torch", "triton", "transformers",
                "date", "git_commit", "based_on_commit", "source_hash", "source_files", "provenance",
                "block_backend_choices"):
        assert key in st, key
    assert st["device_type"] == "cpu" and st["world_size"] == 2
    # This checkout: its HEAD, checked against the tree's source hash, or "uncommitted-tree" saying why not.
    assert st["source_hash"].startswith("sha256:") and st["source_files"] > 50
    if st["git_commit"] == _stamp.UNCOMMITTED:
        assert "differs from commit" in st["provenance"] or "no git checkout" in st["provenance"]
    else:
        assert st["git_commit"] == st["based_on_commit"] and len(st["git_commit"]) == 40
    assert {c["backend"] for c in st["block_backend_choices"]} == set(BACKENDS)
    assert bench_doc["settings"]["backends"] == list(BACKENDS) and bench_doc["settings"]["backends_left_out"] == {}
    assert bench_doc["settings"]["configs"] == [{"name": "tiny", "nheads": 4, "nheads_k": 2, "head_dim": 32}]


def _measured(results):
    """Ring rows of the variants a world of 2 runs (usp and usp_varlen need a 2 x 2 grid)."""
    return [r for r in results if r["kind"] == "ring" and r["variant"] not in ("usp", "usp_varlen")]


def test_every_variant_and_backend_measured_after_passing_the_gate(bench_doc):
    ring = _measured(bench_doc["results"])
    seen = set()
    for r in ring:
        assert r["status"] == "ok", r
        # The block backend that ran, from ring_kernels' own record: the one named, by name.
        assert r["block_backends"] == [r["backend"]], r
        (choice,) = r["block_backend_choices"]
        assert choice["requested"] == r["backend"] and choice["calls"] >= 1 and not choice["fallback"]
        check = r["check"]
        assert check["passed"] is True and check["tokens_per_rank"] == 64
        for name in ("out", "dq", "dk", "dv"):
            err = check["errors"][name]
            assert err["finite"] and err["fro"] < (1e-2 if name == "out" else 5e-2), (r["variant"], name, err)
        assert r["time_ms"]["median_ms"] > 0 and r["time_ms"]["iters"] == 1 and r["time_ms"]["warmup"] == 0
        assert r["tflops_per_gpu"] > 0 and r["kv_double_buffer_bytes"] > 0
        seen.add((r["layout"], r["variant"], r["backend"], r["causal"], r["mode"]))
    expected = {(layout, v, b, c, m) for layout, vs in RING_VARIANTS.items() for v in vs for b in BACKENDS
                for c in (True, False) for m in ("fwd", "fwd_bwd") if c or v not in CAUSAL_ONLY}
    assert seen == expected


def test_usp_without_a_grid_says_so(bench_doc):
    """2 ranks make no 2 x 2 grid: every usp row is recorded as skipped with the reason, none timed."""
    usp = [r for r in bench_doc["results"] if r["variant"] == "usp"]
    assert {(r["backend"], r["mode"]) for r in usp} == {(b, m) for b in BACKENDS for m in ("fwd", "fwd_bwd")}
    assert all(r["status"] == "skipped" and "2 x 2" in r["reason"] and "time_ms" not in r for r in usp), usp
    packed = [r for r in bench_doc["results"] if r["variant"] == "usp_varlen"]
    assert {(r["backend"], r["mode"], r["causal"]) for r in packed} == {
        (b, m, c) for b in BACKENDS for m in ("fwd", "fwd_bwd") for c in (True, False)}
    assert all(r["status"] == "skipped" and "2 x 2" in r["reason"] and "time_ms" not in r for r in packed), packed
    assert bench_doc["settings"]["usp_grid"] is None


def test_single_baselines_and_nocomm_runs(bench_doc):
    res = bench_doc["results"]
    singles = {(r["layout"], r["backend"], r["causal"], r["mode"]) for r in res
               if r["kind"] == "single" and r["status"] == "ok"}
    assert all(r["block_backends"] == [r["backend"]] for r in res if r["kind"] in ("single", "ring_nocomm")
               and r["status"] == "ok")
    assert singles == {(lay, b, c, m) for lay in ("batch", "varlen") for b in BACKENDS for c in (True, False)
                       for m in ("fwd", "fwd_bwd")}
    nocomm = [r for r in res if r["kind"] == "ring_nocomm"]
    for r in nocomm:   # the stand-ins replaced the communication (else the harness marks the run skipped)
        assert r["status"] == "ok" and r["time_ms"]["median_ms"] > 0, r
    assert len(nocomm) == len(_measured(res))
    # No CUDA here: PyTorch's native CP is recorded as skipped with the reason, never silently absent.
    native = [r for r in res if r["kind"] == "native_cp"]
    assert native and all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in native)


def test_llama3_with_no_crossing_document_has_nothing_to_exchange():
    """A no-communication run that never called a stand-in is kept only where the variant had nothing to move:
    llama3 with every rank boundary between documents; any other variant or a crossing document is a bypass."""
    assert nothing_to_exchange("llama3", [20, 12, 32], 2)              # the boundary at 32 ends a document
    assert not nothing_to_exchange("llama3", [20, 20, 24], 2)          # [20, 40) crosses it
    assert nothing_to_exchange("llama3", [16, 8, 8, 16, 16], 4)        # 16, 32, 48 all end documents
    assert not nothing_to_exchange("ring_varlen", [20, 12, 32], 2)     # the ring passes K/V whatever the documents
    assert not nothing_to_exchange("llama3", None, 2) and not nothing_to_exchange("llama3", [64], 1)


def test_a_run_out_of_time_says_so(bench_doc):
    timeout = bench_doc["_timeout"]
    assert timeout["complete"] is False and timeout["results"] == [] and timeout["summary"] == []
    assert bench_doc["_faulty"]["complete"] is True and "aborted" not in bench_doc


def test_refused_and_wrong_are_recorded_and_never_timed(bench_doc):
    faulty = bench_doc["_faulty"]
    ring = {r["backend"]: r for r in faulty["results"] if r["kind"] == "ring"}
    assert set(ring) == set(BACKENDS)
    ref, cpu = ring["reference"], ring["torch_cpu"]
    assert ref["status"] == "refused" and "injected by the test" in ref["reason"] and "time_ms" not in ref
    assert cpu["status"] == "wrong" and cpu["check"]["passed"] is False and "time_ms" not in cpu
    assert cpu["check"]["errors"]["dv"]["fro"] == pytest.approx(0.1, rel=0.05)
    assert cpu["check"]["errors"]["dq"]["fro"] < 5e-2          # only dv was perturbed
    assert not [s for s in faulty["summary"] if s["kind"] == "ring"]
    assert "wrong" in report.markdown(faulty) and "refused" in report.markdown(faulty)


def test_summary_rows_and_markdown(bench_doc):
    rows = [s for s in bench_doc["summary"] if s["kind"] == "ring"]
    assert len(rows) == len(_measured(bench_doc["results"]))
    for s in rows:
        shares = 2 if s["layout"] == "batch" else 1          # test_packed_rows_ideal_is_one_local_mix_per_gpu
        assert s["efficiency"] == pytest.approx(shares * s["t_single_ms"] / s["t_ms"])
        assert s["efficiency_vs_best"] <= s["efficiency"] * (1 + 1e-12)
    md = bench_doc["_markdown"]
    assert "## Ring attention" in md and "## Not measured" in md and "zigzag_varlen" in md


def _result(kind, variant, backend, ms, **extra):
    r = dict(kind=kind, variant=variant, backend=backend, config="c", layout="batch", causal=True, mode="fwd_bwd",
             tokens_per_rank=8192, status="ok", time_ms={"median_ms": ms})
    r.update(extra)
    return r


def test_summarize_arithmetic():
    results = [
        _result("single", "single", "torch_cudnn", 3.0, peak_mem_bytes=1000),
        _result("single", "single", "torch_flash", 6.0, peak_mem_bytes=1000),
        _result("sdpa_single", "sdpa", "flash", 6.5),
        _result("ring", "zigzag", "torch_flash", 12.5, peak_mem_bytes=1500, kv_double_buffer_bytes=400),
        _result("ring_nocomm", "zigzag", "torch_flash", 12.0),
        _result("native_cp", "native_cp", "flash", 16.25, rotate="allgather"),
        _result("ring", "ring", "torch_cudnn", 1.0, status="refused", reason="no"),
    ]
    rows = {(r["kind"], r["backend"]): r for r in summarize(results, world_size=2)}
    assert set(rows) == {("ring", "torch_flash"), ("native_cp", "flash")}
    z = rows[("ring", "torch_flash")]
    assert z["t_ideal_ms"] == 12.0 and z["efficiency"] == pytest.approx(12.0 / 12.5)
    assert z["best_single"] == "single:torch_cudnn" and z["efficiency_vs_best"] == pytest.approx(6.0 / 12.5)
    assert z["t_ring_nocomm_ms"] == 12.0 and z["mem_ratio"] == pytest.approx(1500 / 1400)
    assert z["speedup_vs_native"] == pytest.approx(16.25 / 12.5)
    n = rows[("native_cp", "flash")]
    assert n["efficiency"] == pytest.approx(13.0 / 16.25) and n["rotate"] == "allgather"
    doc = {"stamp": {"world_size": 2, "device_name": "X", "date": "d", "torch": "t"},
           "settings": {"dtype": "bf16"}, "results": results, "summary": summarize(results, 2)}
    md = report.markdown(doc)
    assert "## Targets (issue 8)" in md and "96.0%" in md and "1.30x" in md and "refused" in md


def test_packed_rows_ideal_is_one_local_mix_per_gpu():
    """The global packed row is N copies of the local mix (N times its work over N GPUs): a wasteless ring takes
    T_single per GPU, not N x T_single as a batch row (N^2 times the local shard's work) does."""
    results = [_result("single", "single", "torch_cudnn", 150.0, layout="varlen", tokens_per_rank=131072),
               _result("ring", "llama3", "torch_cudnn", 200.0, layout="varlen", tokens_per_rank=131072),
               _result("single", "single", "torch_cudnn", 100.0),
               _result("ring", "zigzag", "torch_cudnn", 410.0)]
    rows = {r["layout"]: r for r in summarize(results, world_size=4)}
    assert rows["varlen"]["t_ideal_ms"] == 150.0 and rows["varlen"]["efficiency"] == pytest.approx(0.75)
    assert rows["varlen"]["efficiency_vs_best"] == pytest.approx(0.75)
    assert rows["batch"]["t_ideal_ms"] == 400.0 and rows["batch"]["efficiency"] == pytest.approx(400 / 410)


def test_resummarize_rewrites_the_summary_only(tmp_path):
    results = [_result("single", "single", "torch_cudnn", 150.0, layout="varlen"),
               _result("ring", "llama3", "torch_cudnn", 200.0, layout="varlen")]
    stale = [dict(summarize(results, 2)[0], efficiency=1.5)]
    path = tmp_path / "old.json"
    doc = {"stamp": {"world_size": 2, "device_name": "X", "date": "d", "torch": "t"}, "settings": {"dtype": "bf16"},
           "results": results, "summary": stale}
    path.write_text(json.dumps(doc))
    assert report.main([str(path), "--resummarize", "--no-plot"]) == 0
    again = json.loads(path.read_text())
    assert again["results"] == results and again["summary"][0]["efficiency"] == pytest.approx(0.75)
    assert "75.0%" in (tmp_path / "old.md").read_text()


def test_merge_and_plot(tmp_path):
    a = [_result("single", "single", "torch_flash", 6.0), _result("ring", "zigzag", "torch_flash", 12.5)]
    b = [_result("single", "single", "torch_flash", 100.0, tokens_per_rank=32768),
         _result("ring", "zigzag", "torch_flash", 250.0, tokens_per_rank=32768)]
    stamp = {"world_size": 2, "device_name": "X", "date": "d", "torch": "t"}
    docs = [{"stamp": dict(stamp), "settings": {"dtype": "bf16"}, "results": r, "summary": summarize(r, 2)}
            for r in (a, b)]
    merged = report.merge(docs)
    eff = {s["tokens_per_rank"]: s["efficiency"] for s in merged["summary"]}
    assert eff == {8192: pytest.approx(12.0 / 12.5), 32768: pytest.approx(200.0 / 250.0)}
    docs[1]["stamp"]["world_size"] = 4
    with pytest.raises(ValueError, match="world_size"):
        report.merge(docs)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(merged))
    line = report.try_plot(str(path))
    if _has_matplotlib():
        assert line == f"wrote {tmp_path / 'm.png'}" and (tmp_path / "m.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed" in line and not (tmp_path / "m.png").exists()


def test_native_cp_layout_and_settings_are_restored():
    """What of the native-CP peer runs without CUDA: SDPA layout with repeated K/V heads, and its option knobs."""
    import torch
    import native_cp
    from torch.distributed.tensor.experimental._attention import _cp_options, _RotateMethod

    k = torch.randn(1, 5, 2, 3)                               # (1, S, Hk=2, D)
    sdpa = native_cp._sdpa_layout(k, heads=6)                 # (1, H=6, S, D), query head h uses K/V head h // 3
    assert sdpa.shape == (1, 6, 5, 3) and sdpa.is_contiguous()
    for h in range(6):
        assert torch.equal(sdpa[0, h], k[0, :, h // 3])
    saved = (_cp_options.enable_load_balance, _cp_options.rotate_method)
    with native_cp._cp_settings(causal=False, rotate="alltoall"):
        assert _cp_options.enable_load_balance is False and _cp_options.rotate_method == _RotateMethod.ALL_TO_ALL
    assert (_cp_options.enable_load_balance, _cp_options.rotate_method) == saved
    assert "CUDA" in native_cp.native_cp_unavailable_reason(torch.device("cpu"))


def _peak_memory_world(rank, world_size):
    import cpu_peak_memory

    return cpu_peak_memory.main(["--tokens", "64"])


def test_cpu_peak_memory_script_reports_every_case():
    """benchmarks/cpu_peak_memory.py (the CPU stand-in for the GPU memory column) runs and reports a forward and a
    backward peak for the single-shard baseline and every ring variant, the same on both ranks (max over ranks)."""
    import re

    per_rank = [[line for line in lines if not line.startswith("#")] for lines in run_world(2, _peak_memory_world,
                                                                                          timeout=120)]
    assert per_rank[0] == per_rank[1]   # each rank reports the maximum over both
    rows = per_rank[0]
    assert [r.split(":")[0] for r in rows] == [
        "single (one shard, SDPA), causal", "single (one shard, SDPA), non-causal", "zigzag / torch_cpu, causal",
        "ring / torch_cpu, non-causal", "ring / torch_cpu, causal", "stripe / torch_cpu, causal"]
    for row in rows:
        fwd, bwd = map(float, re.fullmatch(r".*: forward ([0-9.]+) U \| backward ([0-9.]+) U", row).groups())
        assert fwd > 0 and bwd > 0, row


# ------------------------------------------------------------------------------------------- provenance


def _git(cwd, *args):
    import subprocess

    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def tiny_repo(tmp_path, monkeypatch):
    """A git repository with a few source files, results and a cache; ``_stamp`` pointed at it."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    for var in ("HFPATCH_COMMIT", "HFPATCH_SOURCE_HASH"):
        monkeypatch.delenv(var, raising=False)
    repo = tmp_path / "repo"
    _write(repo, {"ring_kernels/engine.py": "x = 1\n", "hfpatch/api.py": "y = 2\n", "benchmarks/b.py": "z = 3\n",
                  "benchmarks/results/r.json": "{}\n", "README.md": "r\n", ".gitignore": "__pycache__/\n"})
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "c")
    monkeypatch.setattr(_stamp, "_REPO", str(repo))
    return repo, _git(repo, "rev-parse", "HEAD")


def test_stamp_names_its_own_checkouts_commit_only_while_the_source_is_committed(tiny_repo):
    repo, head = tiny_repo
    committed, count = _stamp.committed_source_hash(head)
    assert count == 3 and _stamp.source_hash() == (committed, 3)     # results, README, caches not counted
    got = _stamp.provenance()
    assert got["git_commit"] == head and got["source_hash"] == committed and "equals the tree's" in got["provenance"]

    _write(repo, {"benchmarks/results/new.json": "{}\n", "hfpatch/__pycache__/api.cpython-311.pyc": "bytes",
                  "README.md": "edited\n"})
    assert _stamp.provenance()["git_commit"] == head                   # none of these is source

    _write(repo, {"ring_kernels/engine.py": "x = 2\n"})                # an uncommitted edit
    got = _stamp.provenance()
    assert got["git_commit"] == _stamp.UNCOMMITTED and got["based_on_commit"] == head
    assert got["source_hash"] != committed and f"differs from commit {head}" in got["provenance"]
    _write(repo, {"ring_kernels/engine.py": "x = 1\n", "ring_kernels/extra.py": "\n"})   # an untracked file
    assert _stamp.provenance()["git_commit"] == _stamp.UNCOMMITTED
    (repo / "ring_kernels/extra.py").unlink()
    assert _stamp.provenance()["git_commit"] == head
    with pytest.raises(ValueError, match="is not the source hash of commit"):
        _stamp.provenance(expected_hash="sha256:00")                    # contradicts git: refused


def test_stamp_of_a_tree_without_git_needs_the_commit_and_its_hash(tiny_repo, tmp_path, monkeypatch):
    """The GPU machine's case: a copy without .git, inside an unrelated checkout (whose HEAD must not be used)."""
    import shutil

    repo, head = tiny_repo
    committed, _ = _stamp.committed_source_hash(head)
    outer = tmp_path / "outer"
    _write(outer, {"other.txt": "o\n"})
    _git(outer, "init", "-q")
    _git(outer, "add", ".")
    _git(outer, "commit", "-q", "-m", "unrelated")
    plain = outer / "tree"
    shutil.copytree(repo, plain, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setattr(_stamp, "_REPO", str(plain))

    got = _stamp.provenance()
    assert got["git_commit"] == _stamp.UNCOMMITTED and got["based_on_commit"] is None
    assert "no commit given" in got["provenance"] and got["source_hash"] == committed
    monkeypatch.setenv("HFPATCH_COMMIT", head)
    got = _stamp.provenance()
    assert got["git_commit"] == _stamp.UNCOMMITTED and got["based_on_commit"] == head
    assert "without HFPATCH_SOURCE_HASH" in got["provenance"]
    monkeypatch.setenv("HFPATCH_SOURCE_HASH", committed)
    assert _stamp.provenance()["git_commit"] == head
    assert _stamp._short_tag(_stamp.provenance()) == head[:7]
    _write(plain, {"hfpatch/api.py": "y = 3\n"})                      # the tree sent was not the commit
    got = _stamp.provenance()
    assert got["git_commit"] == _stamp.UNCOMMITTED and "differs from commit" in got["provenance"]
    assert _stamp._short_tag(got) == "uncommitted-tree-" + got["source_hash"][len("sha256:"):][:12]
    monkeypatch.setenv("HFPATCH_COMMIT", "unknown")
    with pytest.raises(ValueError, match="HFPATCH_COMMIT='unknown' is not a commit id"):
        _stamp.provenance()


def test_stamp_export_prints_what_the_device_needs(tiny_repo, capsys):
    repo, head = tiny_repo
    assert _stamp.main(["--export"]) == 0
    out = capsys.readouterr()
    committed, _ = _stamp.committed_source_hash(head)
    assert out.out.strip() == f"HFPATCH_COMMIT={head} HFPATCH_SOURCE_HASH={committed}" and out.err == ""
    _write(repo, {"benchmarks/b.py": "z = 4\n"})
    assert _stamp.main(["--export"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == f"HFPATCH_COMMIT={head} HFPATCH_SOURCE_HASH={committed}"
    assert "differs from HEAD" in out.err and "uncommitted-tree" in out.err


def test_device_suite_takes_the_gpu_count():
    import subprocess

    suite = os.path.join(_BENCH, "device_suite.sh")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for args, message in (([], "usage:"), (["two"], "got 'two'"), (["1"], "NGPU >= 2"),
                          (["64"], "64 GPUs asked for")):
        done = subprocess.run(["bash", suite, *args], cwd=os.path.dirname(_BENCH), env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)

