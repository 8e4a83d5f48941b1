"""``import ring_flash_attn`` answered by hfpatch's drop-in, for code that imports ring-flash-attn by that name.

    handle = hfpatch.dropin.provide_ring_flash_attn()   # before the first `import ring_flash_attn` (OpenRLHF's)
    import ring_flash_attn                              # now hfpatch.dropin.ring_flash_attn itself
    handle.remove()                                     # or hfpatch.dropin.forget()

Contracts:

- Cheap, so that it may run at every interpreter start (a ``.pth`` line, docs/migration.md): it imports neither
  torch nor the drop-in. It puts one finder first in ``sys.meta_path``; the first ``import ring_flash_attn`` then
  imports ``hfpatch.dropin.ring_flash_attn`` and binds THAT module object under the name (``ring_flash_attn is
  hfpatch.dropin.ring_flash_attn``; its own ``__spec__`` and ``__name__`` stay hfpatch's).
- Only the top-level name. ring-flash-attn's submodules (``ring_flash_attn.adapters``, ...) are not provided:
  importing one raises ``ModuleNotFoundError``.
- Refuses with ``ModuleNameTaken`` (an ``ImportError``), changing nothing, when a module of that name is already
  imported or is installed (another finder finds it), naming where it is. ``force=True`` takes the name anyway:
  the finder answers before the installed package's, and an imported module leaves ``sys.modules`` until
  ``remove()`` puts it back (bindings made from it earlier, ``from ring_flash_attn import x``, keep it: call this
  before that code imports).
- Idempotent while provided: a second call returns the same handle (a ``.pth`` line and a script may both call it).
  ``remove()`` takes the finder and the name out again (restoring a module ``force`` displaced); a second
  ``remove()`` raises ``AlreadyRemoved``. A name someone else rebound in ``sys.modules`` meanwhile is left as it
  is, and ``remove()`` then raises ``SitesRebound`` naming it (the finder is removed all the same).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Optional

from hfpatch.errors import AlreadyRemoved, ModuleNameTaken, SitesRebound

__all__ = ["ProvidedModule", "provide_ring_flash_attn", "withdraw"]

NAME = "ring_flash_attn"
TARGET = "hfpatch.dropin.ring_flash_attn"

_current: Optional["ProvidedModule"] = None


class _Finder:
    """The meta-path finder and loader of the provided name: the loader hands back ``TARGET``'s module itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        return importlib.machinery.ModuleSpec(NAME, self, origin=TARGET)

    def create_module(self, spec):
        module = importlib.import_module(TARGET)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # importlib set __spec__ to the provided name's spec on the way in; the module stays hfpatch's
        module.__spec__ = self._own_spec


class ProvidedModule:
    """The handle of ``provide_ring_flash_attn``: ``name`` ("ring_flash_attn"), ``target`` (the module that answers
    it), ``displaced`` (the module ``force=True`` took out of ``sys.modules``, or None), ``removed``."""

    def __init__(self, finder: _Finder, displaced: Optional[ModuleType]) -> None:
        self.name = NAME
        self.target = TARGET
        self.displaced = displaced
        self.removed = False
        self._finder = finder

    def __repr__(self) -> str:
        return f"<hfpatch.dropin provides {self.name!r} as {self.target}{': removed' if self.removed else ''}>"

    def remove(self) -> None:
        """Take the finder and the name out; restore a displaced module (module docstring)."""
        global _current
        if self.removed:
            raise AlreadyRemoved(f"the name {self.name!r} was already withdrawn; remove() is not idempotent. Fix: "
                                 "remove it once (hfpatch.dropin.forget() withdraws it too).", what=repr(self))
        self.removed = True
        if _current is self:
            _current = None
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        bound = sys.modules.get(self.name)
        if bound is not None and bound is not sys.modules.get(self.target):
            raise SitesRebound(f"sys.modules[{self.name!r}] was rebound to {bound!r} after hfpatch provided it; it "
                               "was left as it is (the finder is removed). Fix: leave the name to one owner.",
                               sites=[f"sys.modules[{self.name!r}]"])
        sys.modules.pop(self.name, None)
        if self.displaced is not None:
            sys.modules[self.name] = self.displaced


def _taken(force: bool) -> Optional[ModuleType]:
    """The imported module ``force`` displaces (None: none imported); raises ``ModuleNameTaken`` without force."""
    imported = sys.modules.get(NAME)
    if imported is not None:
        where = getattr(imported, "__file__", None) or repr(imported)
        if not force:
            raise ModuleNameTaken(
                f"a module {NAME!r} is already imported ({where}), so `import {NAME}` cannot resolve to {TARGET}. "
                f"Fix: call provide_ring_flash_attn() before anything imports {NAME}, or pass force=True to take "
                "the name from it (bindings already made from it keep it).", name=NAME, path=where)
        return imported
    try:
        spec = importlib.util.find_spec(NAME)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and not force:
        where = spec.origin or str(list(spec.submodule_search_locations or []))
        raise ModuleNameTaken(
            f"{NAME} is installed ({where}); providing hfpatch's drop-in under its name would hide it. Fix: "
            f"pip uninstall ring-flash-attn, or pass force=True to answer `import {NAME}` with {TARGET} anyway.",
            name=NAME, path=where)
    return None


def provide_ring_flash_attn(*, force: bool = False) -> ProvidedModule:
    """Make ``import ring_flash_attn`` resolve to ``hfpatch.dropin.ring_flash_attn``; returns the handle (module
    docstring: refusals, ``force``, ``remove()``)."""
    global _current
    if _current is not None:
        return _current
    displaced = _taken(force)
    if displaced is not None:
        del sys.modules[NAME]
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    _current = ProvidedModule(finder, displaced)
    return _current


def withdraw() -> None:
    """Remove the handle of ``provide_ring_flash_attn`` if the name is provided (``hfpatch.dropin.forget``)."""
    if _current is not None:
        _current.remove()
