"""Static reading of a transformers release: a wheel or a source tree, read with ``zipfile`` + ``ast``.

The release is never imported or executed, so any release can be examined from any environment (a 4.43
wheel on a 5.x install). What is read:

- ``_flash_attention_forward`` in ``transformers/modeling_flash_attention_utils.py`` as an ``inspect.Signature``
  (literal defaults evaluated with ``ast.literal_eval``; other defaults kept as ``SourceDefault`` text;
  annotations kept as their source text);
- every module binding it by ``from ... import`` (the sites a patch of the defining module alone misses); the
  ``modular_*.py`` files under ``transformers/models/`` are skipped: they are the templates transformers generates
  its ``modeling_*.py`` files from, shipped in the wheel but never imported at run time;
- per-class ``_flash_attention_forward`` methods (the pre-4.43 design);
- the attention interface (``ALL_ATTENTION_FUNCTIONS``): its kind and default keys.

``scan_version("X.Y.Z")`` fetches the wheel with ``pip download --no-deps`` into a cache
(``$HFPATCH_WHEEL_CACHE``, default ``~/.cache/hfpatch/wheels``).
"""
from __future__ import annotations

import ast
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from packaging.version import InvalidVersion, Version

from hfpatch.version_gates import TRANSFORMERS_MIN_SUPPORTED, parse_version
from hfpatch.errors import ScanError, WheelFetchError
from hfpatch.signatures.registry import FORMAT_VERSION, FUNCTION, Match, SourceDefault, match
from hfpatch.signatures.roles import role_for_name

__all__ = [
    "ReleaseScan",
    "BindingSite",
    "ClassMethod",
    "AttentionInterfaceScan",
    "scan_wheel",
    "scan_source",
    "scan_version",
    "wheel_cache_dir",
]

MFAU_PATH = "transformers/modeling_flash_attention_utils.py"
MFAU_MODULE = "transformers.modeling_flash_attention_utils"
_TARGET = "_flash_attention_forward"
_MODELING_UTILS = "transformers/modeling_utils.py"


@dataclass(frozen=True)
class BindingSite:
    """A module that binds ``_flash_attention_forward`` by ``from ... import``: dotted ``module``, the
    ``bound_as`` name, the ``scope`` of the import (``module``, ``module (conditional)``, ``function f``, ...)
    and its ``line``."""

    module: str
    bound_as: str
    scope: str
    line: int


@dataclass(frozen=True)
class ClassMethod:
    """A per-class ``_flash_attention_forward(self, ...)`` method (transformers before 4.43)."""

    module: str
    class_name: str
    params: tuple[str, ...]  # without self


@dataclass(frozen=True)
class AttentionInterfaceScan:
    """``ALL_ATTENTION_FUNCTIONS``: ``kind`` is "none", "plain dict" or "AttentionInterface class";
    ``functions`` maps each default key (source order) to the source text of its function."""

    kind: str = "none"
    functions: dict[str, str] = field(default_factory=dict)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.functions)

    @property
    def flash_keys(self) -> tuple[str, ...]:
        """Default keys served by ``integrations.flash_attention.flash_attention_forward``, the function that
        calls ``_flash_attention_forward``."""
        return tuple(k for k, v in self.functions.items() if v == "flash_attention_forward")


