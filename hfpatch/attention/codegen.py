"""Generate the installed wrapper: a function with exactly the live ``_flash_attention_forward`` signature.

The wrapper is written as Python source, compiled, and its source registered in ``linecache`` under a readable
pseudo-filename (``<hfpatch wrapper S5-4.53.3>``), so tracebacks, ``pdb`` and ``inspect.getsource`` show it.
It does one thing: pass the value of every role (``ROLE_ORDER``; None for a role this release's function does
not have) and the ``**kwargs`` dict to the handler, by position -- no dict to build per call. Example (S4,
abridged)::

    def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length,
                                 is_causal, dropout=_hfpatch_d6, ..., target_dtype=_hfpatch_d17, **kwargs):
        return _hfpatch_handler(
            query_states,  # query
            key_states,  # key
            ...
            None,  # implementation: not a parameter of this release
            ...
            kwargs,  # extra_kwargs
        )

A handler that wants the arguments as ``{role: value}`` is wrapped by ``by_role(match, fn)``; ``role_call``
turns the positional values back into that dict (the roles of the signature only).

Defaults are bound by reference (``_hfpatch_d6`` *is* the original default object, never re-evaluated) and the
annotations are the original objects, so ``inspect.signature(wrapper, follow_wrapped=False) == live``. A
parameter whose role is ``"unknown"`` (added by a compatible release) is checked inline: a non-default value
raises ``UnsupportedArgument`` naming it, instead of being dropped.
"""
from __future__ import annotations

import builtins
import inspect
import itertools
import linecache
from types import FunctionType
from typing import Any, Callable

from hfpatch.errors import PatchError, UnsupportedArgument
from hfpatch.signatures.registry import Match, same_value
from hfpatch.signatures.roles import EXTRA_KWARGS_ROLE, ROLES, UNKNOWN_ROLE

__all__ = ["render", "original_kwargs", "wrapper_source", "ROLE_ORDER", "ABSENT", "role_call", "role_args", "by_role"]

# The positional arguments of a handler, in this order, then the ``**kwargs`` dict (``{}`` for a release without).
ROLE_ORDER: tuple[str, ...] = tuple(role for role in ROLES if role != EXTRA_KWARGS_ROLE)
_INDEX = {role: i for i, role in enumerate(ROLE_ORDER)}


