"""The ``hfpatch`` command line as a user meets it: the help, ``--version``, start-up cost, and usage errors.

Usage errors are tested in-process and must be found before any process is spawned (``no_spawn`` fails the test
otherwise). What ``--help`` imports is measured in a subprocess where the ``hfpatch`` package is an empty stand-in,
so the command line's own imports are measured, whatever ``hfpatch/__init__.py`` imports.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from importlib import metadata

import pytest

from _paths import ROOT
import hfpatch
import hfpatch.release.sweep as sweep
from hfpatch.cli import COMMANDS, main
from hfpatch.cli.demo import MODEL_FAMILIES, sequence_units
from hfpatch.cli.demo_models import MODEL_NAMES
from hfpatch.cli.models import requested_classes
from hfpatch.release.sweep.catalog import CatalogEntry

USER_COMMANDS = ("demo", "check", "models")
STARTUP_LIMIT_S = 3.0  # generous for a loaded 2-core CI machine; an idle one takes ~0.1 s without torch


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


# ------------------------------------------------------------------------------------------------- help


def test_top_level_help_lists_the_user_commands_first(capsys):
    text = _help([], capsys)
    assert text.startswith("usage: hfpatch [-h] [--version] COMMAND")
    assert "context parallelism" in text and "hfpatch.apply(" in text
    positions = [text.index(f"\n  {name} ") for name in (*USER_COMMANDS, "signatures", "compat")]
    assert positions == sorted(positions)
    assert text.index("developer commands:") > text.index("\n  models ")
    assert "registers itself" not in text and "module" not in text


@pytest.mark.parametrize("command", [[], *([name] for name in COMMANDS), ["signatures", "scan"]])
def test_every_help_is_plain_text_within_80_columns(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = _help(command, capsys)
    assert "``" not in text and not re.search(r"::\s*$", text, re.MULTILINE)
    assert max(len(line) for line in text.splitlines()) <= 80


def test_check_help_names_no_internal_function(capsys):
    text = _help(["check"], capsys)
    for internal in ("_flash_attention_forward", "static_check", "hfpatch.cli", "Patch.remove", "verify=True"):
        assert internal not in text


def test_version_names_hfpatch_transformers_and_torch(capsys):
    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"hfpatch {hfpatch.__version__} (")
    assert f"transformers {metadata.version('transformers')}" in line and f"torch {metadata.version('torch')}" in line


# ------------------------------------------------------------------------------------------ start-up cost

# Runs with the hfpatch package replaced by an empty stand-in (its __init__ not executed) and torch, transformers
# and numpy made unimportable: builds every parser, prints --help and --version, and reports what was imported.
_STUB_PROBE = """
import importlib.abc, io, json, sys, types, contextlib
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers", "numpy"):
            raise ImportError("the command line must not import " + name)
sys.meta_path.insert(0, Refuse())
package = types.ModuleType("hfpatch")
package.__path__, package.__version__ = [sys.argv[1] + "/hfpatch"], "0"
sys.modules["hfpatch"] = package
from hfpatch.cli import COMMANDS, main
loaded = {}
def run(argv):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    return sorted(m for m in sys.modules if m.startswith("hfpatch.cli."))
loaded["--help"] = run(["--help"])
loaded["--version"] = run(["--version"])
for name in COMMANDS:
    loaded[name + " --help"] = run([name, "--help"])
