"""COMPAT.md: rendering from matrix records + the static scan, the staleness check, and the matrix record.

Also checks the committed COMPAT.md itself: it must be current with the registry and its committed inputs
(the same check CI runs with ``hfpatch compat --check``), and list every minor release from 4.43 to the newest.
"""
from __future__ import annotations

import json
import sys

import pytest
from packaging.version import Version

from _fake_wheel import BROKEN_DEF, S1_DEF, make_wheel
from _paths import ROOT
from hfpatch.release import compat_table as cr
from hfpatch.cli import main
from hfpatch.signatures.registry import load_registry


def _record(release, *, sig="S1-4.43.4", verdict="exact", outcome="passed", date="2026-11-22", digest=None, sites=None):
    return {
        "env": f"tf{release}", "release": release, "signature_id": sig, "verdict": verdict,
        "binding_sites": sites if sites is not None else ["transformers.modeling_flash_attention_utils._flash_attention_forward"],
        "check_exit_code": 0 if outcome == "passed" else 1, "pytest_outcome": outcome,
        "pytest_summary": "12 passed" if outcome == "passed" else "1 failed, 11 passed",
        "date": date, "entry_digest": digest or cr.entry_digest(sig), "torch": "2.15.0",
    }


def _static(releases: dict, digest=None):
    return {"registry_digest": digest or cr.registry_digest(), "date": "2026-11-21",
            "available_releases": sorted(releases, key=Version), "releases": releases}


def _facts(sig, verdict="exact", n_sites=3):
    return {"signature_id": sig, "verdict": verdict, "supported": verdict != "unsupported",
            "binding_sites": [f"transformers.models.m{i}.modeling_m{i}" for i in range(n_sites)]}


# ----------------------------------------------------------------------------------------------- pieces


def test_latest_patch_per_minor_skips_prereleases_and_old_series():
    releases = ["4.42.4", "4.43.0", "4.43.4", "4.43.10", "4.44.0rc1", "4.44.2", "5.0.0rc3", "5.0.0", "junk", "5.1.0.dev0"]
    assert cr.latest_patch_per_minor(releases) == ["4.43.10", "4.44.2", "5.0.0"]


def test_registry_digest_is_stable_and_tracks_every_registry_file(monkeypatch):
    first = cr.registry_digest()
    assert first.startswith("sha256:") and first == cr.registry_digest()
    from importlib import resources

    names = sorted(r.name for r in resources.files("hfpatch.signatures").iterdir() if r.name.endswith(".json"))
    assert len(names) >= 7  # S1..S7 at least
    # A changed byte in one registry file changes the digest.
    real_files = resources.files

    class _Changed:
        def __init__(self, res):
            self._res, self.name = res, res.name

        def read_bytes(self):
            data = self._res.read_bytes()
            return data + b" " if self.name == names[0] else data

    class _Dir:
        def iterdir(self):
            return [_Changed(r) for r in real_files("hfpatch.signatures").iterdir()]

    monkeypatch.setattr(cr.resources, "files", lambda pkg: _Dir())
    assert cr.registry_digest() != first


def test_render_lists_one_row_per_minor_with_matrix_winning_over_static():
    results = {"4.43.4": _record("4.43.4")}
    static = _static({
        "4.43.4": _facts("S1-4.43.4", n_sites=41),
        "4.45.2": _facts("S2-4.44.2", n_sites=50),
        "4.99.1": _facts("S7-5.19.0+unsupported", "unsupported", 0),
    })
    text = cr.render(results, static)
    assert text.startswith(cr.GENERATED_MARK) and f"<!-- registry-digest: {cr.registry_digest()} -->" in text
    rows = [line for line in text.splitlines() if line.startswith("| 4.")]
    assert rows == [
        "| 4.43.4 | S1-4.43.4 | exact | 41 | passed (12 passed) | 1 | 2.15.0 | matrix 2026-11-22 |",
        "| 4.45.2 | S2-4.44.2 | exact | 50 | not run (static scan only) | — | — | static 2026-11-21 |",
        "| 4.99.1 | S7-5.19.0+unsupported | unsupported | 0 | not run (static scan only) | — | — | static 2026-11-21 |",
    ]
    assert "3 releases listed" in text and "2 supported, 1 not; 1 run end to end" in text
    assert "upgrade to transformers>=4.43.0".lower() in text.lower()
    # Every registry generation is listed with its releases.
    for entry in load_registry():
        assert f"| {entry.id} | `{entry.releases}` |" in text
    assert cr.render(results, static) == text  # deterministic


