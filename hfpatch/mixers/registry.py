"""The versioned registry of sequence-mixer modules hfpatch runs exactly under CP.

A mixer module is recognised the way ``_flash_attention_forward`` is: by what hfpatch relies on, never by name
alone. For a module of class C defined in modeling module M, an entry of ``FAMILIES`` recognises it when

1. C's name is one of the entry's ``classes`` (the entries live in ``hfpatch.mixers.families``, one module per
   family; several entries may list C, one per way its releases write it);
2. the fingerprint of C's ``forward`` (``family.forward_fingerprint``: a hash of its syntax tree written by one
   fixed rule, decorators dropped, so formatting, comments and the Python minor do not count) is one the family
   lists -- the forward calls the kernels below by these global names with these arguments, and nothing else in
   it mixes tokens;
3. each of the family's ``bindings`` (global name in M -> kernel role) exists in M, and the parameters of the
   function bound there (``parameter_spec``) are one of the role's ``KERNEL_PARAMETERS``.

Anything else of a mixer-like class (another release's forward, a renamed kernel, a changed kernel signature)
is not recognised: ``recognise`` returns None and ``unrecognised_reason`` says which check failed, and the audit
refuses the module by name. Adding a release: run ``forward_fingerprint`` on the new class, read the forward to
check that it still calls the kernels the same way, add the fingerprint (with the releases it covers) and prove it
with the family's test on that release.
"""
from __future__ import annotations

import inspect
import sys
from typing import Callable, Dict, Optional, Tuple

import torch

from hfpatch.mixers.families import FAMILIES, KERNEL_PARAMETERS
from hfpatch.mixers.family import MixerFamily, Recognised, forward_fingerprint

__all__ = ["MixerFamily", "Recognised", "FAMILIES", "KERNEL_PARAMETERS", "recognise", "unrecognised_reason",
           "forward_fingerprint", "class_fingerprint", "parameter_spec"]

_BY_CLASS: Dict[str, Tuple[MixerFamily, ...]] = {}
for _family in FAMILIES:
    for _name in _family.classes:
        _BY_CLASS[_name] = _BY_CLASS.get(_name, ()) + (_family,)


def parameter_spec(function: Callable) -> Tuple[str, ...]:
    """The parameters of ``function`` (its signature, following ``__wrapped__``): names with ``*``/``**`` and
    ``=default`` for defaults, annotations left out."""
    spec = []
    for p in inspect.signature(function).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        default = "" if p.default is inspect.Parameter.empty else f"={p.default!r}"
        spec.append(f"{prefix}{p.name}{default}")
    return tuple(spec)


def class_fingerprint(cls: type, family: MixerFamily) -> str:
    """``forward_fingerprint`` of ``cls.forward``, joined by "+" with those of the other methods ``family``
    replaces (``MixerFamily.replaces``), in that order."""
    methods = ["forward"] + [name for name, _ in family.replaces if name != "forward"]
    return "+".join(forward_fingerprint(getattr(cls, name)) for name in methods)


def _family_of(cls: type) -> Tuple[Optional[MixerFamily], str]:
    """The entry whose fingerprint matches ``cls`` among those listing its name, or None and why not."""
    families = _BY_CLASS.get(cls.__name__)
    if families is None:
        return None, f"{cls.__name__} is not a mixer class hfpatch's mixer registry knows"
    seen = []
    for family in families:
        if any(not hasattr(cls, method) for method, _ in family.replaces):
            continue  # an entry for releases whose class has a method this one lacks
        try:
            fingerprint = class_fingerprint(cls, family)
        except (OSError, TypeError, StopIteration, SyntaxError) as exc:
            return None, f"the source of {cls.__name__}.forward cannot be read ({type(exc).__name__})"
        if fingerprint in family.forwards:
            return family, ""
        seen.append(fingerprint)
    known = "; ".join(release for family in families for release in family.forwards.values())
    if not seen:
        return None, (f"{cls.__name__} lacks a method every {families[0].name} entry replaces (known: {known})")
    return None, (f"{cls.__name__}.forward (fingerprint {' / '.join(dict.fromkeys(seen))}) is not a forward hfpatch "
                  f"has read and tested for the {families[0].name} family (known: {known})")


def _check(module: torch.nn.Module) -> Tuple[Optional[Recognised], str]:
    cls = type(module)
    family, why = _family_of(cls)
    if family is None:
        return None, why
    source = family.replaces[0][1].__module__ if family.replaces else cls.__module__
    modeling = sys.modules.get(source)
    for name, role in family.bindings:
        function = getattr(modeling, name, None) if modeling is not None else None
        if not callable(function):
            return None, f"{source} has no function {name} (the {role} kernel its forward calls)"
        try:
            spec = parameter_spec(function)
        except (TypeError, ValueError):
            return None, f"{source}.{name} has no readable signature"
        if spec not in KERNEL_PARAMETERS[role]:
            return None, (f"{source}.{name}{spec} does not have the parameters hfpatch's {role} kernel "
                          f"expects {KERNEL_PARAMETERS[role][0]}")
    for path, child in module.named_modules():  # a recognised module's mixers run inside it: they must be too
        if path and type(child).__name__ in _BY_CLASS:
            inner, why = _check(child)
            if inner is None:
                return None, f"its submodule {path} is not recognised: {why}"
    return Recognised(family, modeling), ""


def recognise(module: torch.nn.Module) -> Optional[Recognised]:
    """The registry's verdict on ``module``: ``Recognised`` (hfpatch runs it exactly under CP) or None."""
    return _check(module)[0]


def unrecognised_reason(module: torch.nn.Module) -> str:
    """Why ``recognise(module)`` is None, in one sentence ("" when it is recognised)."""
    return _check(module)[1]
