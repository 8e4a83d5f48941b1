"""Every mixer family the registry knows, one module per family; each module holds the entries of all the
releases it covers.

A family module defines ``FAMILIES`` (its ``MixerFamily`` entries: a release whose forward calls kernels by
global names is an entry with ``bindings``; one whose recurrence is computed inline is an entry with
``replaces``, its CP form written for that release's code, in the module of the same name in
``hfpatch.mixers.forms``) and may define ``KERNEL_PARAMETERS`` (role -> parameter specs of its releases' kernels,
beside ``kernel_parameters.KERNEL_PARAMETERS``). Adding a family or a release: a module here (or an entry in one),
listed in ``_MODULES``.
"""
from __future__ import annotations

from typing import Dict, Mapping, Tuple

from hfpatch.mixers.families import (gated_deltanet, griffin, kimi_delta, kernel_parameters, lightning, mamba,
                                     mamba2, short_conv, zaya)
from hfpatch.mixers.family import MixerFamily

__all__ = ["FAMILIES", "KERNEL_PARAMETERS"]

_MODULES = (short_conv, gated_deltanet, kimi_delta, mamba2, mamba, lightning, griffin, zaya)

FAMILIES: Tuple[MixerFamily, ...] = tuple(family for module in _MODULES for family in module.FAMILIES)


def _merged() -> Mapping[str, Tuple[Tuple[str, ...], ...]]:
    table: Dict[str, Tuple[Tuple[str, ...], ...]] = dict(kernel_parameters.KERNEL_PARAMETERS)
    for module in _MODULES:
        for role, specs in getattr(module, "KERNEL_PARAMETERS", {}).items():
            table[role] = table.get(role, ()) + tuple(s for s in specs if s not in table.get(role, ()))
    return table


KERNEL_PARAMETERS: Mapping[str, Tuple[Tuple[str, ...], ...]] = _merged()