@dataclass(frozen=True)
class ReleaseScan:
    """What a release's source says about its flash-attention entry point (see the module docstring)."""

    version: str | None
    origin: str
    signature: inspect.Signature | None
    default_sources: dict[str, str]
    annotation_sources: dict[str, str]
    binding_sites: tuple[BindingSite, ...]
    class_methods: tuple[ClassMethod, ...]
    attention_interface: AttentionInterfaceScan

    @property
    def binding_modules(self) -> tuple[str, ...]:
        """Dotted names of the modules that bind the function by from-import (sorted, unique)."""
        return tuple(sorted({site.module for site in self.binding_sites}))

    @property
    def attention_interface_kind(self) -> str:
        return self.attention_interface.kind

    @property
    def flash_keys(self) -> tuple[str, ...]:
        return self.attention_interface.flash_keys

    @property
    def has_module_function(self) -> bool:
        return self.signature is not None

    def match(self) -> Match | None:
        """The registry verdict for the scanned signature (None before 4.43: there is no module function)."""
        return None if self.signature is None else match(self.signature, self.version)

    def to_registry_entry(self, *, entry_id: str | None = None, releases: str | None = None) -> dict:
        """A registry entry proposal in the registry's JSON format; roles come from the known vocabulary by
        parameter name ("unknown" marks a name hfpatch has never seen: a human must assign it)."""
        if self.signature is None:
            raise ScanError(
                f"{self.origin}: transformers {self.version} has no module-level {_TARGET} "
                f"(per-class methods only); nothing to put in the registry. Releases >= {TRANSFORMERS_MIN_SUPPORTED} have one.",
                path=self.origin,
            )
        params = []
        for param in self.signature.parameters.values():
            item: dict[str, Any] = {
                "name": param.name,
                "kind": param.kind.name,
                "role": role_for_name(param.name, var_keyword=param.kind is inspect.Parameter.VAR_KEYWORD),
            }
            if param.default is not inspect.Parameter.empty:
                item["default"] = _default_json(param.default, self.default_sources[param.name])
            if param.name in self.annotation_sources:
                item["annotation"] = self.annotation_sources[param.name]
            params.append(item)
        version = self.version or "unknown"
        return {
            "format": FORMAT_VERSION,
            "id": entry_id or f"S?-{version}",
            "function": FUNCTION,
            "releases": releases or _series_specifier(self.version),
            "scanned_in": [version],
            "params": params,
        }

    def to_json(self) -> dict:
        """Every fact of the scan, JSON-ready (for ``--json``)."""
        return {
            "version": self.version,
            "origin": self.origin,
            "signature": None if self.signature is None else str(self.signature),
            "default_sources": self.default_sources,
            "binding_modules": list(self.binding_modules),
            "binding_sites": [vars(site) for site in self.binding_sites],
            "class_methods": [
                {"module": m.module, "class": m.class_name, "params": list(m.params)} for m in self.class_methods
            ],
            "attention_interface": {
                "kind": self.attention_interface.kind,
                "keys": list(self.attention_interface.keys),
                "flash_keys": list(self.attention_interface.flash_keys),
            },
        }


def _default_json(value: Any, source: str) -> dict:
    if not isinstance(value, SourceDefault):
        return {"value": value, "source": source}
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        node = None
    if isinstance(node, ast.Compare) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)):
        # A comparison (or `not`) evaluated at import time: a bool, whose value depends on the environment then.
        return {"one_of": [False, True], "source": source}
    # Anything else needs a human decision; the registry refuses to load an entry without 'value'/'one_of'.
    return {"source": source, "todo": "set 'value' or 'one_of': the values a live function may hold"}


def _series_specifier(version: str | None) -> str:
    if not version:
        return ""
    release = parse_version(version).release
    return f"=={release[0]}.{release[1] if len(release) > 1 else 0}.*"


# --------------------------------------------------------------------------------------------- sources


class _Tree:
    """Read-only view of the ``transformers/`` package files of a wheel or a source tree."""

    def __init__(self, origin: str, paths: list[str], reader) -> None:
        self.origin = origin
        self.paths = paths  # posix paths starting with "transformers/"
        self._reader = reader

    def read(self, path: str) -> bytes:
        return self._reader(path)

    def py_files(self) -> Iterator[str]:
        return (p for p in self.paths if p.endswith(".py"))

    def runtime_py_files(self) -> Iterator[str]:
        """The ``.py`` files transformers can import at run time: all but the modular templates."""
        return (p for p in self.py_files() if not _is_modular_template(p))


def _is_modular_template(path: str) -> bool:
    """``transformers/models/<model>/modular_<model>.py``: the source transformers' modular converter generates
    ``modeling_<model>.py`` from; no module of the library imports it."""
    return path.startswith("transformers/models/") and path.rsplit("/", 1)[-1].startswith("modular_")