# ---------------------------------------------------------------------------------------------- staleness


def test_current_compat_md_has_no_stale_reasons():
    results, static = {"4.43.4": _record("4.43.4")}, _static({"4.45.2": _facts("S2-4.44.2")})
    assert cr.stale_reasons(cr.render(results, static), results, static) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda md, res, st: (None, res, st), "does not exist"),
        (lambda md, res, st: (md.replace("| exact |", "| compatible |", 1), res, st), "edited by hand"),
        (lambda md, res, st: ("# my notes\n" + md, res, st), "generated header"),
        (lambda md, res, st: (md.replace(cr.registry_digest(), "sha256:0"), res, st), "rendered against registry sha256:0"),
        (lambda md, res, st: (md, res, {**st, "registry_digest": "sha256:old"}), "static.json was scanned against"),
        (lambda md, res, st: (md, {"4.43.4": {**res["4.43.4"], "entry_digest": "sha256:old"}}, st),
         "`tox -e tf4.43.4`"),
        (lambda md, res, st: (md, {"4.43.4": {**res["4.43.4"], "signature_id": "S99-9.9.9"}}, st), "which is now gone"),
        (lambda md, res, st: (md, {**res, "4.44.2": _record("4.44.2", sig="S2-4.44.2")}, st), "inputs changed"),
    ],
)
def test_stale_compat_md_is_reported_with_the_fix(mutate, expected):
    results, static = {"4.43.4": _record("4.43.4")}, _static({"4.45.2": _facts("S2-4.44.2")})
    md, results, static = mutate(cr.render(results, static), results, static)
    reasons = cr.stale_reasons(md, results, static)
    assert len(reasons) >= 1 and any(expected in r for r in reasons), reasons
    assert all("Fix:" in r for r in reasons)


def test_fresh_matrix_results_must_agree_except_for_the_date():
    results, static = {"4.43.4": _record("4.43.4")}, _static({})
    md = cr.render(results, static)
    same_but_later = {"4.43.4": _record("4.43.4", date="2027-01-01")}
    assert cr.stale_reasons(md, results, static, fresh_results=same_but_later) == []
    failed = {"4.43.4": _record("4.43.4", outcome="failed", date="2027-01-01")}
    (reason,) = cr.stale_reasons(md, results, static, fresh_results=failed)
    assert "pytest_outcome: committed 'passed', now 'failed'" in reason
    # A release the matrix ran without a committed record is not stale (COMPAT.md shows its static verdict).
    assert cr.stale_reasons(md, results, static, fresh_results={"5.0.0": _record("5.0.0")}) == []


# ----------------------------------------------------------------------------------------- the CLI


