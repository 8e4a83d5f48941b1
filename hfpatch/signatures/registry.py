"""The versioned registry of ``_flash_attention_forward`` signatures, and matching a live signature against it.

One JSON file per signature generation (``S<n>-<first release>.json``, written by ``hfpatch signatures scan
--write`` from the release's wheel, see ``REGENERATE.md``). A live signature is matched by the names, kinds,
defaults and order of its parameters -- never by their count (S5 and S6 both have 20 parameters and differ by
one name).

Verdicts
--------
``exact``
    Same parameters as one entry: names, kinds, defaults and order (annotations are ignored: they changed
    inside generations, e.g. ``Optional[int]`` -> ``int | None`` in 5.0).
``compatible``
    The live signature is one entry plus *added* parameters, and nothing else changed. The rule, exactly:

    1. deleting the added parameters from the live signature leaves the entry's parameters, in the entry's
       order, each with the same name, kind and default (nothing removed, renamed, reordered or re-defaulted);
    2. every added parameter has a default and is positional-or-keyword or keyword-only (an added ``*args``,
       ``**kwargs`` or a parameter without a default is a change callers must know about: unsupported);
    3. every added parameter sits after the last required parameter of the entry (Python's own syntax rules
       guarantee this for positional parameters; checked anyway for hand-built signatures).

    An added parameter may sit between two of the entry's parameters (as ``position_ids`` did in 4.44): the
    wrapper is generated from the live signature and binds by name, so positional callers of that same release
    still land in the right roles. Added parameters get the role ``"unknown"``; the wrapper refuses any
    non-default value for them. When several entries qualify, the one needing the fewest additions wins.
``unsupported``
    Anything else. ``Match.entry`` is then the nearest entry (most parameters in common, in order) and
    ``Match.diff`` says what differs.
"""
from __future__ import annotations

import ast
import difflib
import functools
import inspect
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Iterable, Mapping

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from hfpatch.errors import SignatureMismatch
from hfpatch.signatures.roles import ROLES, UNKNOWN_ROLE

__all__ = [
    "SignatureEntry",
    "ParamSpec",
    "DefaultSpec",
    "SourceDefault",
    "Match",
    "load_registry",
    "match",
    "require",
    "entry_for_version",
    "supported_releases",
    "format_signature",
]

FORMAT_VERSION = 1
FUNCTION = "transformers.modeling_flash_attention_utils._flash_attention_forward"

_KIND_BY_NAME = {
    k.name: k
    for k in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.VAR_KEYWORD,
    )
}
_VAR_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_EMPTY = inspect.Parameter.empty


class SourceDefault:
    """A default read statically (by ``hfpatch.release.scan``) that is not a literal: kept as its source text.

    ``SourceDefault('os.environ.get("X", "0") == "1"')``. Two are equal when their normalised source is equal.
    """

    __slots__ = ("source",)

    def __init__(self, source: str) -> None:
        self.source = _normalise_source(source)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SourceDefault) and other.source == self.source

    def __hash__(self) -> int:
        return hash(self.source)

    def __repr__(self) -> str:
        return self.source


def _normalise_source(source: str) -> str:
    """Source text with formatting differences (quotes, spaces) removed, via an ast round trip."""
    try:
        return ast.unparse(ast.parse(source.strip(), mode="eval"))
    except SyntaxError:
        return source.strip()


