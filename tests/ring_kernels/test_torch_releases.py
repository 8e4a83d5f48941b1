"""ring_kernels.torch_releases: the supported torch range is enforced at import, the bounds read the installed
release, and what the oldest bound rests on computes exactly on the release it runs on (CI runs this module under the
oldest and the newest supported torch: docs/ci.md)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch

from _paths import ROOT
from _tox import matrix_torch_venvs
from ring_kernels import merge, torch_releases
from ring_kernels.backends import torch_cpu
from ring_kernels.backends.base import BlockMask


OUTSIDE = ["2.8.0+cu128", "2.6.0", "2.16.0", "3.0.0", "2.16.0.dev20261201"]
INSIDE = ["2.9.1+cu128", "2.15.0", "2.13.0+cpu"]

# One fresh interpreter imports torch once, then, for each version, drops every ring_kernels module, makes torch
# report that version and imports ring_kernels again: each import runs the package's import-time check from nothing.
# It prints one JSON line per version: "imported", or the uncaught error as the interpreter would print its last line.
_IMPORTS = """
import json, sys, traceback
import torch
for version in json.loads(sys.argv[1]):
    for name in [n for n in sys.modules if n == "ring_kernels" or n.startswith("ring_kernels.")]:
        del sys.modules[name]
    torch.__version__ = version
    try:
        import ring_kernels
        outcome = "imported"
    except BaseException as error:
        outcome = "".join(traceback.format_exception_only(type(error), error))
    print(json.dumps([version, outcome]))
"""


@pytest.fixture(scope="module")
def import_outcomes() -> dict:
    """``import ring_kernels`` under each version of OUTSIDE and INSIDE: version -> "imported" or the error line."""
    result = subprocess.run([sys.executable, "-c", _IMPORTS, json.dumps(OUTSIDE + INSIDE)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(line) for line in result.stdout.splitlines() if line.startswith("["))


@pytest.mark.parametrize("version", OUTSIDE)
def test_a_torch_outside_the_range_is_refused_at_import(import_outcomes, version):
    outcome = import_outcomes[version]
    assert outcome != "imported"
    assert outcome.startswith("ring_kernels.torch_releases.UnsupportedTorch"), outcome
    assert f"torch {version} is outside" in outcome and torch_releases.supported_range() in outcome


@pytest.mark.parametrize("version", INSIDE)
def test_a_torch_inside_the_range_imports(import_outcomes, version):
    assert import_outcomes[version] == "imported"


def test_the_range_is_the_one_pyproject_declares():
    """pyproject's requirement is ``torch>=OLDEST,<NEWEST+1``: the claim is the tested range."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    (torch_requirement,) = [d for d in dependencies if d.replace(" ", "").startswith("torch>")]
    oldest, newest = torch_releases.TORCH_OLDEST, torch_releases.TORCH_NEWEST
    assert torch_requirement.replace(" ", "") == f"torch>={oldest[0]}.{oldest[1]},<{newest[0]}.{newest[1] + 1}"


def test_installed_release_parses_local_and_dev_versions(monkeypatch):
    for text, release in [("2.13.0+cpu", (2, 13)), ("2.9.1+cu128", (2, 9)), ("2.16.0a0+git1234", (2, 16))]:
        monkeypatch.setattr(torch, "__version__", text)
        assert torch_releases.installed_torch() == release
    monkeypatch.setattr(torch, "__version__", "unknown")
    with pytest.raises(torch_releases.UnsupportedTorch, match="torch unknown is outside"):
        torch_releases.installed_torch()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_k", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_backend_gqa_matches_repeated_heads_in_float64(dtype, heads_k, causal):
    """The CPU backend on GQA K/V (aten's CPU flash kernel computes GQA itself; before torch 2.9 it returned wrong
    numbers, one reason 2.9 is the oldest supported) equals the float64 attention of K/V repeated to the query's
    heads: output, LSE and every gradient."""
    g = torch.Generator().manual_seed(heads_k)
    b, s, h, d = 2, 24, 4, 16
    q = torch.randn(b, s, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, s, heads_k, d, generator=g, dtype=dtype)
    v = torch.randn(b, s, heads_k, d, generator=g, dtype=dtype)
    dout = torch.randn(b, s, h, d, generator=g, dtype=dtype)
    mask, scale = BlockMask(causal=causal), d ** -0.5
    backend = torch_cpu.TorchCpuBackend()
    out, lse = backend.forward(q, k, v, scale=scale, mask=mask)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, scale=scale, mask=mask)

    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    groups = h // heads_k
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64.repeat_interleave(groups, 2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v64.repeat_interleave(groups, 2))
    ref.backward(dout.double())
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, want in [("out", out, ref), ("lse", lse, scores.logsumexp(-1)), ("dq", dq, q64.grad),
                            ("dk", dk, k64.grad), ("dv", dv, v64.grad)]:
        assert got.shape == want.shape, name
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < bound, (name, error)


