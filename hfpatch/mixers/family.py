"""How the mixer registry knows a module: the record types ``MixerFamily`` (one way a release writes a mixer
module) and ``Recognised`` (a module the registry matched), the fingerprint a forward is recognised by, and the
check a CP form makes of the methods it reproduces (``require_methods_read``). The entries themselves live in
``hfpatch.mixers.families``.

A fingerprint is 16 hex digits of the sha256 of ``canonical_dump(node)``: the function's syntax tree, decorators
dropped, positions left out, so formatting and comments do not count. It must give the same value on every Python
the project supports, so it never hashes a text the standard library formats: ``ast.dump``'s changes between
minors (3.12 adds ``type_params`` to every function node; 3.13 leaves empty lists and ``None`` fields out by
default). ``canonical_dump`` writes the tree itself, by one fixed rule:

- a node is ``ClassName(field, field, ...)``, its fields in the grammar's order, values by position;
- an optional field that is ``None`` is left out, and every field after it is written ``name=value`` (only
  ``Constant.value`` and ``MatchSingleton.value`` are written when ``None``: there ``None`` is the value);
- ``type_params`` (3.12+, PEP 695) is left out when empty: no older Python has the field, and an empty list says
  nothing; a non-empty one is written like any field;
- an f-string's empty text parts (``Constant('')`` among ``JoinedStr.values``) are left out: 3.12's parser adds
  one after a replacement field inside a format spec (``f'{x:>{w}}'``), older ones never write one, and it adds
  nothing to the string;
- a list is ``[item, item]`` (``[]`` when empty), anything else is its ``repr``.

That is exactly the text ``ast.dump(node, annotate_fields=False)`` gives on Python 3.11, so the registry's keys,
read on 3.11, keep their values; tests/mixers/test_fingerprint.py holds it to that on every function of the
installed transformers, and to a committed digest of those keys on every Python CI runs.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Callable, Mapping, Tuple

from hfpatch.errors import UnsupportedModel

__all__ = ["MixerFamily", "Recognised", "canonical_dump", "fingerprint_of", "forward_fingerprint", "function_node",
           "require_methods_read"]


@dataclass(frozen=True)
class MixerFamily:
    """``name``: the family; ``mixer``: what it is, in words; ``classes``: module class names; ``bindings``:
    (global name in the class's modeling module, kernel role) pairs the forward calls; ``forwards``: forward
    fingerprint -> the releases (and model types) it was read and tested on.

    ``replaces``: for mixers whose recurrence HF computes inline (no kernel name to rebind), (method name, CP form)
    pairs: under CP, ``install_mixers`` replaces each method on the instance by its CP form (``form(module, *args,
    **kwargs)``: the same computation, its sequence parts through kernels); the ``bindings`` are then names in the
    CP forms' module, and ``forwards`` keys join the fingerprints of ``forward`` and each other replaced method
    with "+" (``registry.class_fingerprint``).

    A class may appear in several entries (releases that write it differently); the fingerprint picks one."""

    name: str
    mixer: str
    classes: Tuple[str, ...]
    bindings: Tuple[Tuple[str, str], ...]
    forwards: Mapping[str, str]
    replaces: Tuple[Tuple[str, Callable], ...] = ()


@dataclass(frozen=True)
class Recognised:
    """A recognised mixer module: its ``family`` and the modeling ``module`` whose globals hfpatch rebinds."""

    family: MixerFamily
    module: object


# Fields whose None is the node's value, not an absent optional part.
_NONE_IS_VALUE = {("Constant", "value"), ("MatchSingleton", "value")}
# Fields newer Pythons add; left out while empty, so a tree reads the same on the Pythons that lack them.
_ADDED_FIELDS = {"type_params"}


def canonical_dump(node: ast.AST) -> str:
    """The tree under ``node`` as text, by the rule of the module docstring; independent of the Python minor."""
    if not isinstance(node, ast.AST):
        raise TypeError(f"canonical_dump expects an ast.AST node, got {type(node).__name__}")
    return _dump(node)


def _dump(value) -> str:
    if isinstance(value, ast.AST):
        parts, named = [], False
        cls = type(value).__name__
        for name in value._fields:
            field = getattr(value, name, None)
            if field is None and (cls, name) not in _NONE_IS_VALUE:
                named = True
                continue
            if name in _ADDED_FIELDS and field == []:
                continue
            if cls == "JoinedStr" and name == "values":
                field = [part for part in field if not (isinstance(part, ast.Constant) and part.value == "")]
            text = _dump(field)
            parts.append(f"{name}={text}" if named else text)
        return f"{cls}({', '.join(parts)})"
    if isinstance(value, list):
        return "[" + ", ".join(_dump(item) for item in value) + "]"
    return repr(value)


def function_node(function: Callable) -> ast.AST:
    """The syntax tree of ``function`` (``functools.wraps`` layers unwrapped), decorators dropped."""
    function = inspect.unwrap(function)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    node.decorator_list = []
    return node


def forward_fingerprint(function: Callable) -> str:
    """16 hex digits of the sha256 of ``canonical_dump`` of ``function``'s tree (``function_node``)."""
    return fingerprint_of(function_node(function))


def fingerprint_of(node: ast.AST) -> str:
    """16 hex digits of the sha256 of ``canonical_dump(node)``."""
    return hashlib.sha256(canonical_dump(node).encode()).hexdigest()[:16]


_METHODS_CHECKED: dict = {}


def require_methods_read(module, read: Mapping[str, Mapping[str, str]]) -> None:
    """Raise ``UnsupportedModel`` unless every method named in ``read`` has, on ``module``'s class, a fingerprint
    (``forward_fingerprint``) listed there: the code a CP form reproduces besides the forward the registry
    recognised. Checked once per class."""
    cls = type(module)
    key = (cls, id(read))
    if key not in _METHODS_CHECKED:
        changed = []
        for name, known in read.items():
            method = getattr(cls, name, None)
            fingerprint = forward_fingerprint(method) if method is not None else "absent"
            if fingerprint not in known:
                changed.append(f"{name} (fingerprint {fingerprint}; read: {', '.join(known)})")
        _METHODS_CHECKED[key] = changed
    if _METHODS_CHECKED[key]:
        raise UnsupportedModel(
            f"{cls.__name__}: hfpatch's CP form of its forward reproduces methods that this release writes "
            f"differently: {'; '.join(_METHODS_CHECKED[key])}. Fix: train this model without CP, or use a "
            "transformers release whose mixer hfpatch lists (MODELS.md).", findings=[])
