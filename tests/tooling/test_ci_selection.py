"""CI's test selection (tests/_release.py, docs/ci.md): the older tox envs run only ``-m release_dependent``.

Two things make that safe: a module left out of the older envs cannot see transformers (checked statically here,
through the local modules it imports), and a registry entry that no longer fits its release fails the selected
subset under that release (shown here on a copy of the tree whose entry for the installed release is broken).
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _paths import BENCHMARKS, ROOT, TEST_FOLDERS, TESTS
from _release import MARKER, RELEASE_INDEPENDENT, TORCH_MARKER, TORCH_OPS
from _tox import matrix_torch_venvs, read_tox
from hfpatch.signatures.registry import entry_for_version
from hfpatch.version_gates import installed_transformers_version

# Where a test module's plain `import x` can find a local module: tests/ and its folders (tests/conftest.py puts
# them on sys.path) and benchmarks/ (tests put it there).
_LOCAL_DIRS = (*TEST_FOLDERS, BENCHMARKS)
_FORBIDDEN = ("hfpatch", "transformers")
_IMPORT_IN_STRING = re.compile(r"(?:^|[\s;])(?:import|from)\s+([A-Za-z_][\w.]*)")
_IMPORT_CALLS = {"import_module", "__import__", "find_spec", "importorskip"}
# Left out of the broken copy of the tree (the copy imports from PYTHONPATH): caches, builds and environments -- the
# CI venv, the torch venvs of scripts/torch_release.sh (3-7 GB each), the tox envs, and the Python 3.13 root of
# scripts/python313.sh (5 GB), all built in the background while the README suite runs.
_NOT_COPIED = (".git", ".venv", ".venv-*", ".tox", ".py313", "__pycache__", "*.pyc", "*.egg-info", "build", "dist",
               ".whl", ".gpu-wheels", ".cache", ".pytest_cache")


def _imported_names(path: Path) -> set[str]:
    """Every module name ``path`` may import: import statements at any depth, `import x` inside string constants
    (code run by `python -c`), import_module / find_spec calls, and "hfpatch..." / "transformers..." dotted
    strings (``python -m hfpatch``, sys.modules keys)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in _IMPORT_CALLS and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(_IMPORT_IN_STRING.findall(node.value))
            if node.value == "hfpatch" or node.value.startswith(("hfpatch.", "transformers.")):
                names.add(node.value)
    return names


def _local_files(name: str) -> list[Path]:
    top = name.split(".")[0]
    if top == "ring_kernels":
        return sorted((ROOT / "ring_kernels").rglob("*.py"))
    return [d / f"{top}.py" for d in _LOCAL_DIRS if (d / f"{top}.py").is_file()]


def reaches_transformers(path: Path) -> list[str] | None:
    """The import chain from ``path`` to hfpatch or transformers (file names, then the module), or None."""
    todo, seen = [(path, [path.name])], {path}
    while todo:
        current, chain = todo.pop()
        for name in sorted(_imported_names(current)):
            if name.split(".")[0] in _FORBIDDEN:
                return chain + [name]
            for local in _local_files(name):
                if local not in seen:
                    seen.add(local)
                    shown = local.relative_to(ROOT) if local.is_relative_to(ROOT) else local.name
                    todo.append((local, chain + [str(shown)]))
    return None


@pytest.mark.parametrize("module", sorted(RELEASE_INDEPENDENT))
def test_a_release_independent_module_cannot_reach_transformers(module):
    path = TESTS / module
    assert path.is_file(), f"tests/_release.py lists {module}, which does not exist: remove or rename the entry"
    chain = reaches_transformers(path)
    assert chain is None, (f"{module} is listed in tests/_release.py as release-independent, but imports "
                           f"{' -> '.join(chain)}: remove it from RELEASE_INDEPENDENT (then every tox env runs it)")


def test_the_guard_sees_imports_in_functions_strings_and_helpers(tmp_path, monkeypatch):
    """The static check itself: an import inside a function, code passed to `python -c`, `-m hfpatch`, and an
    import made by a local helper module are all found."""
    monkeypatch.setattr(sys.modules[__name__], "_LOCAL_DIRS", (tmp_path,))
    (tmp_path / "helper.py").write_text("def f():\n    from transformers import AutoModel\n")
    cases = {
        "in_function.py": "def test():\n    import hfpatch.attention.patcher\n",
        "in_string.py": "CODE = 'import os; import transformers'\n",
        "as_module.py": "ARGS = ['-m', 'hfpatch', 'check']\n",
        "by_call.py": "import importlib\nimportlib.import_module('transformers.modeling_utils')\n",
        "via_helper.py": "import helper\n",
    }
    for name, source in cases.items():
        (tmp_path / name).write_text(source)
        assert reaches_transformers(tmp_path / name), name
    assert reaches_transformers(tmp_path / "via_helper.py") == ["via_helper.py", "helper.py", "transformers"]
    (tmp_path / "clean.py").write_text("import torch\nimport ring_kernels\nVERSION_OF = 'transformers'\n")
    assert reaches_transformers(tmp_path / "clean.py") is None


