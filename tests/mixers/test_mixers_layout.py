"""The mixers wing's layout (hfpatch/mixers/__init__.py): each layer imports only the layers below it, read from
the source; ``kinds/`` holds one ``SequenceKernel`` per module, every one of them in ``kinds.KERNELS``."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from _paths import ROOT
from hfpatch.mixers.kernel import SequenceKernel
from hfpatch.mixers.kinds import KERNELS

MIXERS = ROOT / "hfpatch" / "mixers"
CORE = {"segments", "kernel", "family"}

# layer -> the layers its modules may import: a folder's modules import each other only where the folder lists
# itself; the package (``__init__``) is imported by no module inside it
ALLOWED = {
    "segments": set(),
    "kernel": {"segments"},
    "family": set(),
    "kinds": CORE,
    "kinds/__init__": CORE | {"kinds"},
    "forms": CORE | {"kinds"},
    "families": {"family", "forms", "families"},
    "registry": {"family", "families"},
    "install": CORE | {"kinds", "registry"},
    "__init__": {"install", "registry"},
}


def _layer(path: Path) -> str:
    parts = path.relative_to(MIXERS).with_suffix("").parts
    if len(parts) == 1:
        return parts[0]
    return "kinds/__init__" if parts == ("kinds", "__init__") else parts[0]


def _imported_layers(path: Path) -> dict:
    """layer -> line of the first import of a module of hfpatch.mixers in that layer (the package itself is
    ``__init__``), at any depth of the module."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name == "hfpatch.mixers":
                found.setdefault("__init__", node.lineno)
            elif name.startswith("hfpatch.mixers."):
                first = name.split(".")[2]
                if (MIXERS / first).is_dir() or (MIXERS / f"{first}.py").exists():
                    found.setdefault(first, node.lineno)
    return found


MODULES = sorted(MIXERS.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(MIXERS)) for p in MODULES])
def test_a_layer_imports_only_the_layers_below_it(path):
    layer = _layer(path)
    wrong = {other: line for other, line in _imported_layers(path).items() if other not in ALLOWED[layer]}
    assert not wrong, (f"hfpatch/mixers/{path.relative_to(MIXERS)} ({layer}) imports {sorted(wrong)} at lines "
                       f"{sorted(wrong.values())}; it may import only {sorted(ALLOWED[layer]) or 'no other layer'}")


KIND_MODULES = sorted(p for p in (MIXERS / "kinds").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", KIND_MODULES, ids=[p.stem for p in KIND_MODULES])
def test_a_kind_module_holds_one_sequence_kernel_and_kernels_lists_it(path):
    module = importlib.import_module(f"hfpatch.mixers.kinds.{path.stem}")
    kinds = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
             if issubclass(cls, SequenceKernel) and cls.__module__ == module.__name__]
    assert len(kinds) == 1, f"hfpatch.mixers.kinds.{path.stem} defines {[k.__name__ for k in kinds]}"
    listed = sorted(role for role, kernel in KERNELS.items() if type(kernel) is kinds[0])
    assert listed, f"{kinds[0].__name__} is in no entry of kinds.KERNELS"
    assert all(KERNELS[role].role == role for role in listed)