def same_value(a: Any, b: Any) -> bool:
    """Equal and of the same type (``0``, ``0.0`` and ``False`` are different defaults). Never raises: a tensor
    default compared with ``==`` gives a tensor, which counts as "not the same"."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return (a == b) is True
    except Exception:  # an exotic __eq__ that raises: not provably the same
        return False


@dataclass(frozen=True)
class DefaultSpec:
    """A recorded default: its source text as written, and the values a live function may hold for it.

    For a literal default ``values`` has one element. The 4.43 ``deterministic`` default is the expression
    ``os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"``, evaluated once when transformers imports
    the module, so the live default depends on the environment *at that moment*, which hfpatch cannot know.
    We handle it deliberately: the entry records ``one_of: [false, true]`` (a ``==`` comparison can only
    yield a bool), and a live default matches when it is exactly a ``bool`` -- either value. A statically
    scanned signature holds the expression as a ``SourceDefault`` and matches by its source text instead.
    """

    source: str
    values: tuple[Any, ...]

    def matches(self, live_default: Any) -> bool:
        if isinstance(live_default, SourceDefault):
            return live_default.source == _normalise_source(self.source)
        return any(same_value(live_default, value) for value in self.values)

    def to_json(self) -> dict:
        if len(self.values) == 1 and _is_literal_source(self.source):
            return {"value": self.values[0], "source": self.source}
        return {"one_of": list(self.values), "source": self.source}


def _is_literal_source(source: str) -> bool:
    try:
        ast.literal_eval(source)
        return True
    except (ValueError, SyntaxError):
        return False


@dataclass(frozen=True)
class ParamSpec:
    """One recorded parameter: name, kind, default (None when required) and role."""

    name: str
    kind: inspect._ParameterKind
    default: DefaultSpec | None
    role: str
    annotation: str | None = None

    def matches(self, live: inspect.Parameter) -> bool:
        if live.name != self.name or live.kind != self.kind:
            return False
        if self.default is None:
            return live.default is _EMPTY
        return live.default is not _EMPTY and self.default.matches(live.default)

    def to_parameter(self) -> inspect.Parameter:
        """An ``inspect.Parameter`` for this spec; a ``one_of`` default takes its first value."""
        default = _EMPTY if self.default is None else self.default.values[0]
        annotation = _EMPTY if self.annotation is None else self.annotation
        return inspect.Parameter(self.name, self.kind, default=default, annotation=annotation)


@dataclass(frozen=True)
class SignatureEntry:
    """One signature generation, e.g. ``S5-4.53.3``: ordered ``params``, the ``releases`` it covers (a
    ``SpecifierSet``), and ``roles`` (parameter name -> role)."""

    id: str
    params: tuple[ParamSpec, ...]
    releases: SpecifierSet
    scanned_in: tuple[str, ...] = ()
    function: str = FUNCTION
    note: str = ""
    roles: Mapping[str, str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", {p.name: p.role for p in self.params})

    def covers(self, version: str | Version) -> bool:
        """True when ``version`` is one of the releases this generation covers (pre-releases included)."""
        return self.releases.contains(Version(str(version)), prereleases=True)

    def signature(self) -> inspect.Signature:
        """The entry as an ``inspect.Signature`` (annotations as their source text)."""
        return inspect.Signature([p.to_parameter() for p in self.params])

    def to_json(self) -> dict:
        """The entry in the registry's file format."""
        params = []
        for p in self.params:
            item: dict[str, Any] = {"name": p.name, "kind": p.kind.name, "role": p.role}
            if p.default is not None:
                item["default"] = p.default.to_json()
            if p.annotation is not None:
                item["annotation"] = p.annotation
            params.append(item)
        data = {
            "format": FORMAT_VERSION,
            "id": self.id,
            "function": self.function,
            "releases": str(self.releases),
            "scanned_in": list(self.scanned_in),
            "params": params,
        }
        if self.note:
            data["note"] = self.note
        return data


# ---------------------------------------------------------------------------------------------- loading