def _module_name(path: str) -> str:
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def scan_wheel(path: str | os.PathLike) -> ReleaseScan:
    """Scan a transformers wheel (a ``.whl`` zip) without installing or importing it."""
    path = Path(path)
    if not path.is_file():
        raise ScanError(f"--wheel {str(path)!r}: no such file; give the path of a transformers-*.whl", path=str(path))
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ScanError(f"--wheel {str(path)!r} is not a wheel (not a zip archive): {exc}", path=str(path)) from exc
    with archive:
        names = archive.namelist()
        if "transformers/__init__.py" not in names:
            raise ScanError(
                f"--wheel {str(path)!r} is not a transformers wheel: it has no transformers/__init__.py",
                path=str(path),
            )
        version = _wheel_version(archive, names) or _init_version(archive.read("transformers/__init__.py"))
        tree = _Tree(str(path), [n for n in names if n.startswith("transformers/")], archive.read)
        return _scan_tree(tree, version)


def _wheel_version(archive: zipfile.ZipFile, names: list[str]) -> str | None:
    for name in names:
        if name.endswith(".dist-info/METADATA"):
            text = archive.read(name).decode("utf-8", "replace")
            fields = dict(re.findall(r"^(Name|Version): *(.+?)\s*$", text, flags=re.M))
            if fields.get("Name", "").lower() == "transformers":
                return fields.get("Version")
    return None


