"""Find every place that holds transformers' ``_flash_attention_forward``, and swap it all-or-nothing.

Where the function is looked up is not where it is defined (wrapt's ``resolve_path`` makes the same
distinction). Callers reach it through:

1. the defining module, ``transformers.modeling_flash_attention_utils``;
2. every module that bound it with ``from ... import _flash_attention_forward`` (found by *identity* in each
   module's ``__dict__``, under any name -- never by name alone): ``integrations.flash_attention`` (4.48+),
   falcon, gpt_neo, ... (5 modules in 5.23, 58 in 4.47). A user or framework module that holds the function
   (``from ... import _flash_attention_forward as fa``) is a caller too and is patched the same way; hfpatch's
   own modules are skipped;
3. attention-interface entries (``ALL_ATTENTION_FUNCTIONS`` / ``AttentionInterface._global_mapping``, 4.48+).
   Their function is ``integrations.flash_attention.flash_attention_forward``, which calls the name from its
   module globals at call time. Decision: the entries themselves are NOT replaced (their signature is the
   interface's, not ``_flash_attention_forward``'s); patching the globals they read covers them. Each entry that
   leads to the original is recorded as an ``InterfaceRoute`` and checked by ``verify.identity``. An entry
   whose globals dict belongs to no imported module gets its globals patched as a site of its own; one that
   holds the original in a closure cannot be rebound and is refused before anything changes.
4. modules imported *after* apply: a ``sys.meta_path`` finder (``RebindFinder``, removed by ``remove``) rebinds
   the original, and records the wrapper, in each new module right after it executes -- so ``remove`` also
   puts the original back there.

``install`` validates every site first, then swaps; if one swap fails, the ones already made are undone
before the error is raised. It returns an ``Installation``, whose ``remove()`` (``hfpatch.undo.Removable``)
puts the original back by identity.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from hfpatch.errors import AlreadyRemoved, PatchError, SitesRebound

__all__ = ["TARGET_MODULE", "TARGET_ATTR", "Site", "InterfaceRoute", "BindingSites", "Installation", "RebindFinder",
           "binding_sites", "install"]

TARGET_MODULE = "transformers.modeling_flash_attention_utils"
TARGET_ATTR = "_flash_attention_forward"


@dataclass(eq=False)
class Site:
    """One binding: ``owner`` (a module, or a plain dict such as a function's globals) holds ``original``
    under ``key``. ``label`` is what ``Patch.sites`` shows: ``"module.attr"`` for modules."""

    owner: Any
    key: str
    original: Any
    label: str

    def current(self) -> Any:
        """What the owner holds now (read from the dict: a module's ``__getattr__`` is never triggered)."""
        namespace = self.owner.__dict__ if isinstance(self.owner, types.ModuleType) else self.owner
        return namespace.get(self.key, _MISSING)

    def set(self, value: Any) -> None:
        # setattr for modules (a module subclass may guard its attributes); item assignment for plain dicts.
        if isinstance(self.owner, types.ModuleType):
            setattr(self.owner, self.key, value)
        else:
            self.owner[self.key] = value


@dataclass(eq=False)
class InterfaceRoute:
    """An attention-interface entry ``mapping_label[key]`` whose function reaches the original through the
    global ``name`` of the namespace ``globals_`` (covered by the site of that module)."""

    mapping_label: str
    key: str
    function: Callable
    globals_: dict
    name: str

    @property
    def label(self) -> str:
        return f"{self.mapping_label}[{self.key!r}] -> {getattr(self.function, '__module__', '?')}.{self.name}"

    def reaches(self) -> Any:
        return self.globals_.get(self.name, _MISSING)


@dataclass(eq=False)
class BindingSites:
    """Every site and interface route found for ``original``; nothing has been changed yet."""

    original: Any
    sites: list[Site]
    routes: list[InterfaceRoute] = field(default_factory=list)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


# ------------------------------------------------------------------------------------------ finding sites


def _module_sites(original: Any, modules: Iterable[tuple[str, Any]]) -> list[Site]:
    """Sites in imported modules holding ``original`` by identity; the defining module comes first."""
    sites = []
    seen: set[int] = set()
    for module_name, module in modules:
        if not isinstance(module, types.ModuleType) or id(module) in seen:
            continue  # sys.modules may hold placeholders (None), foreign objects, or one module twice
        seen.add(id(module))
        if module_name == "hfpatch" or module_name.startswith("hfpatch."):
            continue  # our own references to the original (dispatch calls it in "original" mode)
        for key, value in list(module.__dict__.items()):
            if value is original:
                sites.append(Site(module, key, original, f"{module.__name__}.{key}"))
    defining = getattr(original, "__module__", None)
    sites.sort(key=lambda s: (s.owner.__name__ != defining if isinstance(s.owner, types.ModuleType) else True,
                              s.label))
    return sites


def _interface_mappings() -> list[tuple[str, dict]]:
    """The attention-interface mappings of the imported transformers (none before 4.48 or if not imported)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return []
    found: list[tuple[str, dict]] = []
    interface_cls = modeling_utils.__dict__.get("AttentionInterface")
    global_mapping = getattr(interface_cls, "_global_mapping", None)
    if isinstance(global_mapping, dict):  # 4.51+: class-wide registry
        found.append(("AttentionInterface._global_mapping", global_mapping))
    instance = modeling_utils.__dict__.get("ALL_ATTENTION_FUNCTIONS")
    if isinstance(instance, dict):  # 4.48-4.50: a plain dict
        found.append(("ALL_ATTENTION_FUNCTIONS", instance))
    elif isinstance(getattr(instance, "_local_mapping", None), dict):  # 4.51+: instance-local entries
        found.append(("ALL_ATTENTION_FUNCTIONS._local_mapping", instance._local_mapping))
    return found


def _routes_and_extra_sites(original: Any, module_sites: list[Site]) -> tuple[list[InterfaceRoute], list[Site]]:
    """How each attention-interface entry reaches ``original``; extra sites for globals no module owns."""
    module_namespaces = {id(s.owner.__dict__) for s in module_sites if isinstance(s.owner, types.ModuleType)}
    routes: list[InterfaceRoute] = []
    extra: list[Site] = []
    for label, mapping in _interface_mappings():
        for key, function in list(mapping.items()):
            function = getattr(function, "__func__", function)
            if function is original:
                raise PatchError(
                    f"{label}[{key!r}] is _flash_attention_forward itself, which has a different signature from an "
                    "attention-interface function; hfpatch cannot tell how callers use it. Fix: register "
                    "transformers.integrations.flash_attention.flash_attention_forward under that key instead."
                )
            closure = getattr(function, "__closure__", None) or ()
            if any(_cell_holds(cell, original) for cell in closure):
                raise PatchError(
                    f"{label}[{key!r}] ({getattr(function, '__qualname__', function)!r}) holds "
                    "_flash_attention_forward in a closure, which hfpatch cannot rebind; calls through it would skip "
                    "the ring. Fix: have it look the function up from its module at call time."
                )
            namespace = getattr(function, "__globals__", None)
            if not isinstance(namespace, dict):
                continue
            for name, value in list(namespace.items()):
                if value is not original:
                    continue
                routes.append(InterfaceRoute(label, key, function, namespace, name))
                if id(namespace) not in module_namespaces:
                    module_namespaces.add(id(namespace))
                    extra.append(Site(namespace, name, original, f"<globals of {function.__qualname__}>.{name}"))
    return routes, extra


def _cell_holds(cell, original) -> bool:
    try:
        return cell.cell_contents is original
    except ValueError:  # an empty cell
        return False


def binding_sites(original: Any) -> BindingSites:
    """Every place that holds ``original`` now (modules, interface routes). Changes nothing."""
    sites = _module_sites(original, list(sys.modules.items()))
    if not sites:
        raise PatchError(
            f"no imported module holds {getattr(original, '__qualname__', original)!r}; nothing to patch. "
            f"Fix: import {TARGET_MODULE} before hfpatch.apply()."
        )
    routes, extra = _routes_and_extra_sites(original, sites)
    return BindingSites(original, sites + extra, routes)


def validate(found: BindingSites) -> None:
    """Every site still holds the original and can be written: checked for all before any is changed."""
    problems = []
    for site in found.sites:
        if site.current() is not found.original:
            problems.append(f"{site.label} holds {site.current()!r}, not the original")
        elif not isinstance(site.owner, (types.ModuleType, dict)):
            problems.append(f"{site.label}: its owner {type(site.owner).__name__} is neither a module nor a dict")
    if problems:
        raise PatchError(
            "cannot patch: " + "; ".join(problems) + ". Nothing was changed. "
            "Fix: call hfpatch.apply() again (something rebound the function while it was being planned)."
        )


# ------------------------------------------------------------------------------------- install / remove


class Installation:
    """The installed state: which sites now hold ``wrapper``, and the import hook. ``remove`` undoes it."""

    def __init__(self, found: BindingSites, wrapper: Callable) -> None:
        self.original = found.original
        self.wrapper = wrapper
        self.sites: list[Site] = []
        self.routes = list(found.routes)
        self.hook: RebindFinder | None = None
        self._lock = threading.Lock()
        self.installed = False

    # -- called by the import hook for each newly executed module
    def adopt_module(self, module: types.ModuleType) -> None:
        """Rebind ``original`` to the wrapper in a freshly imported module, and record any binding to the
        wrapper there (it came through a patched module), so that ``remove`` puts the original back."""
        for key, value in list(module.__dict__.items()):
            if value is self.original:
                site = Site(module, key, self.original, f"{module.__name__}.{key}")
                site.set(self.wrapper)
            elif value is self.wrapper:
                site = Site(module, key, self.original, f"{module.__name__}.{key}")
            else:
                continue
            with self._lock:
                self.sites.append(site)

    def remove(self) -> None:
        """Put the original back at every site that holds the wrapper, remove the import hook, and sweep
        ``sys.modules`` for any other module holding the wrapper (e.g. one executed bypassing the import
        system). Sites someone else rebound meanwhile are left as they are and named, once everything else is
        restored, by ``SitesRebound``; a second call raises ``AlreadyRemoved``."""
        if not self.installed:
            raise AlreadyRemoved(f"the attention patch of {len(self.sites)} sites was already removed (or never "
                                 "completed its install). Fix: remove it once.", what="patcher.Installation")
        if self.hook is not None:
            self.hook.uninstall()
            self.hook = None
        foreign = []
        with self._lock:
            sites = list(self.sites)
        for site in reversed(sites):
            current = site.current()
            if current is self.wrapper:
                site.set(site.original)
            elif current is not site.original:
                foreign.append(site.label)
        for module_name, module in list(sys.modules.items()):
            if isinstance(module, types.ModuleType):
                for key, value in list(module.__dict__.items()):
                    if value is self.wrapper:
                        setattr(module, key, self.original)
        self.installed = False
        if foreign:
            raise SitesRebound(
                f"these sites had been rebound by someone else after apply and were left as they are: "
                f"{', '.join(foreign)}. Fix: remove the other patch too, or apply it before hfpatch.", sites=foreign)


def install(found: BindingSites, wrapper: Callable, *, import_hook: bool = True) -> Installation:
    """Validate every site of ``found``, then swap the original for ``wrapper`` at each one and add the import
    hook. All-or-nothing: on any failure the swaps already made are undone and ``PatchError`` is raised."""
    validate(found)
    installation = Installation(found, wrapper)
    done: list[Site] = []
    try:
        for site in found.sites:
            site.set(wrapper)
            done.append(site)
            installation.sites.append(site)
        if import_hook:
            installation.hook = RebindFinder(installation)
            installation.hook.install()
    except BaseException as exc:
        failed_at = found.sites[len(done)].label if len(done) < len(found.sites) else "the import hook"
        _undo(done)
        if installation.hook is not None:
            installation.hook.uninstall()
        raise PatchError(
            f"installing the wrapper failed at {failed_at}: {type(exc).__name__}: {exc}. "
            f"The {len(done)} site(s) already swapped were restored; transformers is unchanged."
        ) from exc
    installation.installed = True
    return installation


def _undo(done: list[Site]) -> None:
    errors = []
    for site in reversed(done):
        try:
            site.set(site.original)
        except Exception as exc:  # keep restoring the others; report every failure below
            errors.append(f"{site.label}: {exc}")
    if errors:
        raise PatchError("rolling back a failed install also failed at: " + "; ".join(errors))


# ------------------------------------------------------------------------------------------ import hook


# Loaders that the path finder creates afresh for every module (so an instance attribute affects one module).
_PER_MODULE_LOADERS = (
    importlib.machinery.SourceFileLoader,
    importlib.machinery.SourcelessFileLoader,
    importlib.machinery.ExtensionFileLoader,
)


class RebindFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: finds each module through the other finders and arranges that, right after
    the module's code has run, ``installation.adopt_module(module)`` sees it.

    Only file-based modules are intercepted (``.py``, ``.pyc`` and extension files), because their loader is a fresh object per module: an instance attribute ``exec_module`` on it
    wraps that one module's execution and is deleted right after, so the spec, ``__loader__`` and the loader's
    type are exactly what they would be without hfpatch. Other loaders (built-ins, zip archives, custom ones)
    may be shared between modules and are left alone; ``Installation.remove`` still sweeps those modules.
    """

    def __init__(self, installation: Installation) -> None:
        self._installation = installation
        self._busy = threading.local()

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass  # already gone (someone rebuilt sys.meta_path): nothing left to remove

    def find_spec(self, fullname, path, target=None):
        if getattr(self._busy, "active", False):
            return None  # a nested lookup through our own search below
        self._busy.active = True
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.active = False
        loader = spec.loader
        if isinstance(loader, _PER_MODULE_LOADERS) and "exec_module" not in vars(loader):
            loader.exec_module = _adopting_exec(loader, self._installation.adopt_module)
        return spec


def _adopting_exec(loader, after: Callable[[types.ModuleType], None]) -> Callable[[types.ModuleType], None]:
    """``loader.exec_module`` (the class's method) followed by ``after(module)``; removes itself first."""

    def exec_module(module: types.ModuleType) -> None:
        vars(loader).pop("exec_module", None)  # one use: the loader is pristine again
        type(loader).exec_module(loader, module)
        after(module)

    return exec_module