def entry_from_json(data: Mapping[str, Any], *, origin: str = "<json>") -> SignatureEntry:
    """Build and validate an entry from its JSON form; a malformed file raises ``ValueError`` naming it."""

    def bad(what: str) -> ValueError:
        return ValueError(f"registry file {origin}: {what}")

    if data.get("format") != FORMAT_VERSION:
        raise bad(f"format {data.get('format')!r} is not {FORMAT_VERSION}")
    if not re.fullmatch(r"S\d+-[0-9][0-9A-Za-z.+]*", str(data.get("id"))):
        raise bad(f"id {data.get('id')!r} must look like 'S<generation>-<first release>', e.g. 'S5-4.53.3'")
    try:
        releases = SpecifierSet(data["releases"])
    except (KeyError, InvalidSpecifier) as exc:
        raise bad(f"'releases' must be a packaging specifier string, got {data.get('releases')!r}") from exc
    params = []
    for item in data.get("params", []):
        kind = _KIND_BY_NAME.get(item.get("kind"))
        if kind is None:
            raise bad(f"parameter {item.get('name')!r} has kind {item.get('kind')!r}; expected one of {sorted(_KIND_BY_NAME)}")
        role = item.get("role")
        if role not in ROLES:
            raise bad(f"parameter {item['name']!r} has role {role!r}; expected one of {ROLES}")
        params.append(ParamSpec(item["name"], kind, _default_from_json(item, bad), role, item.get("annotation")))
    roles = [p.role for p in params]
    duplicated = sorted({r for r in roles if roles.count(r) > 1})
    if duplicated:
        raise bad(f"roles {duplicated} are given to more than one parameter")
    entry = SignatureEntry(
        id=data["id"],
        params=tuple(params),
        releases=releases,
        scanned_in=tuple(data.get("scanned_in", ())),
        function=data.get("function", FUNCTION),
        note=data.get("note", ""),
    )
    try:
        entry.signature()  # validates the parameter order (defaults after required, kinds in order)
    except ValueError as exc:
        raise bad(f"the parameters do not form a valid signature: {exc}") from exc
    return entry


def _default_from_json(item: Mapping[str, Any], bad) -> DefaultSpec | None:
    default = item.get("default")
    if default is None:
        return None
    source = default.get("source")
    if "value" in default:
        if source is not None and _is_literal_source(source):
            # The source text is the truth: JSON has no tuples (and no int/float distinction in some writers).
            return DefaultSpec(source, (ast.literal_eval(source),))
        return DefaultSpec(source if source is not None else repr(default["value"]), (default["value"],))
    if default.get("one_of"):
        return DefaultSpec(source, tuple(default["one_of"]))
    raise bad(
        f"parameter {item['name']!r}: its default ({source!r}) needs 'value' (a literal) or 'one_of' (the values a "
        "live function may hold); decide which by reading the expression"
    )


@functools.lru_cache(maxsize=None)
def load_cached() -> tuple[SignatureEntry, ...]:
    entries = []
    for res in sorted(resources.files("hfpatch.signatures").iterdir(), key=lambda r: r.name):
        if res.name.endswith(".json"):
            entries.append(entry_from_json(json.loads(res.read_text(encoding="utf-8")), origin=res.name))
    # Generation order (S1, S2, ...), not file-name order, so "newest" is well defined.
    entries.sort(key=lambda e: int(e.id.split("-", 1)[0].lstrip("S")))
    return tuple(entries)


def load_registry() -> list[SignatureEntry]:
    """Every registry entry, oldest generation first."""
    return list(load_cached())


def entry_for_version(version: str | Version) -> SignatureEntry | None:
    """The entry whose ``releases`` cover ``version`` (None when no entry does)."""
    for entry in load_cached():
        if entry.covers(version):
            return entry
    return None


def supported_releases() -> str:
    """All covered releases as text: each entry's specifier, joined by ' or '."""
    return " or ".join(f"'{e.releases}'" for e in load_cached())


# --------------------------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class Match:
    """The verdict for one live signature.

    ``verdict``: "exact" | "compatible" | "unsupported"; ``entry``: the matched (or nearest) entry;
    ``signature``: the live signature; ``roles``: live parameter name -> role ("unknown" for parameters the
    entry does not have); ``diff``: readable text; ``id``: ``entry.id``, ``"<id>+compatible"`` or
    ``"<id>+unsupported"``; ``added``: names of the added parameters (compatible); ``notes``: remarks such as a
    release outside the entry's recorded range.
    """

    verdict: str
    entry: SignatureEntry | None  # None only when the registry is empty
    signature: inspect.Signature
    roles: Mapping[str, str]
    diff: str
    id: str
    transformers_version: str | None = None
    added: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def supported(self) -> bool:
        return self.verdict in ("exact", "compatible")