def test_every_other_module_is_marked_release_dependent(request):
    items = request.session.items
    for item in items:
        module = os.path.relpath(str(item.path), TESTS).replace(os.sep, "/")
        marked = item.get_closest_marker(MARKER) is not None
        assert marked == (module not in RELEASE_INDEPENDENT), item.nodeid
        assert (item.get_closest_marker(TORCH_MARKER) is not None) == (module in TORCH_OPS), item.nodeid


def test_the_torch_ops_modules_are_release_independent_and_run_by_the_middle_envs():
    """A module whose subject is torch is one the older envs leave out (else `-m torch_ops` would run it twice), and
    every env whose torch is neither end of the range runs `-m torch_ops` (tox.ini)."""
    assert TORCH_OPS and set(TORCH_OPS) <= set(RELEASE_INDEPENDENT), sorted(set(TORCH_OPS) - set(RELEASE_INDEPENDENT))
    tox = read_tox()
    assert f"-m {TORCH_MARKER}" in tox["testenv"]["torch_ops"]
    for env, venv in matrix_torch_venvs().items():
        middle = re.fullmatch(r"\.venv-torch-\d+\.\d+\.\d+", venv) is not None
        runs = "{[testenv]torch_ops}" in tox[f"testenv:{env}"].get("commands", "")
        assert runs == middle, (env, venv, "runs -m torch_ops" if runs else "does not run -m torch_ops")


def broken_copy(tmp_path: Path) -> tuple[Path, str, str]:
    """A copy of the tree whose registry entry for the installed release has its first parameter renamed (a
    release-specific break: no other release's entry changes). Returns (root of the copy, entry id, new name)."""
    entry = entry_for_version(installed_transformers_version())
    assert entry is not None, "the installed transformers release has no registry entry"
    copy = tmp_path / "tree"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    # The source tree is a few MB; an environment that _NOT_COPIED misses (GBs, in every env of the matrix) is not.
    size = sum(f.stat().st_size for f in copy.rglob("*") if f.is_file() and not f.is_symlink())
    assert size < 100 * 2**20, (f"the copy of the tree holds {size / 2**20:.0f} MB: an environment or cache is not "
                                f"left out ({sorted(p.name for p in copy.iterdir())}); add it to _NOT_COPIED")
    target = copy / "hfpatch" / "signatures" / f"{entry.id}.json"
    text = target.read_text(encoding="utf-8")
    first = entry.params[0].name
    broken = text.replace(f'"name": "{first}"', f'"name": "{first}_renamed"', 1)
    assert broken != text, f"could not find parameter {first!r} in {target}"
    target.write_text(broken, encoding="utf-8")
    return copy, entry.id, f"{first}_renamed"


# Fast, in-process modules that read the registry (the whole subset is shown to fail by .ci/prove_selection.py), by
# path relative to tests/.
_REGISTRY_READERS = ("attention/test_registry.py", "attention/test_codegen.py", "attention/test_patcher.py",
                     "attention/test_switch.py", "attention/test_fallback.py")


def test_a_broken_registry_entry_fails_the_release_dependent_subset(tmp_path):
    """CI's proof that the selection catches a release-specific break: under the installed release, the tests that
    `-m release_dependent` selects from the registry's readers fail on a tree whose entry for this release no
    longer fits it, the registry's check of the installed release among them (the copy shadows the editable
    install through PYTHONPATH). Were those modules not selected, nothing would run and the exit status would be 5."""
    copy, entry_id, _ = broken_copy(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    probe = subprocess.run([sys.executable, "-c", "import hfpatch; print(hfpatch.__file__)"], env=env, cwd=copy,
                           capture_output=True, text=True, check=True)
    assert Path(probe.stdout.strip()).is_relative_to(copy), probe.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", MARKER,
         *[f"tests/{m}" for m in _REGISTRY_READERS]],
        env=env, cwd=copy, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"the release-dependent subset did not fail with {entry_id} broken:\n{out[-4000:]}"
    # The registry's own check of the installed release is among the failures (the break, not something else).
    assert re.search(r"^FAILED tests/attention/test_registry.py::"
                     r"test_installed_transformers_matches_its_recorded_entry_exactly",
                     out, re.M), out[-4000:]
