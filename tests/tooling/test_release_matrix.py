"""The release matrix itself: tox.ini covers every signature generation of the registry plus the newest release,
torch is shared into each env (never installed there), and CI runs the matrix and the COMPAT.md check."""
from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import types
from importlib import metadata

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from _paths import ROOT
from hfpatch.model.routing import FLASH_IMPLEMENTATION, route_model
from hfpatch.signatures.registry import load_registry


def _tox() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return parser


def _env_releases() -> dict[str, str]:
    """env name -> the transformers release it pins (``transformers==X`` in its deps)."""
    tox = _tox()
    envs = [e.strip() for e in tox["tox"]["env_list"].split(",")]
    pins = {}
    for env in envs:
        deps = [line.strip() for line in tox[f"testenv:{env}"]["deps"].splitlines() if line.strip()]
        (pin,) = [d for d in deps if d.startswith("transformers==")]
        pins[env] = pin.split("==", 1)[1]
    return pins


def newest_pin(pins: dict[str, str]) -> str:
    return max(pins.values(), key=Version)


def test_every_registry_generation_has_an_env_and_so_has_the_newest_release():
    pins = _env_releases()
    assert all(env == f"tf{release}" for env, release in pins.items())
    covered = {entry.id: [r for r in pins.values() if entry.covers(r)] for entry in load_registry()}
    # Every generation is run. A generation has a second env only for the newest release (S7: 5.19.0 and
    # 5.24.0) or for a second range of releases (S5: 4.53, then 5.0-5.18 after the `implementation` rename
    # was reverted; its specifier excludes 4.54-4.57).
    for gid, releases in covered.items():
        assert releases, f"no tox env runs a release of generation {gid}"
        if len(releases) > 1:
            entry = next(e for e in load_registry() if e.id == gid)
            assert len(releases) == 2 and ("!=" in str(entry.releases) or max(releases, key=Version) == newest_pin(pins)), (gid, releases)
    static = json.loads((ROOT / "compat" / "static.json").read_text())
    newest = max((Version(v) for v in static["available_releases"] if not Version(v).is_prerelease))
    assert str(newest) in pins.values(), f"the newest release {newest} is not in tox.ini"
    # Every env release is one a generation covers (no env tests a release the registry does not know).
    assert all(any(e.covers(r) for e in load_registry()) for r in pins.values())


def test_tox_shares_torch_and_records_results():
    testenv = _tox()["testenv"]
    assert ".ci/share_torch.py" in testenv["install_command"]
    assert "torch" not in testenv["deps"].replace("share_torch", "")  # never installed per env
    assert "hfpatch compat --record {env_name}" in testenv["commands"]
    assert "python -m pytest -q -p no:cacheprovider -m release_dependent" in testenv["commands"]


def test_ci_runs_the_readme_command_then_the_compat_check_then_the_matrix():
    """.ci/run installs the CPU torch, runs the README's test command (scripts/setup_and_test.sh runs .ci/run up to
    that step; the command itself is scripts/run_tests.sh) recorded as the newest release's matrix entry, the offline
    COMPAT.md check, then the release matrix (records written to .tox/results, the README run's env skipped) and the
    check of its fresh records, printing each step's time."""
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert "python -m pip install -q torch==2.15.0 --no-compile" in lines
    assert "bash scripts/setup_and_test.sh" in (ROOT / "README.md").read_text()
    assert "python -m pytest -q" in (ROOT / "scripts" / "run_tests.sh").read_text()
    raw = ci.splitlines()
    step = next(i for i, line in enumerate(raw) if line.startswith("# The README's test command"))
    readme = raw[step + 1].strip()   # the line scripts/setup_and_test.sh ends with
    assert readme == 'hfpatch compat --record "tf$newest" --results-dir .tox/results -- bash scripts/run_tests.sh'
    matrix = next(i for i, line in enumerate(lines) if "tox run-parallel" in line)
    assert "HFPATCH_RESULTS_DIR=$PWD/.tox/results" in lines[matrix]
    assert '--skip-env "^tf${newest//./\\\\.}\\$"' in lines[matrix + 1]
    order = [lines.index(readme), lines.index("hfpatch compat --check"), matrix,
             lines.index("hfpatch compat --check --fresh-results .tox/results")]
    assert order == sorted(order)
    assert "set -euo pipefail" in lines      # a failing env fails CI
    assert [line.split()[1] for line in lines if line.startswith("begin_step ")] == [
        "readme-suite", "background-setups", "py313-tests", "py313-models", "torch-oldest-tests", "compat-check",
        "tox-install", "matrix-torch-setups", "matrix", "matrix-check"]
    assert "trap " in ci and "ci-step total" in ci   # the last step's time and the total, also when a step fails