print(json.dumps(loaded))
"""


def test_help_and_version_import_no_command_and_no_torch():
    proc = subprocess.run([sys.executable, "-c", _STUB_PROBE, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    # Only the shared argument checks: no command's module (each would be a cost --help does not need).
    assert loaded["--help"] == loaded["--version"] == ["hfpatch.cli.arguments"]
    for name in COMMANDS:  # a command's own --help builds its parser without torch either
        assert f"hfpatch.cli.{name}" in loaded[f"{name} --help"]


def _wall_time(*args: str) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return time.perf_counter() - started, proc.stderr


def test_help_and_version_start_fast():
    help_s, imports = _wall_time("-X", "importtime", "-m", "hfpatch", "--help")
    version_s, _ = _wall_time("-m", "hfpatch", "--version")
    imported = {line.rsplit("|", 1)[-1].strip() for line in imports.splitlines() if line.startswith("import time:")}
    measured = f"--help {help_s:.2f} s, --version {version_s:.2f} s"
    if "torch" in imported:
        # The command line imports no torch (the test above); the package's __init__ does, before main runs.
        pytest.xfail(f"'import hfpatch' imports torch (hfpatch/__init__.py imports hfpatch.api eagerly): {measured}")
    assert "transformers" not in imported
    assert help_s < STARTUP_LIMIT_S and version_s < STARTUP_LIMIT_S, measured


# ------------------------------------------------------------------------------------------- usage errors


@pytest.fixture
def no_spawn(monkeypatch):
    """Every command spawns its processes through torch.multiprocessing's spawn context: a usage error must
    come first."""
    import torch.multiprocessing

    monkeypatch.setattr(torch.multiprocessing, "get_context", lambda *a: pytest.fail("a process was spawned"))


def _usage_error(argv: list[str], capsys) -> str:
    """The one error line of a usage error (exit 2, printed under the command's usage)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    lines = captured.err.splitlines()
    prog = " ".join(["hfpatch", *argv[:1]]) if argv and argv[0] in COMMANDS else "hfpatch"
    assert lines[0].startswith(f"usage: {prog} ")
    assert lines[-1].startswith(f"{prog}: error: ")
    return lines[-1]


@pytest.mark.parametrize("argv, expected", [
    ([], "no COMMAND given; 'hfpatch demo' runs the demo"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["check", "--bogus"], "unrecognized arguments: --bogus"),
    (["check", "--timeout", "0"], "expected a positive number of seconds"),
    (["demo", "--seq-len", "7"], "--seq-len 7: the zigzag layout splits a row over 2 processes in 4 equal parts, "
                                 "so the length must be a multiple of 4. Fix: --seq-len 8."),
    (["demo", "--world-size", "3", "--kernel", "stripe", "--seq-len", "64"], "multiple of 3. Fix: --seq-len 66."),
    (["demo", "--packed", "--kernel", "zigzag", "--seq-len", "6"], "splits each packed document"),
    (["demo", "--kernel", "nope"], "--kernel 'nope': expected auto, a ring variant (zigzag, ring, stripe, "
                                   "llama3), ulysses or usp:UxR (U x R = the world size), optionally followed by "
                                   ":backend (e.g. zigzag:reference). Fix:"),
    (["demo", "--kernel", "usp:2x2"], "--kernel usp:2x2 --world-size 2: 'usp:2x2' asks for 2 x 2 = 4 ranks"),
    (["demo", "--kernel", "ring:triton"], "backend 'triton' cannot run on CPU processes"),
    (["demo", "--model", "gpt9"], "invalid choice: 'gpt9'"),
    (["models", "--world-size", "1"], "--world-size 1: context parallelism needs at least 2 processes"),
    (["models", "--kernel", "zigzag:"], "--kernel 'zigzag:'"),
    (["models", "--kernel", "usp:3x2", "--world-size", "4"],
     "asks for 3 x 2 = 6 ranks (Ulysses groups of 3 x a ring of 2), but the CP group has 4. Fix: kernel='usp:2x2'"),
    (["models", "--kernel", "ulysses", "--check"], "--kernel ulysses with --write or --check: MODELS.md's verdict "
                                                   "column is the sweep under kernel auto"),
    (["models", "--classes", "LlamaForCausalLM", "--write"], "Fix: drop --classes."),
    (["models", "--check", "no/such/MODELS.md"], "--check no/such/MODELS.md: no such file"),
    (["compat", "--releases", "4.43.4"], "--releases is only used with --scan. Fix: add --scan."),
    (["compat", "--record", "tf5.24.0"], "--record ENV needs the test command after --"),
])
def test_usage_errors_exit_2_with_one_line_before_any_process(argv, expected, no_spawn, capsys):
    assert expected in _usage_error(argv, capsys)


def _catalog(*names: str) -> list[CatalogEntry]:
    return [CatalogEntry(name.lower().split("for")[0], name, None) for name in names]


def test_an_unknown_model_class_names_it_and_how_to_list_them(monkeypatch, no_spawn, capsys):
    monkeypatch.setattr(sweep, "flash_causal_lm_classes", lambda: _catalog("LlamaForCausalLM", "Qwen2ForCausalLM"))
    monkeypatch.setattr(sweep, "flash_head_classes", lambda: [])
    line = _usage_error(["models", "--classes", "LlamaForCausalLM,LlamaForCausalLm"], capsys)
    assert "'LlamaForCausalLm' is not a class with a flash-attention path" in line
    assert "did you mean LlamaForCausalLM" in line
    assert line.endswith("Fix: 'hfpatch models --list' prints the class names.")


def test_models_list_prints_the_catalog(monkeypatch, no_spawn, capsys):
    monkeypatch.setattr(sweep, "flash_causal_lm_classes", lambda: _catalog("LlamaForCausalLM", "Qwen2ForCausalLM"))
    heads = [CatalogEntry("llama", "LlamaForSequenceClassification", "LlamaConfig", head="sequence-classification")]
    monkeypatch.setattr(sweep, "flash_head_classes", lambda: heads)
    assert main(["models", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:3]] == ["LlamaForCausalLM", "Qwen2ForCausalLM",
                                                       "LlamaForSequenceClassification"]
    assert lines[2].endswith("[sequence-classification]") and lines[-1] == "3 classes"


def test_requested_classes_keeps_the_known_names():
    catalog = _catalog("LlamaForCausalLM", "Qwen2ForCausalLM")
    assert requested_classes(" Qwen2ForCausalLM, LlamaForCausalLM ", catalog) == ["Qwen2ForCausalLM",
                                                                                     "LlamaForCausalLM"]


# ------------------------------------------------------------------------------------------------- demo


@pytest.mark.parametrize("variant, world, packed, units", [
    ("auto", 2, False, (4, "zigzag", 1)),
    ("zigzag", 4, False, (8, "zigzag", 1)),
    ("stripe", 3, False, (3, "stripe", 1)),
    ("ring", 2, False, (2, "contiguous", 1)),
    ("auto", 2, True, (2, "contiguous", 1)),      # packed: llama3 over the packed stream
    ("zigzag", 2, True, (4, "zigzag", 4)),        # packed zigzag: every document in 2N chunks
    ("auto", 1, False, (1, "zigzag", 1)),         # a world of one holds the whole row
])
def test_sequence_units_follow_the_step_layout(variant, world, packed, units):
    assert sequence_units(variant, world, packed=packed) == units


def test_demo_model_families_are_the_tiny_models():
    assert MODEL_FAMILIES == MODEL_NAMES


def test_demo_with_one_process_says_cp_did_not_run():
    proc = subprocess.run([sys.executable, "-m", "hfpatch", "demo", "--world-size", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "1 CPU process (gloo)" in proc.stdout
    assert "WARNING: CP did not run" in proc.stdout and "Fix: --world-size 2 or more." in proc.stdout
    assert "OK: CP matches non-CP" not in proc.stdout
