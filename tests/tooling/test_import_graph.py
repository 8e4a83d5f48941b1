"""The import graph keeps its rules (scripts/import_graph.py reads the source with ``ast``; nothing is imported):
no import cycle, no function-local import of a project module unless it names the dependency it defers, no use of
another module's ``_private`` names, at most 8 modules at the package's root, and docs/architecture.md's generated
graph current. Then the checker itself, on small trees written here."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _paths import ROOT

DOC = ROOT / "docs" / "architecture.md"


def _load_script():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses read their module's namespace
    spec.loader.exec_module(module)
    return module


graph_tool = _load_script()
PACKAGE, KERNELS = graph_tool.PACKAGES   # the sample trees below are only parsed, never imported


@pytest.fixture(scope="module")
def graph():
    return graph_tool.Graph.build(ROOT)


def _listed(found) -> str:
    return "\n".join(map(str, found))


def test_no_import_cycles(graph):
    found = graph_tool.cycles(graph)
    assert not found, f"modules that import each other (break the cycle; a deferred import still counts):\n" \
                      f"{_listed(found)}"


def test_project_modules_are_imported_at_module_level(graph):
    found = graph_tool.local_imports(graph)
    assert not found, ("imports of project modules inside functions (move them to the top of the module; only one "
                       "that defers a dependency its module does not load may stay, with `# deferred (name): why`):"
                       f"\n{_listed(found)}")


def test_no_module_uses_another_modules_private_names(graph):
    found = graph_tool.private_names(graph)
    assert not found, ("private names used outside their module (make the name public if several modules need it, "
                       f"or test through the public one):\n{_listed(found)}")


def test_the_package_root_holds_at_most_eight_modules():
    found = graph_tool.root_modules(ROOT)
    assert len(found) <= graph_tool.ROOT_LIMIT, f"{len(found)} modules at the package's root: {found}"


def test_the_architecture_doc_shows_the_current_graph(graph):
    assert graph_tool.doc_is_current(graph, DOC), (
        "docs/architecture.md's import graph is stale: run python scripts/import_graph.py --write-doc "
        "docs/architecture.md and commit the result")


# ------------------------------------------------------------------------------------------- the checker itself


def _tree(tmp_path: Path, files: dict) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _found(tmp_path: Path, files: dict) -> list[str]:
    return [str(f) for f in graph_tool.findings(graph_tool.Graph.build(_tree(tmp_path, files)))]


_BASE = {f"{KERNELS}/__init__.py": "", f"{KERNELS}/heavy.py": "import numpy\n\n\ndef run():\n    return 1\n",
         f"{PACKAGE}/__init__.py": "", "tests/conftest.py": ""}


def test_a_clean_tree_has_no_findings(tmp_path):
    assert _found(tmp_path, {**_BASE, f"{KERNELS}/light.py": f"from {KERNELS} import heavy\n"}) == []


def test_a_cycle_is_found_through_a_deferred_import_too(tmp_path):
    files = {**_BASE, f"{KERNELS}/a.py": f"from {KERNELS} import b\n",
             f"{KERNELS}/b.py": f"def f():\n    from {KERNELS} import a\n    return a\n"}
    found = _found(tmp_path, files)
    assert f"{KERNELS}/a.py:1: cycle: {KERNELS}.a <-> {KERNELS}.b" in found
    assert any(f.startswith(f"{KERNELS}/b.py:2: local import: {KERNELS}.a imported inside a function") for f in found)


def test_a_type_checking_import_is_no_edge(tmp_path):
    files = {**_BASE, f"{KERNELS}/a.py": f"from {KERNELS} import b\n",
             f"{KERNELS}/b.py": f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {KERNELS} import a\n"}
    assert _found(tmp_path, files) == []


@pytest.mark.parametrize("comment, problem", [
    ("# deferred (numpy): only run() needs it", None),
    ("# deferred (numpy)", "gives no reason"),
    ("# deferred (scipy): only run() needs it", f"{KERNELS}.heavy does not load scipy"),
    ("# not at the top: numpy", "imported inside a function"),
])
def test_a_deferred_import_names_what_it_defers(tmp_path, comment, problem):
    files = {**_BASE, f"{KERNELS}/light.py": f"def f():\n    from {KERNELS} import heavy  {comment}\n    return heavy\n"}
    found = _found(tmp_path, files)
    assert (found == []) if problem is None else (len(found) == 1 and problem in found[0]), found


def test_a_deferred_import_defers_nothing_its_module_loads_itself(tmp_path):
    files = {**_BASE, f"{KERNELS}/light.py": ("import numpy\n\n\ndef f():\n    # deferred (numpy): only f needs it\n"
                                              f"    from {KERNELS} import heavy\n    return heavy\n")}
    assert _found(tmp_path, files) == [f"{KERNELS}/light.py:6: local import: {KERNELS}.heavy deferred, but the "
                                       f"comment {KERNELS}.light loads numpy itself"]


def test_a_parent_package_counts_as_loaded(tmp_path):
    """``from pkg.sub import x`` runs pkg/__init__.py first: what it loads, the importer loads."""
    files = {**_BASE, f"{KERNELS}/__init__.py": "import numpy\n",
             f"{KERNELS}/light.py": f"def f():\n    from {KERNELS} import heavy  # deferred (numpy): f only\n"}
    assert "loads numpy itself" in _found(tmp_path, files)[0]


def test_private_names_are_found_in_every_form(tmp_path):
    files = {**_BASE, f"{KERNELS}/a.py": "_SECRET = 1\n\n\ndef _helper():\n    return _SECRET\n",
             f"{KERNELS}/b.py": (f"import {KERNELS}.a\nfrom {KERNELS} import a as alias\nfrom {KERNELS}.a import _helper\n"
                                 f"x = {KERNELS}.a._SECRET\ny = getattr(alias, '_SECRET')\n"
                                 f"z = setattr('{KERNELS}.a._helper', None)\nw = alias.__name__\n")}
    found = _found(tmp_path, files)
    assert found == [f"{KERNELS}/b.py:3: private name: imports {KERNELS}.a._helper",
                     f"{KERNELS}/b.py:4: private name: uses {KERNELS}.a._SECRET",
                     f"{KERNELS}/b.py:5: private name: uses {KERNELS}.a._SECRET",
                     f"{KERNELS}/b.py:6: private name: uses {KERNELS}.a._helper"], found


def test_a_private_module_belongs_to_its_folder(tmp_path):
    files = {**_BASE, f"{KERNELS}/sub/__init__.py": "", f"{KERNELS}/sub/_inner.py": "VALUE = 1\n",
             f"{KERNELS}/sub/user.py": f"from {KERNELS}.sub._inner import VALUE\n",
             f"{KERNELS}/sub/deeper/__init__.py": f"from {KERNELS}.sub import _inner\n",
             f"{KERNELS}/outside.py": f"from {KERNELS}.sub._inner import VALUE\n",
             "tests/_helper.py": "VALUE = 1\n", "tests/test_x.py": "import _helper\nfrom _helper import VALUE\n"}
    assert _found(tmp_path, files) == [f"{KERNELS}/outside.py:1: private name: imports {KERNELS}.sub._inner, "
                                       f"private to {KERNELS}.sub"]


def test_the_root_count(tmp_path):
    files = {**_BASE, **{f"{PACKAGE}/m{i}.py": "" for i in range(graph_tool.ROOT_LIMIT)}}
    found = _found(tmp_path, files)
    assert len(found) == 1 and found[0].startswith(f"{PACKAGE}/:0: root: {graph_tool.ROOT_LIMIT + 1} modules"), found


def test_the_command_line_and_the_doc_block(tmp_path):
    root = _tree(tmp_path, {**_BASE, f"{KERNELS}/a.py": "from numpy import x\n",
                            f"{PACKAGE}/api.py": f"from {KERNELS} import a\n",
                            "doc.md": f"# Doc\n\n{graph_tool.DOC_BEGIN}\n{graph_tool.DOC_END}\n\nafter\n"})
    script = [sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--root", str(root)]
    run = lambda *args: subprocess.run([*script, *args], capture_output=True, text=True, cwd=root)  # noqa: E731
    assert run("--check").returncode == 0
    assert run("--check-doc", "doc.md").returncode == 1
    assert run("--write-doc", "doc.md").returncode == 0
    text = (root / "doc.md").read_text()
    assert re.search(rf"^{PACKAGE}\.api +-> {KERNELS}$", text, re.M), text
    assert text.endswith(f"{graph_tool.DOC_END}\n\nafter\n"), text
    assert run("--check-doc", "doc.md").returncode == 0
    (root / KERNELS / "b.py").write_text(f"def f():\n    from {KERNELS} import a\n")
    done = run("--check")
    assert done.returncode == 1 and f"{KERNELS}/b.py:2: local import" in done.stdout, done.stdout