def match(sig: inspect.Signature, transformers_version: str | None = None) -> Match:
    """Match a live signature (or a callable) against the registry; see the module docstring for the rules."""
    sig = _as_signature(sig)
    entries = load_cached()
    live = list(sig.parameters.values())
    for entry in entries:
        if len(live) == len(entry.params) and all(s.matches(p) for s, p in zip(entry.params, live)):
            return _make_match("exact", entry, sig, transformers_version, added=())
    candidates = []
    for entry in entries:
        added = _compatible_additions(entry, live)
        if added is not None:
            candidates.append((len(added), -entries.index(entry), entry, added))
    if candidates:
        _, _, entry, added = min(candidates, key=lambda c: (c[0], c[1]))
        return _make_match("compatible", entry, sig, transformers_version, added=added)
    if not entries:  # only while bootstrapping a registry from scratch
        return Match("unsupported", None, sig, {n: UNKNOWN_ROLE for n in sig.parameters}, "the registry is empty",
                     "unsupported", transformers_version)
    entry = nearest(entries, live, transformers_version)
    return _make_match("unsupported", entry, sig, transformers_version, added=())


def require(sig: inspect.Signature, version: str | None = None) -> Match:
    """``match`` that raises ``SignatureMismatch`` (with the diff and the fix) for an unsupported signature."""
    result = match(sig, version)
    if result.supported:
        return result
    where = f"transformers {version}" if version else "the installed transformers"
    message = (
        f"{FUNCTION} of {where} matches no signature in hfpatch's registry "
        f"(nearest: {result.entry.id}).\n{result.diff}\n"
        f"Fix: pin transformers to a supported release: {supported_releases()}, "
        "or run `hfpatch signatures scan` and open an issue with its output."
    )
    raise SignatureMismatch(
        message,
        transformers_version=version,
        expected=result.entry.id,
        found=format_signature(sig),
        diff=result.diff,
    )


def _as_signature(sig: Any) -> inspect.Signature:
    if isinstance(sig, inspect.Signature):
        return sig
    if callable(sig):
        return inspect.signature(sig)
    raise TypeError(
        f"match(sig=...) needs an inspect.Signature (or a callable), got {type(sig).__name__}; "
        "pass inspect.signature(transformers.modeling_flash_attention_utils._flash_attention_forward)"
    )


def _compatible_additions(entry: SignatureEntry, live: list[inspect.Parameter]) -> tuple[str, ...] | None:
    """Names of the live parameters added to ``entry`` under the compatibility rule, or None if it fails."""
    known = {p.name for p in entry.params}
    added: list[tuple[int, inspect.Parameter]] = []
    j = 0
    for index, param in enumerate(live):
        if j < len(entry.params) and param.name == entry.params[j].name:
            if not entry.params[j].matches(param):
                return None  # kind or default changed
            j += 1
        elif param.name in known:
            return None  # one of the entry's parameters, out of order
        else:
            added.append((index, param))
    if j != len(entry.params) or not added:
        return None  # an entry parameter is missing (removed or renamed)
    required = [i for i, p in enumerate(live) if p.name in known and p.default is _EMPTY and p.kind not in _VAR_KINDS]
    last_required = max(required, default=-1)
    for index, param in added:
        if param.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            return None
        if param.default is _EMPTY or index < last_required:
            return None
    return tuple(p.name for _, p in added)


def nearest(entries: Iterable[SignatureEntry], live: list[inspect.Parameter], version: str | None) -> SignatureEntry:
    """The entry with the most parameters in common (by name and kind, in order); ties go to the entry covering
    ``version``, then to the newest."""
    live_keys = [(p.name, p.kind) for p in live]
    scored = []
    for rank, entry in enumerate(entries):
        keys = [(p.name, p.kind) for p in entry.params]
        ratio = difflib.SequenceMatcher(a=keys, b=live_keys, autojunk=False).ratio()
        covers = bool(version) and _safe_covers(entry, version)
        scored.append((ratio, covers, rank, entry))
    return max(scored, key=lambda s: s[:3])[3]


def _safe_covers(entry: SignatureEntry, version: str) -> bool:
    try:
        return entry.covers(version)
    except InvalidVersion:
        return False