def test_triton_kernels_are_absent_below_the_oldest_tested_triton_and_say_why():
    """A triton older than TRITON_OLDEST (torch 2.9 pins 3.5) makes the Triton backend absent with the reason; a
    tested one imports it."""
    reason = torch_releases.triton_unsupported_reason()
    code = "import ring_kernels.backends.triton_attn; print('imported')"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if reason is None:
        assert result.returncode == 0 and "imported" in result.stdout, result.stderr
    else:
        assert result.returncode != 0 and reason in result.stderr, result.stderr
        assert not merge.use_fused()


def _pinned(path: str, pattern: str) -> tuple:
    with open(os.path.join(ROOT, path)) as handle:
        found = re.search(pattern, handle.read())
    assert found is not None, (path, pattern)
    return int(found.group(1)), int(found.group(2))


def _ci_newest() -> tuple:
    """The series of the CI venv's torch (.ci/run)."""
    return _pinned(".ci/run", r"pip install -q torch==(\d+)\.(\d+)\.\d+")


def _ci_oldest() -> tuple:
    """The series of the oldest torch's venv (scripts/torch_release.sh)."""
    return _pinned("scripts/torch_release.sh", r"\noldest=torch==(\d+)\.(\d+)\.\d+")


def test_ci_tests_the_two_ends_of_the_range():
    """CI's venv installs the newest supported series (.ci/run) and scripts/torch_release.sh the oldest."""
    assert _ci_newest() == torch_releases.TORCH_NEWEST
    assert _ci_oldest() == torch_releases.TORCH_OLDEST


def test_every_series_of_the_range_runs_in_ci():
    """The claim is the test: each series from the oldest to the newest supported one is the torch of some part of
    CI -- the CI venv (newest: the whole suite), .venv-torch-oldest (the release-independent tests and the demo),
    or the torch venv a tox env of the matrix shares (the release-dependent tests, the demo among them) -- and CI
    sets up every venv the matrix names."""
    newest, oldest = _ci_newest(), _ci_oldest()
    tested = {newest, oldest}
    for env, venv in matrix_torch_venvs().items():
        if venv == ".venv-torch-oldest":
            tested.add(oldest)
        elif venv == ".venv":
            tested.add(newest)
        else:
            found = re.fullmatch(r"\.venv-torch-(\d+)\.(\d+)\.\d+", venv)
            assert found is not None, f"tox env {env} takes its torch from {venv}, not a .venv-torch-X.Y.Z venv"
            tested.add((int(found.group(1)), int(found.group(2))))
    major = torch_releases.TORCH_OLDEST[0]
    assert torch_releases.TORCH_NEWEST[0] == major, "the range spans a major release: list its series here"
    declared = {(major, minor) for minor in range(torch_releases.TORCH_OLDEST[1], torch_releases.TORCH_NEWEST[1] + 1)}
    assert tested == declared, (f"series outside CI: {sorted(declared - tested)}; "
                                f"tested but not declared: {sorted(tested - declared)}")
    with open(os.path.join(ROOT, ".ci", "run")) as handle:
        ci = handle.read()
    assert "scripts/torch_release.sh --matrix setup" in ci and "scripts/torch_release.sh setup" in ci
    # --matrix sets up exactly the .venv-torch-X.Y.Z venvs tox.ini names: its own list, run here.
    listed = subprocess.run(
        ["bash", "-c", 'eval "$(sed -n "/^matrix_releases()/,/^}/p" scripts/torch_release.sh)"; matrix_releases'],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named = {venv.removeprefix(".venv-torch-") for venv in matrix_torch_venvs().values()
             if re.fullmatch(r"\.venv-torch-\d+\.\d+\.\d+", venv)}
    assert sorted(listed) == sorted(named) and len(named) > 0, (listed, named)
