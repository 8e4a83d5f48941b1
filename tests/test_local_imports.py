"""The package's own modules are imported at module level: a function-local import of ``hfpatch`` or
``ring_kernels`` is allowed only where an import cycle needs it, and the line says so in a comment."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("hfpatch", "ring_kernels")


def _first_party(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] in FIRST_PARTY
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] in FIRST_PARTY for alias in node.names)
    return False


def _local_imports(path: Path):
    """(line number, line) of every first-party import statement below the module's top level."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    lines = path.read_text().splitlines()
    for node in ast.walk(tree):
        if _first_party(node) and id(node) not in top and not _module_level_guard(tree, node):
            yield node.lineno, lines[node.lineno - 1]


def _module_level_guard(tree: ast.Module, node: ast.AST) -> bool:
    """True for an import inside a module-level ``try``/``if`` (still imported when the module is)."""
    for stmt in tree.body:
        if isinstance(stmt, (ast.Try, ast.If)) and any(child is node for child in ast.walk(stmt)):
            return not any(isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                           and any(c is node for c in ast.walk(inner)) for inner in ast.walk(stmt))
    return False


def test_function_local_imports_of_the_package_name_their_cycle():
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for package in FIRST_PARTY for path in sorted((ROOT / package).rglob("*.py"))
                 for number, line in _local_imports(path) if "#" not in line]
    assert not offenders, ("function-local imports of the package without a stated reason (move them to the top of "
                           "the module, or say which import cycle needs them in a comment):\n" + "\n".join(offenders))


def test_the_check_sees_a_local_import(tmp_path):
    sample = tmp_path / "sample.py"
    package = FIRST_PARTY[1]  # the sample is only parsed, never imported
    sample.write_text(f"import os\n\ndef f():\n    from {package} import layout\n    return layout\n")
    assert [number for number, _ in _local_imports(sample)] == [4]
