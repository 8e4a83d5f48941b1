"""The README's two fresh-clone commands, run against stand-ins for python, pip and hfpatch (nothing is installed):
``scripts/setup_and_test.sh`` and ``scripts/setup_and_demo.sh`` run .ci/run's setup steps, announce each phase
with a line as it starts (``setup 3/5 (12s): python -m pip install ...``), print none of CI's bookkeeping (its
``ci-step`` timer lines, its matrix record), and end with the test command (``scripts/run_tests.sh``, which lists
skip reasons) or the demo, passing their arguments on.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from _paths import ROOT

# Every command the setup steps run, replaced by one that prints what it was asked; `python3 -m venv DIR` also
# makes DIR/bin/activate, which the steps source.
_STAND_IN = """#!/usr/bin/env bash
echo "ran: $(basename "$0") $*"
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && : > "$3/bin/activate"; fi
if [ "$1" = "-c" ]; then echo 5.0.0; fi
"""


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of what the scripts read (.ci/run, scripts/), with python, python3 and hfpatch stand-ins on PATH."""
    if shutil.which("bash") is None:
        pytest.skip("bash not installed")
    copy = tmp_path / "tree"
    (copy / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", copy / ".ci" / "run")
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3", "hfpatch"):
        path = bin_dir / name
        path.write_text(_STAND_IN)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return copy


def _run(tree: Path, script: str, *args: str) -> str:
    env = dict(os.environ, PATH=f"{tree.parent / 'bin'}{os.pathsep}{os.environ['PATH']}")
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["bash", f"scripts/{script}", *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _check_setup_phases(out: str) -> None:
    phases = re.findall(r"^setup (\d+)/(\d+) \(\d+s\): (.*)$", out, re.M)
    assert phases and [int(n) for n, _, _ in phases] == list(range(1, len(phases) + 1)), out
    assert {total for _, total, _ in phases} == {str(len(phases))}, out
    assert phases[0][2] == "python3 -m venv .venv" and "torch==" in out, out
    assert all(command.startswith(("python3 -m venv", "python -m pip install")) for _, _, command in phases), out
    ran = re.findall(r"^ran: (.*)$", out, re.M)   # each announced command, then the one it announced
    assert [command.replace("'", "") for _, _, command in phases] == ran[:len(phases)], out
    assert "ci-step" not in out and "compat --record" not in out, out


def test_setup_and_test_announces_each_phase_then_runs_the_test_command(tree):
    out = _run(tree, "setup_and_test.sh", "-k", "docs")
    _check_setup_phases(out)
    assert re.search(r"^setup done \(\d+s\); the test suite: bash scripts/run_tests.sh -k docs$", out, re.M), out
    ran = "ran: python -m pytest -q -rfEs -n 2 --dist loadscope --durations=25 -k docs"
    assert out.rstrip().splitlines()[-1] == ran, out


def test_setup_and_demo_announces_each_phase_then_runs_the_demo(tree):
    out = _run(tree, "setup_and_demo.sh", "--world-size", "4")
    _check_setup_phases(out)
    assert out.rstrip().splitlines()[-1] == "ran: hfpatch demo --world-size 4", out


def test_setup_and_test_refuses_a_ci_step_that_no_longer_runs_the_test_command(tree):
    run = tree / ".ci" / "run"
    run.write_text(run.read_text().replace("-- bash scripts/run_tests.sh", "-- python -m pytest"))
    env = dict(os.environ, PATH=f"{tree.parent / 'bin'}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "scripts/setup_and_test.sh"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "does not run scripts/run_tests.sh" in done.stderr, done.stdout + done.stderr
    assert "ran:" not in done.stdout, done.stdout