class _Absent:
    """The type of ``ABSENT``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "hfpatch.attention.codegen.ABSENT"


# A role value that ``role_args`` passes for a role its call dict does not hold, and ``role_call`` leaves out.
ABSENT = _Absent()

Handler = Callable[..., Any]  # handler(*<ROLE_ORDER values>, extra_kwargs)

_DEFAULT_NAME = "_flash_attention_forward"
_DEFAULT_MODULE = "transformers.modeling_flash_attention_utils"
_PREFIX = "_hfpatch_"
_counter = itertools.count(2)
P = inspect.Parameter


def render(match: Match, handler: Handler, *, original: Callable | None = None, name: str | None = None) -> FunctionType:
    """Build the wrapper for ``match.signature`` that returns ``handler(*values, extra_kwargs)``, ``values``
    the caller's argument of each role in ``ROLE_ORDER`` (None for a role the signature lacks).

    ``original``: the function being replaced; it becomes ``__wrapped__`` and gives ``__name__``,
    ``__qualname__``, ``__module__`` and ``__doc__``. ``name`` overrides the function name.
    Raises ``PatchError`` for an unsupported match (there is no safe mapping to generate).
    """
    if not isinstance(match, Match):
        raise TypeError(f"render(match=...) needs a hfpatch.signatures.registry.Match, got {type(match).__name__}")
    if not match.supported:
        raise PatchError(
            f"cannot generate a wrapper for an unsupported signature ({match.id}); "
            f"registry.require() explains what differs:\n{match.diff}"
        )
    if not callable(handler):
        raise TypeError(f"render(handler=...) must be callable as handler(*role values, extra_kwargs) (see "
                        f"codegen.by_role for a handler of a role dict), got {handler!r}")
    func_name = name or getattr(original, "__name__", None) or _DEFAULT_NAME
    if not func_name.isidentifier():
        raise ValueError(f"render(name={func_name!r}): a function name must be a Python identifier")
    params = list(match.signature.parameters.values())
    clash = [p.name for p in params if p.name.startswith(_PREFIX)]
    if clash:
        raise PatchError(f"live parameters {clash} use the prefix {_PREFIX!r} reserved for generated code")

    source, namespace = _generate(func_name, params, match)
    namespace["_hfpatch_handler"] = handler
    filename = _register_source(match.id, source)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated source
    wrapper = namespace[func_name]
    _decorate(wrapper, match, original, source)
    return wrapper


def _generate(func_name: str, params: list[inspect.Parameter], match: Match) -> tuple[str, dict]:
    """The wrapper's source and the namespace its names resolve in (defaults, helpers)."""
    namespace: dict[str, Any] = {
        "__builtins__": builtins,
        # No "__name__": torch.compile (Dynamo) imports the module a function's globals name in order to guard on
        # them; a made-up module name fails that import. Without it, Dynamo guards on this dict itself.
        "_hfpatch_differs": _differs,
        "_hfpatch_refuse": _refuse_unknown,
    }
    header: list[str] = []  # one line per parameter (or `*` / `/` marker), without the trailing comma
    checks: list[str] = []
    name_of: dict[str, str] = {}  # role -> parameter name
    extra = "{}"
    star_done = False
    for index, param in enumerate(params):
        role = match.roles[param.name]
        if param.kind is P.VAR_POSITIONAL:
            header.append(f"*{param.name},")
            star_done = True
            checks.append(f"    if {param.name}:\n        raise _hfpatch_refuse({param.name!r}, {param.name}, ())")
            continue
        if param.kind is P.VAR_KEYWORD:
            header.append(f"**{param.name},")
            extra = param.name
            continue
        if param.kind is P.KEYWORD_ONLY and not star_done:
            header.append("*,")
            star_done = True
        if param.default is P.empty:
            if role == UNKNOWN_ROLE:
                raise PatchError(f"parameter {param.name!r} has no role and no default; nothing safe to generate")
            header.append(f"{param.name},")
        else:
            default_name = f"_hfpatch_d{index}"
            namespace[default_name] = param.default  # by reference: the original object, never re-evaluated
            header.append(f"{param.name}={default_name},  # {_short(param.default)}")
            if role == UNKNOWN_ROLE:
                checks.append(_unknown_check(param.name, default_name))
        if role != UNKNOWN_ROLE:
            name_of[role] = param.name
        if param.kind is P.POSITIONAL_ONLY and (
            index + 1 == len(params) or params[index + 1].kind is not P.POSITIONAL_ONLY
        ):
            header.append("/,")
    # One parameter and one role per line: this is the text a traceback or debugger shows.
    lines = [f"def {func_name}("]
    lines += [f"    {text}" for text in header]
    lines += ["):", f"    # generated by hfpatch.attention.codegen for {match.id}: every role by position -> handler"]
    lines += checks
    lines += ["    return _hfpatch_handler("]
    lines += [f"        {name_of[role]},  # {role}" if role in name_of else
              f"        None,  # {role}: not a parameter of this release" for role in ROLE_ORDER]
    lines += [f"        {extra},  # {EXTRA_KWARGS_ROLE}", "    )"]
    source = "\n".join(lines) + "\n"
    return source, namespace