def _make_match(verdict, entry, sig, version, *, added) -> Match:
    # By name: an exact or compatible match has every entry parameter under its own name; anything the entry
    # does not know is "unknown" (for an unsupported match the roles are informative only).
    roles = {name: entry.roles.get(name, UNKNOWN_ROLE) for name in sig.parameters}
    notes = []
    if version and not _safe_covers(entry, version) and verdict != "unsupported":
        notes.append(
            f"transformers {version} is outside the releases where {entry.id} was recorded ({entry.releases}); "
            "the signature decides, so this is only a remark"
        )
    ident = entry.id if verdict == "exact" else f"{entry.id}+{verdict}"
    diff = "" if verdict == "exact" else render_diff(entry, sig, version)
    return Match(verdict, entry, sig, roles, diff, ident, version, tuple(added), tuple(notes))


# ----------------------------------------------------------------------------------------------- diffs


def _default_text(param: inspect.Parameter) -> str:
    value = param.default
    return value.source if isinstance(value, SourceDefault) else repr(value)


def format_signature(sig: inspect.Signature, name: str = "_flash_attention_forward") -> str:
    """``name(a, b, c=None, *, d=1, **kwargs)`` -- annotations left out, defaults as source/repr."""
    parts: list[str] = []
    seen_kw_marker = False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not seen_kw_marker:
            parts.append("*")
            seen_kw_marker = True
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            seen_kw_marker = True
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name if p.default is _EMPTY else f"{p.name}={_default_text(p)}")
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
    return f"{name}({', '.join(parts)})"


def _describe(param: inspect.Parameter, index: int) -> str:
    kind = param.kind.description
    default = "required" if param.default is _EMPTY else f"default {_default_text(param)}"
    if param.kind in _VAR_KINDS:
        default = ""
    return f"{param.name} (index {index}, {kind}{', ' + default if default else ''})"


def render_diff(entry: SignatureEntry, sig: inspect.Signature, version: str | None = None) -> str:
    """Both full definitions and what differs, parameter by parameter (as pluggy's ``_formatdef`` does)."""
    # Shown with each default's recorded source (the 4.43 `deterministic` expression, not one of its values).
    expected = inspect.Signature(
        [
            p.to_parameter().replace(default=SourceDefault(p.default.source))
            if p.default is not None and len(p.default.values) > 1
            else p.to_parameter()
            for p in entry.params
        ]
    )
    live = list(sig.parameters.values())
    wanted = list(expected.parameters.values())
    live_index = {p.name: i for i, p in enumerate(live)}
    wanted_index = {p.name: i for i, p in enumerate(wanted)}
    where = "live"
    header = f"live (transformers {version}):" if version else "live:"
    lines = [
        header.ljust(22) + format_signature(sig),
        f"registry {entry.id}:".ljust(22) + format_signature(expected) + f"  # releases {entry.releases}",
    ]
    changes = []
    for name in [n for n in live_index if n not in wanted_index]:
        changes.append(f"only in {where}: {_describe(live[live_index[name]], live_index[name])}")
    for name in [n for n in wanted_index if n not in live_index]:
        changes.append(f"only in {entry.id}: {_describe(wanted[wanted_index[name]], wanted_index[name])}")
    for spec in entry.params:
        if spec.name not in live_index:
            continue
        param = live[live_index[spec.name]]
        if param.kind != spec.kind:
            changes.append(f"kind changed: {spec.name}: {spec.kind.description} in {entry.id}, {param.kind.description} in {where}")
        elif not spec.matches(param):
            recorded = "required" if spec.default is None else spec.default.source
            found = "required" if param.default is _EMPTY else _default_text(param)
            changes.append(f"default changed: {spec.name}: `{recorded}` in {entry.id}, `{found}` in {where}")
    common_live = [n for n in live_index if n in wanted_index]
    common_wanted = [n for n in wanted_index if n in live_index]
    if common_live != common_wanted:
        changes.append(f"order changed: {entry.id} has {common_wanted}, {where} has {common_live}")
    for name in common_live:
        if live_index[name] != wanted_index[name]:
            changes.append(f"moved: {name}: index {wanted_index[name]} in {entry.id} -> {live_index[name]} in {where}")
    return "\n".join(lines + ["differences:"] + ["  " + c for c in changes])