def test_share_torch_links_torch_behind_the_envs_own_packages(tmp_path):
    """A bare venv gets this interpreter's torch through the .pth file, and nothing that is not torch's."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    env_python = env / "bin" / "python"
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import share_torch
    finally:
        sys.path.pop(0)
    script = (
        "import sys, sysconfig; sys.path.insert(0, %r); import share_torch; from pathlib import Path; "
        "share_torch.link_shared_torch(Path(%r), %r)" % (str(ROOT / ".ci"), str(env), sys.executable)
    )
    subprocess.run([str(env_python), "-c", script], check=True)
    probe = (
        "import importlib.util as u, json, sys, torch; "
        "print(json.dumps({'torch': torch.__file__, 'version': torch.__version__, "
        "'transformers': u.find_spec('transformers') is not None, 'path': sys.path}))"
    )
    out = json.loads(subprocess.run([str(env_python), "-c", probe], check=True, capture_output=True, text=True,
                                    env={**os.environ, "PYTHONPATH": ""}).stdout)
    import torch

    assert out["version"] == torch.__version__
    assert out["torch"].startswith(str(env / "shared-torch"))
    assert out["transformers"] is False  # the parent's transformers is never shared
    site = next(p for p in out["path"] if p.endswith("site-packages") and p.startswith(str(env)))
    assert out["path"].index(site) < out["path"].index(str(env / "shared-torch"))  # the env's own packages win
    # Idempotent: a second run (tox calls it before every install) changes nothing.
    before = sorted(p.name for p in (env / "shared-torch").iterdir())
    subprocess.run([str(env_python), "-c", script], check=True)
    assert sorted(p.name for p in (env / "shared-torch").iterdir()) == before
    assert share_torch._PTH_NAME in os.listdir(site)


def test_share_torch_shares_the_extras_torch_asks_for(tmp_path):
    """torch 2.11 and newer ask for ``cuda-toolkit[cublas,cudart,...]``: the NVIDIA libraries are that package's
    extras. They are shared too; an env that did not see them would install them itself (1.2 GB per env)."""
    asked = [Requirement(line) for line in metadata.requires("torch") or []]
    toolkit = next((req for req in asked if req.name == "cuda-toolkit"), None)
    if toolkit is None:
        pytest.skip("this torch asks for no cuda-toolkit extras (a CPU build)")
    expected = {Requirement(line).name.lower() for line in metadata.requires("cuda-toolkit") or []
                if any(Requirement(line).marker and Requirement(line).marker.evaluate({"extra": extra})
                       for extra in toolkit.extras)}
    assert expected   # the extras name libraries
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    script = (
        "import sys; sys.path.insert(0, %r); import share_torch; from pathlib import Path; "
        "share_torch.link_shared_torch(Path(%r), %r)" % (str(ROOT / ".ci"), str(env), sys.executable)
    )
    subprocess.run([str(env / "bin" / "python"), "-c", script], check=True)
    probe = "import json; from importlib import metadata; print(json.dumps([d.metadata['Name'] for d in " \
            "metadata.distributions()]))"
    seen = json.loads(subprocess.run([str(env / "bin" / "python"), "-c", probe], check=True, capture_output=True,
                                     text=True, env={**os.environ, "PYTHONPATH": ""}).stdout)
    assert expected <= {name.lower() for name in seen}


def test_share_torch_without_torch_says_how_to_fix(tmp_path):
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    proc = subprocess.run(
        [str(env / "bin" / "python"), str(ROOT / ".ci" / "share_torch.py"), str(env), "--", "nothing"],
        capture_output=True, text=True, env={**os.environ, "HFPATCH_TORCH_PYTHON": str(env / "bin" / "python")},
    )
    assert proc.returncode != 0
    assert "has no torch installed" in proc.stderr or "HFPATCH_TORCH_PYTHON" in proc.stderr


def test_model_routing_also_switches_module_copies_of_attn_implementation():
    """4.43-4.47 (found by the tf4.43.4 env): MistralModel, Qwen2Model, MixtralModel, Phi3Model, ... copy
    ``config._attn_implementation`` into ``self._attn_implementation`` at construction, and their mask builder
    reads the copy; switching only the config left them building the eager 4-D mask, which the ring (rightly)
    refused as a padding mask. The switch sets the copies too, and restore() puts back exactly what was there."""
    class Config:
        _attn_implementation_internal = "eager"

        def to_dict(self):
            return {}

    class Inner(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self._attn_implementation = config._attn_implementation_internal  # the 4.43 copy
            self.proj = torch.nn.Linear(4, 4)

    class TinyModel(torch.nn.Module):
        _supports_flash_attn_2 = True

        def __init__(self):
            super().__init__()
            self.config = Config()
            self.model = Inner(self.config)
            self.other = torch.nn.Linear(2, 2)   # no copy: must not gain the attribute

    model = TinyModel()
    record = route_model(model, lambda *a, **k: None, transformers_version=Version("4.48.0"))
    assert model.model._attn_implementation == FLASH_IMPLEMENTATION
    assert "_attn_implementation" not in model.other.__dict__
    record.remove()
    assert model.model.__dict__["_attn_implementation"] == "eager"
    assert "_attn_implementation" not in model.other.__dict__


def test_model_routing_handles_4_47_gemma2_per_call_dispatch(monkeypatch):
    """4.47.1 (found by the tf4.47.1 env): Gemma2 has no attention class table; it dispatches per call from
    ``config._attn_implementation`` through a module-level dict whose flash entry is a module-level function
    calling ``_flash_attention_forward`` -- imported only when flash-attn is installed. The switch accepts the
    model, switches its config, and binds the wrapper for that function (removed again by restore)."""
    modeling = types.ModuleType("hfpatch_test_modeling_gemma2_447")
    exec(
        "def flash_attention_forward(q):\n    return _flash_attention_forward(q)\n"
        "ATTENTION_FUNCTION = {'flash_attention_2': flash_attention_forward}\n",
        modeling.__dict__,
    )
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)

    class Config:
        _attn_implementation_internal = "eager"

        def to_dict(self):
            return {}

    class Gemma2Like(torch.nn.Module):
        _supports_flash_attn_2 = True

        def __init__(self):
            super().__init__()
            self.config = Config()

    Gemma2Like.__module__ = modeling.__name__
    model = Gemma2Like()

    def wrapper(q):
        return ("ring", q)

    record = route_model(model, wrapper, transformers_version=Version("4.47.1"))
    assert model.config._attn_implementation_internal == FLASH_IMPLEMENTATION
    assert modeling.flash_attention_forward(1) == ("ring", 1)
    record.remove()
    assert model.config._attn_implementation_internal == "eager"
    assert "_flash_attention_forward" not in modeling.__dict__