def test_cli_scan_render_check_roundtrip(tmp_path, monkeypatch, capsys):
    """--scan reads every minor's latest wheel (stand-ins here), render writes COMPAT.md, --check passes, and a
    hand edit makes --check fail with exit 1."""
    cache = tmp_path / "wheels"
    make_wheel(cache, "4.43.4", S1_DEF, models=("llama", "gemma"))
    make_wheel(cache, "4.98.1", BROKEN_DEF)
    monkeypatch.setenv("HFPATCH_WHEEL_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    (results_dir / "4.43.4.json").write_text(json.dumps(_record("4.43.4")))
    paths = ["--results-dir", str(results_dir), "--static", str(tmp_path / "static.json"), "--output", str(tmp_path / "C.md")]
    # 4.43.2 and 4.98.0 are older patches of the same minors: only the latest of each is scanned.
    assert main(["compat", "--scan", "--releases", "4.42.4,4.43.2,4.43.4,4.98.0,4.98.1", *paths]) == 0
    static = json.loads((tmp_path / "static.json").read_text())
    assert sorted(static["releases"]) == ["4.43.4", "4.98.1"]
    assert static["releases"]["4.43.4"]["binding_sites"] == [
        "transformers.models.gemma.modeling_gemma", "transformers.models.llama.modeling_llama"]
    assert static["releases"]["4.98.1"]["verdict"] == "unsupported"
    md = (tmp_path / "C.md").read_text()
    assert "| 4.43.4 | S1-4.43.4 | exact | 2 | passed (12 passed) | 1 |" in md
    assert "| 4.98.1 |" in md and "| unsupported |" in md
    capsys.readouterr()
    assert main(["compat", "--check", *paths]) == 0
    (tmp_path / "C.md").write_text(md.replace("passed (12 passed)", "passed (13 passed)"))
    assert main(["compat", "--check", *paths]) == 1
    assert "edited by hand" in capsys.readouterr().err


def test_cli_scan_failure_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HFPATCH_WHEEL_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    static = tmp_path / "static.json"
    code = main(["compat", "--scan", "--releases", "4.43.4", "--static", str(static),
                 "--results-dir", str(tmp_path / "none"), "--output", str(tmp_path / "C.md")])
    assert code == 2 and not static.exists() and not (tmp_path / "C.md").exists()
    assert "static scan of transformers 4.43.4 failed, nothing written" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["compat", "--check", "--releases", "4.43.4"], "--releases is only used with --scan"),
        (["compat", "--fresh-results", "x"], "--fresh-results is only used with --check"),
        (["compat", "--record", "tf4.43.4"], "needs the test command after --"),
        (["compat", "--", "pytest"], "unexpected arguments"),
        (["compat", "--scan", "--releases", "4.x"], "is not a valid version"),
        (["compat", "--check", "--fresh-results", "/nonexistent/dir"], "no such folder"),
    ],
)
def test_cli_usage_errors_exit_2(argv, expected, capsys):
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


def test_record_runs_the_command_then_check_and_writes_the_record(tmp_path, monkeypatch, capsys):
    """The record's facts come from a real `hfpatch check --json` subprocess; here it is stubbed by a fake
    python that prints a fixed report, so the test does not spawn a gloo world (test_check_cli does)."""
    report = {"transformers": "4.43.4", "signature_id": "S1-4.43.4", "verdict": "exact", "exit_code": 0,
              "binding_sites": ["transformers.modeling_flash_attention_utils._flash_attention_forward"],
              "problems": [], "python": "3.11.7", "torch": "2.13.0+cpu"}
    fake_python = tmp_path / "fake_python"
    fake_python.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(report)}\nEOF\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    results = tmp_path / "results"
    test_cmd = ["sh", "-c", "echo '.....'; echo '========= 5 passed, 1 skipped in 3.21s ========='"]
    assert main(["compat", "--record", "tf4.43.4", "--results-dir", str(results), "--", *test_cmd]) == 0
    data = json.loads((results / "4.43.4.json").read_text())
    assert data["pytest_outcome"] == "passed" and data["pytest_summary"] == "5 passed, 1 skipped"
    assert (data["env"], data["signature_id"], data["check_exit_code"]) == ("tf4.43.4", "S1-4.43.4", 0)
    assert data["entry_digest"] == cr.entry_digest("S1-4.43.4") and data["entry_digest"].startswith("sha256:")
    # A failing test command fails the record with its own status, and the record says so.
    failing = ["sh", "-c", "echo '1 failed, 4 passed in 2.00s'; exit 1"]
    assert main(["compat", "--record", "tf4.43.4", "--results-dir", str(results), "--", *failing]) == 1
    data = json.loads((results / "4.43.4.json").read_text())
    assert (data["pytest_outcome"], data["pytest_exit_code"], data["pytest_summary"]) == ("failed", 1, "1 failed, 4 passed")


# ------------------------------------------------------------------------------- the committed COMPAT.md


def test_committed_compat_md_is_current_and_lists_every_minor_release():
    md_path = ROOT / "COMPAT.md"
    results = cr.load_results(ROOT / "compat" / "results")
    static = cr.load_static(ROOT / "compat" / "static.json")
    text = md_path.read_text(encoding="utf-8") if md_path.is_file() else None
    assert cr.stale_reasons(text, results, static) == []
    minors = {(Version(v).major, Version(v).minor) for v in static["available_releases"] if not Version(v).is_prerelease}
    listed = {(Version(line.split("|")[1].strip()).major, Version(line.split("|")[1].strip()).minor)
              for line in text.splitlines() if line.startswith(("| 4.", "| 5."))}
    expected = {m for m in minors if m >= (4, 43)}
    assert listed == expected, sorted(expected ^ listed)
