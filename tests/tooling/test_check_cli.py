"""``hfpatch check``: exit codes, JSON facts, the dry run's own detection logic, and the static verdict.

The dry run is exercised for real once (a subprocess spawning a 2-process gloo world on the installed
transformers); the decision logic around it is tested in-process with fake patches that miss a site or fail
to restore, so that a broken patcher is caught by ``check`` itself. The static verdict reads small stand-in
wheels built by ``_fake_wheel`` in a private wheel cache (no network).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

import hfpatch
from _fake_wheel import BROKEN_DEF, S1_DEF, make_wheel
from hfpatch.cli import check as check_cli
from hfpatch.cli import main
from hfpatch.release.scan import scan_wheel
from hfpatch.signatures.registry import entry_for_version
from hfpatch.version_gates import installed_transformers_version
from ring_kernels.torch_releases import supported_range


def _run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[int, dict | str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hfpatch", "check", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
    out = proc.stdout
    return proc.returncode, (json.loads(out) if "--json" in args else out + proc.stderr)


# ------------------------------------------------------------------------------------- the real dry run


def test_installed_release_is_supported_and_verified_in_a_gloo_world():
    code, report = _run_cli("--json", "--timeout", "600", timeout=900)
    assert code == 0, report
    assert report["exit_code"] == 0 and report["supported"] is True and report["problems"] == []
    version = installed_transformers_version()
    assert report["transformers"] == str(version)
    # The live signature is read as the generation the registry records for this release.
    assert report["signature_id"] == entry_for_version(version).id
    assert report["verdict"] == "exact"
    assert report["torch_verdict"] == "supported" and report["torch_range"] == supported_range()
    # The defining module is always a binding site; the sites are what apply patched on rank 0.
    assert "transformers.modeling_flash_attention_utils._flash_attention_forward" in report["binding_sites"]
    dry = report["dry_run"]
    assert dry["ok"] is True and dry["world_size"] == 2 and len(dry["ranks"]) == 2
    for rank in dry["ranks"]:
        assert rank["active"] and rank["verified"] and rank["removed"] and rank["ok"], rank
        assert rank["signature_id"] == report["signature_id"]
        assert rank["sites"] == report["binding_sites"]


def test_a_torch_outside_the_supported_range_fails_the_check_by_name():
    """``hfpatch check --json`` on a torch outside ring_kernels' range: exit 1, the torch verdict, the named error
    with the fix, no dry run (torch's reported version is changed in the child before anything imports it)."""
    code = ("import sys, torch; torch.__version__ = '2.8.0+cu128'; from hfpatch.cli import main; "
            "sys.exit(main(['check', '--json']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["exit_code"] == 1, proc.stderr
    assert report["torch"] == "2.8.0+cu128" and report["torch_verdict"] == "unsupported-torch"
    assert report["torch_range"] == supported_range() and "dry_run" not in report
    (problem,) = report["problems"]
    assert "torch 2.8.0+cu128 is outside" in problem and "Fix: pip install 'torch>=" in problem


# ---------------------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize("world_size", [1, 0, -3])
def test_world_size_below_two_is_a_usage_error(world_size, capsys):
    assert main(["check", "--json", "--world-size", str(world_size)]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 2
    assert f"--world-size {world_size}" in report["problems"][0] and "at least 2" in report["problems"][0]


def test_a_usage_error_still_reports_the_installed_versions(capsys):
    from importlib import metadata

    assert main(["check", "--world-size", "0"]) == 2
    out = capsys.readouterr().out
    assert f"transformers   {metadata.version('transformers')}" in out and "(unknown)" not in out
    assert f"torch          {metadata.version('torch')}" in out


def test_an_unknown_option_shows_checks_own_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hfpatch check ") and err.splitlines()[-1] == (
        "hfpatch check: error: unrecognized arguments: --bogus")


def test_dry_run_options_with_a_static_release_are_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(check_cli, "check_release", lambda version: pytest.fail("no static check for a bad command"))
    assert main(["check", "--transformers", "4.47.1", "--world-size", "4", "--kernel", "ring"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("hfpatch check: error: --world-size, --kernel: only the installed release's dry run")
    assert "Fix: drop --world-size, --kernel" in last


@pytest.mark.parametrize("kernel, expected", [
    ("usp:2", "expected auto, a ring variant (zigzag, ring, stripe, llama3), ulysses or usp:UxR"),
    ("zigzag:torch_flash", "backend 'torch_flash' cannot run on CPU processes"),
    ("zigzag:nope", "backend 'nope' cannot run on CPU processes"),
])
def test_unknown_kernel_is_a_usage_error(monkeypatch, capsys, kernel, expected):
    monkeypatch.setattr(check_cli, "spawn_world", lambda *a: pytest.fail("no dry run for a bad kernel"))
    assert main(["check", "--json", "--kernel", kernel]) == 2
    report = json.loads(capsys.readouterr().out)
    assert f"--kernel {kernel!r}" in report["problems"][0] and expected in report["problems"][0]


def test_transformers_not_installed_is_an_environment_error(monkeypatch):
    monkeypatch.setattr("hfpatch.version_gates.installed_transformers_version", lambda: None)
    report = check_cli.run_check()
    assert report["exit_code"] == 2
    assert "transformers is not installed" in report["problems"][0]
    assert "--transformers X.Y.Z" in report["problems"][0]


def test_release_before_4_43_is_unsupported_with_the_upgrade_fix(monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr("hfpatch.version_gates.installed_transformers_version", lambda: Version("4.42.4"))
    report = check_cli.run_check()
    assert report["exit_code"] == 1 and report["verdict"] == "unsupported-release"
    assert "upgrade to transformers>=4.43.0" in report["problems"][0]
    assert "dry_run" not in report


def test_unsupported_live_signature_reports_the_diff_and_skips_the_dry_run(monkeypatch):
    import transformers.modeling_flash_attention_utils as mfau

    namespace: dict = {}
    exec(BROKEN_DEF, namespace)
    monkeypatch.setattr(mfau, "_flash_attention_forward", namespace["_flash_attention_forward"])
    monkeypatch.setattr(check_cli, "spawn_world", lambda *a: pytest.fail("no dry run for an unsupported signature"))
    report = check_cli.run_check()
    assert report["exit_code"] == 1 and report["verdict"] == "unsupported" and not report["supported"]
    assert report["signature_id"].endswith("+unsupported")
    assert "causal_flag" in report["diff"]  # the diff names what differs
    assert "hfpatch signatures scan" in report["problems"][0]
    text = check_cli.format_report(report)
    assert "NOT SUPPORTED" in text and "causal_flag" in text


# ----------------------------------------------------------------------- dry-run outcomes -> exit code


def _ranks(*oks, error="VerificationError: probe differs", kind="hfpatch"):
    return [
        {"rank": r, "ok": ok, "sites": ["m._flash_attention_forward"], **({} if ok else {"error": error, "error_kind": kind})}
        for r, ok in enumerate(oks)
    ]


@pytest.mark.parametrize(
    "ranks, code",
    [
        (_ranks(True, True), 0),
        (_ranks(True, False), 1),                                        # a verification failure on one rank
        (_ranks(False, False, error="ModuleNotFoundError: x", kind="environment"), 2),
        (_ranks(True, False, error="KeyError: 'x'", kind="internal"), 1),
    ],
)
def test_dry_run_outcome_decides_the_exit_code(monkeypatch, ranks, code):
    monkeypatch.setattr(check_cli, "spawn_world", lambda world_size, kernel, timeout: ranks)
    report = check_cli.run_check()
    assert report["exit_code"] == code
    assert report["dry_run"]["ok"] is (code == 0)
    assert report["binding_sites"] == ["m._flash_attention_forward"]
    failing = [r["rank"] for r in ranks if not r["ok"]]
    assert [p.split(":")[0] for p in report["problems"]] == [f"rank {r}" for r in failing]


def test_a_world_that_cannot_run_is_an_environment_error(monkeypatch):
    def broken(world_size, kernel, timeout):
        raise check_cli.WorldError("ranks [1] did not finish within 180s (deadlock?)")

    monkeypatch.setattr(check_cli, "spawn_world", broken)
    report = check_cli.run_check()
    assert report["exit_code"] == 2 and "deadlock" in report["problems"][0]


class _FakePatch:
    """Stands in for hfpatch.Patch: replaces ``original`` at the given holders, and puts it back (or not)."""

    def __init__(self, holders, original, restore=True):
        self.active, self.signature_id, self._holders, self._original, self._restore = True, "S-test", holders, original, restore
        self.sites = [f"{m.__name__}.{attr}" for m, attr in holders]
        for module, attr in holders:
            setattr(module, attr, self._wrapper)

    def _wrapper(self, *a, **k):
        raise AssertionError("not called in these tests")

    def remove(self):
        for module, attr in self._holders:
            setattr(module, attr, self._original if self._restore else self._wrapper)


@pytest.fixture
def extra_site(monkeypatch):
    """A loaded module that binds the original function by from-import, as model modules do in 4.43-4.47."""
    import transformers.modeling_flash_attention_utils as mfau

    module = types.ModuleType("hfpatch_test_fake_model")
    module._flash_attention_forward = mfau._flash_attention_forward
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(mfau, "_flash_attention_forward", mfau._flash_attention_forward)  # restored after the test
    return mfau, module


@pytest.mark.parametrize(
    "patched, restore, ok, error",
    [
        ("both", True, True, None),
        ("defining module only", True, False, "still held the original function: ['hfpatch_test_fake_model."),
        ("both", False, False, "remove() did not restore the original function at: ['hfpatch_test_fake_model."),
    ],
)
def test_dry_run_detects_a_missed_site_and_an_incomplete_remove(monkeypatch, extra_site, patched, restore, ok, error):
    mfau, model_module = extra_site
    original = mfau._flash_attention_forward
    check_cli.import_integration({})  # the dry run imports it (4.48+): one more holder to patch
    holders = [(mfau, "_flash_attention_forward")]
    if patched == "both":  # every module that holds the original, as the real patcher does
        holders = [
            (sys.modules[label.rsplit(".", 1)[0]], label.rsplit(".", 1)[1]) for label in check_cli.holders(original)
        ]
        assert (model_module, "_flash_attention_forward") in holders
    for module, attr in holders:
        monkeypatch.setattr(module, attr, original)  # restored after the test, whatever the fake did
    monkeypatch.setattr(hfpatch, "apply", lambda group, **kw: _FakePatch(holders, original, restore))
    facts = {"rank": 0, "ok": False}
    check_cli.apply_verify_remove(facts, None, "auto")
    assert facts["ok"] is ok, facts
    assert facts["sites"] == sorted(f"{m.__name__}.{a}" for m, a in holders)
    if error:
        assert error in facts["error"] and facts["error_kind"] == "hfpatch"
    else:
        assert facts["removed"] and "error" not in facts


# ------------------------------------------------------------------------------------- static verdict


@pytest.fixture
def wheel_cache(tmp_path, monkeypatch):
    """A private wheel cache; pip is pointed at no index, so nothing is ever downloaded."""
    cache = tmp_path / "wheels"
    cache.mkdir()
    monkeypatch.setenv("HFPATCH_WHEEL_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    return cache


def test_static_verdict_of_a_supported_release(wheel_cache, capsys):
    make_wheel(wheel_cache, "4.43.4", S1_DEF, models=("llama", "mistral"))
    assert main(["check", "--transformers", "4.43.4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "static" and report["supported"] and report["exit_code"] == 0
    assert (report["transformers"], report["signature_id"], report["verdict"]) == ("4.43.4", "S1-4.43.4", "exact")
    # The installed check's form: module.attribute, the definition included.
    assert report["binding_sites"] == [
        "transformers.modeling_flash_attention_utils._flash_attention_forward",
        "transformers.models.llama.modeling_llama._flash_attention_forward",
        "transformers.models.mistral.modeling_mistral._flash_attention_forward",
    ]


def test_static_binding_sites_leave_out_modular_templates(wheel_cache, capsys):
    """transformers ships models/<m>/modular_<m>.py, the source its modeling files are generated from; it imports
    the function by name but is never imported at run time, so it is no binding site."""
    import zipfile

    wheel = make_wheel(wheel_cache, "4.47.1", S1_DEF, models=("gemma",))
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("transformers/models/gemma/modular_gemma.py",
                    "from ...modeling_flash_attention_utils import _flash_attention_forward\n")
    assert scan_wheel(wheel).binding_modules == ("transformers.models.gemma.modeling_gemma",)
    assert main(["check", "--transformers", "4.47.1"]) == 0
    out = capsys.readouterr().out
    assert "modular" not in out
    assert "binding sites  2 (in the wheel: the definition and every module that imports it by name)" in out
    assert "    transformers.models.gemma.modeling_gemma._flash_attention_forward" in out


def test_static_verdict_of_an_unsupported_signature_has_the_diff(wheel_cache, capsys):
    make_wheel(wheel_cache, "4.99.0", BROKEN_DEF)
    assert main(["check", "--transformers", "4.99.0"]) == 1
    out = capsys.readouterr().out
    assert "NOT SUPPORTED" in out and "causal_flag" in out and "not supported" in out


def test_static_verdict_before_4_43_says_upgrade(wheel_cache, capsys):
    assert main(["check", "--transformers", "4.42.4", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "unsupported" and "upgrade to >= 4.43" in report["problems"][0]


@pytest.mark.parametrize(
    "version, expected",
    [
        ("four.43", "is not a valid version"),
        ("4.43.4.dev0+local!", "is not a valid version"),
        ("4.77.0", "WheelFetchError: transformers==4.77.0"),  # not in the cache, and no index
    ],
)
def test_static_bad_input_exits_2_and_writes_nothing(wheel_cache, capsys, version, expected):
    assert main(["check", "--transformers", version, "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 2 and expected in report["problems"][0]
    assert list(wheel_cache.iterdir()) == []