def _short(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def _unknown_check(name: str, default_name: str) -> str:
    # Identity first: the common case (the caller left the default) costs one `is` comparison.
    return (
        f"    if {name} is not {default_name} and _hfpatch_differs({name}, {default_name}):\n"
        f"        raise _hfpatch_refuse({name!r}, {name}, {default_name})"
    )


def _differs(value: Any, default: Any) -> bool:
    return not same_value(value, default)


def _refuse_unknown(name: str, value: Any, default: Any) -> UnsupportedArgument:
    return UnsupportedArgument(
        name,
        value,
        f"this transformers release added the parameter {name!r} (default {default!r}) after hfpatch's registry "
        "entry; hfpatch does not know what it means, so it refuses a non-default value rather than ignore it.",
        "run `hfpatch signatures scan` and open an issue, or set RING_ATTN_SWITCH=0 to use the original "
        "attention for this run.",
    )


def _register_source(match_id: str, source: str) -> str:
    """Register ``source`` in linecache under ``<hfpatch wrapper ID>`` (suffixed when that name already holds
    different source); returns the filename."""
    filename = f"<hfpatch wrapper {match_id}>"
    while filename in linecache.cache and linecache.cache[filename][2] != source.splitlines(True):
        filename = f"<hfpatch wrapper {match_id} #{next(_counter)}>"
    # mtime None: linecache.checkcache() never evicts it (there is no file on disk to compare with).
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return filename


def _decorate(wrapper: FunctionType, match: Match, original: Callable | None, source: str) -> None:
    sig = match.signature
    annotations = {p.name: p.annotation for p in sig.parameters.values() if p.annotation is not P.empty}
    if sig.return_annotation is not inspect.Signature.empty:
        annotations["return"] = sig.return_annotation
    wrapper.__annotations__ = annotations  # the original objects, so the signatures compare equal
    wrapper.__module__ = getattr(original, "__module__", None) or _DEFAULT_MODULE
    wrapper.__qualname__ = getattr(original, "__qualname__", None) or wrapper.__name__
    if wrapper.__name__ != getattr(original, "__name__", wrapper.__name__):
        wrapper.__qualname__ = wrapper.__name__  # an explicit name= wins over the original's qualname
    wrapper.__doc__ = (
        f"hfpatch wrapper ({match.id}): maps the arguments of {wrapper.__name__} by role and calls the "
        "hfpatch handler. Source: hfpatch.attention.codegen.wrapper_source(fn); original: fn.__wrapped__."
    )
    if original is not None:
        wrapper.__wrapped__ = original
    wrapper.__hfpatch_source__ = source
    wrapper.__hfpatch_id__ = match.id


def original_kwargs(match: Match, call: dict, extra: dict) -> dict:
    """Map a canonical ``call`` (and the extra ``**kwargs``) back to the live parameter names, so a dispatcher
    can re-invoke the original function as ``original(**original_kwargs(match, call, extra))``.

    Roles absent from ``call`` are left out (the original applies its own default); so are "unknown"
    parameters (the wrapper only lets them through at their default).
    """
    out: dict[str, Any] = {}
    has_var_keyword = False
    for param in match.signature.parameters.values():
        role = match.roles.get(param.name, UNKNOWN_ROLE)
        if param.kind is P.VAR_KEYWORD:
            has_var_keyword = True
            continue
        if role in (UNKNOWN_ROLE, EXTRA_KWARGS_ROLE) or role not in call:
            continue
        if param.kind is P.POSITIONAL_ONLY:
            raise PatchError(f"parameter {param.name!r} is positional-only; it cannot be passed back by keyword")
        out[param.name] = call[role]
    if extra:
        if not has_var_keyword:
            raise PatchError(f"extra keyword arguments {sorted(extra)} given, but {match.id} has no **kwargs")
        clash = sorted(set(extra) & set(out))
        if clash:
            raise PatchError(f"extra keyword arguments {clash} collide with named parameters of {match.id}")
        out.update(extra)
    return out


def wrapper_source(fn: Callable) -> str:
    """The generated source of a hfpatch wrapper (``TypeError`` for anything else)."""
    source = getattr(fn, "__hfpatch_source__", None)
    if source is None:
        raise TypeError(f"{fn!r} is not a wrapper generated by hfpatch.attention.codegen.render (no __hfpatch_source__)")
    return source


def role_call(match: Match, values: tuple) -> dict:
    """``{role: value}`` of the roles ``match``'s signature has, from a handler's positional ``values``
    (``ROLE_ORDER``); an ``ABSENT`` value is left out."""
    return {role: values[_INDEX[role]] for role in _roles_of(match) if values[_INDEX[role]] is not ABSENT}


def role_args(call: dict) -> tuple:
    """A handler's positional values (``ROLE_ORDER``) from ``{role: value}``; ``ABSENT`` for a role not given."""
    return tuple(call.get(role, ABSENT) for role in ROLE_ORDER)


def by_role(match: Match, fn: Callable[[dict, dict], Any]) -> Handler:
    """A handler for ``render`` that calls ``fn(call, extra_kwargs)`` with ``call = role_call(match, values)``."""
    if not callable(fn):
        raise TypeError(f"by_role(fn=...) must be callable as fn(call, extra_kwargs), got {fn!r}")

    def handler(*values):
        return fn(role_call(match, values[:-1]), values[-1])

    handler.__name__ = handler.__qualname__ = f"by_role({getattr(fn, '__name__', type(fn).__name__)})"
    return handler


def _roles_of(match: Match) -> tuple:
    """The roles of ``match``'s signature, in ``ROLE_ORDER`` (cached on the match's identity)."""
    found = _ROLES_OF.get(id(match))
    if found is None or found[0] is not match:
        present = set(match.roles.values())
        found = _ROLES_OF[id(match)] = (match, tuple(role for role in ROLE_ORDER if role in present))
    return found[1]


_ROLES_OF: dict = {}  # id(match) -> (match, roles); the match is kept, so its id is not reused while cached