def _init_version(init_source: bytes) -> str | None:
    """``__version__ = "X"`` from ``transformers/__init__.py``."""
    for node in ast.parse(init_source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    return None


def scan_source(directory: str | os.PathLike) -> ReleaseScan:
    """Scan a source tree: a git checkout (``src/transformers``), a site-packages-like folder holding
    ``transformers/``, or the ``transformers`` package folder itself."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ScanError(f"--source {str(directory)!r}: no such directory", path=str(directory))
    candidates = [directory / "transformers", directory / "src" / "transformers", directory]
    package = next((c for c in candidates if (c / "__init__.py").is_file() and c.name == "transformers"), None)
    if package is None:
        raise ScanError(
            f"--source {str(directory)!r} holds no transformers package (looked for transformers/__init__.py, "
            "src/transformers/__init__.py, or the folder itself being transformers/)",
            path=str(directory),
        )
    root = package.parent
    paths = sorted(p.relative_to(root).as_posix() for p in package.rglob("*.py"))
    tree = _Tree(str(directory), paths, lambda rel: (root / rel).read_bytes())
    return _scan_tree(tree, _init_version(tree.read("transformers/__init__.py")))


def _scan_tree(tree: _Tree, version: str | None) -> ReleaseScan:
    signature, default_sources, annotation_sources = None, {}, {}
    if MFAU_PATH in tree.paths:
        text = tree.read(MFAU_PATH).decode("utf-8")
        fn = _find_module_function(_parse(tree, MFAU_PATH), _TARGET)
        if fn is not None:
            signature, default_sources, annotation_sources = _signature_from_ast(fn, text)
    sites: list[BindingSite] = []
    methods: list[ClassMethod] = []
    for path in tree.runtime_py_files():
        source = tree.read(path)
        if _TARGET.encode() not in source:  # cheap filter: only a handful of files mention it
            continue
        module = _module_name(path)
        finder = _BindingFinder(module, is_package=path.endswith("__init__.py"))
        finder.visit(_parse(tree, path, source))
        if path != MFAU_PATH:
            sites.extend(finder.sites)
        methods.extend(finder.methods)
    interface = AttentionInterfaceScan()
    if _MODELING_UTILS in tree.paths:
        interface = _attention_interface(_parse(tree, _MODELING_UTILS))
    return ReleaseScan(
        version=version,
        origin=tree.origin,
        signature=signature,
        default_sources=default_sources,
        annotation_sources=annotation_sources,
        binding_sites=tuple(sorted(sites, key=lambda s: (s.module, s.line))),
        class_methods=tuple(sorted(methods, key=lambda m: (m.module, m.class_name))),
        attention_interface=interface,
    )


def _parse(tree: _Tree, path: str, source: bytes | None = None) -> ast.Module:
    try:
        return ast.parse(tree.read(path) if source is None else source, filename=path)
    except SyntaxError as exc:
        raise ScanError(f"{tree.origin}: {path} does not parse as Python: {exc}", path=tree.origin) from exc


# ------------------------------------------------------------------------------------------ ast readers


def _find_module_function(module: ast.Module, name: str) -> ast.FunctionDef | None:
    """A function defined at module level, also under a module-level ``if``/``try`` (never inside a def)."""
    stack = list(module.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                stack.extend(handler.body)
    return None


def _signature_from_ast(fn: ast.FunctionDef, source: str) -> tuple[inspect.Signature, dict[str, str], dict[str, str]]:
    """The signature of ``fn`` with literal defaults evaluated, plus the source text of defaults/annotations
    exactly as written in ``source`` (the module's text)."""

    def text(node: ast.expr) -> str:
        return ast.get_source_segment(source, node) or ast.unparse(node)

    P = inspect.Parameter
    args = fn.args
    positional = [(a, P.POSITIONAL_ONLY) for a in args.posonlyargs] + [(a, P.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    entries = [(a, kind, d) for (a, kind), d in zip(positional, defaults)]
    if args.vararg:
        entries.append((args.vararg, P.VAR_POSITIONAL, None))
    entries += [(a, P.KEYWORD_ONLY, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        entries.append((args.kwarg, P.VAR_KEYWORD, None))
    params, default_sources, annotation_sources = [], {}, {}
    for arg, kind, default_node in entries:
        default = P.empty
        if default_node is not None:
            default_sources[arg.arg] = text(default_node)
            try:
                default = ast.literal_eval(default_node)
            except ValueError:
                default = SourceDefault(default_sources[arg.arg])
        annotation = P.empty
        if arg.annotation is not None:
            annotation = annotation_sources[arg.arg] = text(arg.annotation)
        params.append(P(arg.arg, kind, default=default, annotation=annotation))
    returns = text(fn.returns) if fn.returns is not None else inspect.Signature.empty
    return inspect.Signature(params, return_annotation=returns), default_sources, annotation_sources


class _BindingFinder(ast.NodeVisitor):
    """Collects ``from <mfau> import _flash_attention_forward`` sites and per-class methods in one module."""

    def __init__(self, module: str, *, is_package: bool) -> None:
        self.module = module
        package = module.split(".") if is_package else module.split(".")[:-1]
        self.package = package
        self.scopes: list[str] = []
        self.sites: list[BindingSite] = []
        self.methods: list[ClassMethod] = []

    def _resolve(self, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = self.package[: len(self.package) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _scope(self) -> str:
        return self.scopes[-1] if self.scopes else "module"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if self._resolve(node) != MFAU_MODULE:
            return
        for alias in node.names:
            if alias.name in (_TARGET, "*"):
                self.sites.append(BindingSite(self.module, alias.asname or _TARGET, self._scope(), node.lineno))

    def _visit_conditional(self, node: ast.AST) -> None:
        # An import under a module-level if/try still binds at import time, but only on some machines.
        inner = self.scopes and self.scopes[-1].startswith(("function", "class"))
        self.scopes.append(self._scope() if inner else "module (conditional)")
        self.generic_visit(node)
        self.scopes.pop()

    visit_If = visit_Try = _visit_conditional

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.scopes.append(f"function {node.name}")
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == _TARGET:
                names = [a.arg for a in item.args.posonlyargs + item.args.args][1:]  # drop self
                names += [a.arg for a in item.args.kwonlyargs]
                self.methods.append(ClassMethod(self.module, node.name, tuple(names)))
        self.scopes.append(f"class {node.name}")
        self.generic_visit(node)
        self.scopes.pop()


def _attention_interface(module: ast.Module) -> AttentionInterfaceScan:
    """Read the default keys of ALL_ATTENTION_FUNCTIONS from ``modeling_utils.py``."""
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == "AttentionInterface":
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                if any(getattr(t, "id", None) == "_global_mapping" for t in targets):
                    if isinstance(item.value, ast.Dict):
                        return AttentionInterfaceScan("AttentionInterface class", _dict_functions(item.value))
            return AttentionInterfaceScan("AttentionInterface class", {})
    for node in module.body:
        # 4.48-4.50: ALL_ATTENTION_FUNCTIONS.update({...}) on a plain dict.
        call = node.value if isinstance(node, ast.Expr) else None
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "update"
            and getattr(call.func.value, "id", None) == "ALL_ATTENTION_FUNCTIONS"
            and call.args
            and isinstance(call.args[0], ast.Dict)
        ):
            return AttentionInterfaceScan("plain dict", _dict_functions(call.args[0]))
    return AttentionInterfaceScan()


def _dict_functions(node: ast.Dict) -> dict[str, str]:
    out = {}
    for key, value in zip(node.keys, node.values):
        if key is not None:
            out[key.value if isinstance(key, ast.Constant) else ast.unparse(key)] = ast.unparse(value)
    return out


# -------------------------------------------------------------------------------------------- fetching


def wheel_cache_dir() -> Path:
    """``$HFPATCH_WHEEL_CACHE``, else ``~/.cache/hfpatch/wheels``."""
    return Path(os.environ.get("HFPATCH_WHEEL_CACHE") or Path.home() / ".cache" / "hfpatch" / "wheels")


def scan_version(version: str, *, cache_dir: str | os.PathLike | None = None) -> ReleaseScan:
    """Fetch ``transformers==version`` (``pip download --no-deps``, cached) and scan it.

    Raises ``InvalidReleaseSpec`` for a malformed version, ``WheelFetchError`` when pip cannot fetch it
    (unknown release, no network); nothing is written to the cache on failure.
    """
    parsed = parse_version(version, argument="--version")
    cache = Path(cache_dir) if cache_dir is not None else wheel_cache_dir()
    cached = _cached_wheel(cache, str(parsed))
    if cached is None:
        cached = _download(str(parsed), cache)
    return scan_wheel(cached)


def _cached_wheel(cache: Path, version: str) -> Path | None:
    if not cache.is_dir():
        return None
    wanted = parse_version(version)
    for path in sorted(cache.glob("transformers-*.whl")):
        try:
            found = Version(path.name.split("-")[1])
        except InvalidVersion:
            continue  # not a wheel name we wrote; ignore it
        if found == wanted:
            return path
    return None


def _download(version: str, cache: Path) -> Path:
    # Download into a scratch folder and move the wheel in only on success: a failure writes nothing.
    with tempfile.TemporaryDirectory(prefix="hfpatch-wheel-") as scratch:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--quiet", "--dest", scratch, f"transformers=={version}",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise WheelFetchError(f"could not run pip to fetch transformers=={version}: {exc}", version=version) from exc
        output = (proc.stdout + proc.stderr)[-2000:]
        wheels = list(Path(scratch).glob("transformers-*.whl"))
        if proc.returncode != 0 or not wheels:
            if re.search(r"No matching distribution|Could not find a version", output):
                reason = f"transformers=={version} is not a release on the package index"
                fix = "check the version (e.g. `pip index versions transformers`)"
            else:
                reason = f"pip could not download transformers=={version} (no network or no index?)"
                fix = "check the network / PIP_INDEX_URL, or pass --wheel PATH to a wheel you already have"
            said = _pip_summary(output)
            raise WheelFetchError(f"{reason}. Fix: {fix}.\npip said:\n{said}", version=version, pip_output=output)
        cache.mkdir(parents=True, exist_ok=True)
        target = cache / wheels[0].name
        shutil.move(str(wheels[0]), target)
        return target


def _pip_summary(output: str, width: int = 200) -> str:
    """pip's ERROR/WARNING lines (else its last lines), each cut to ``width``: its list of every version is long."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    picked = [line for line in lines if line.startswith(("ERROR", "WARNING"))] or lines[-3:]
    return "\n".join(line if len(line) <= width else line[: width - 3] + "..." for line in picked)
