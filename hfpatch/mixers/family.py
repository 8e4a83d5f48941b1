"""The record types of the mixer registry: ``MixerFamily`` (one way a release writes a mixer module) and
``Recognised`` (a module the registry matched). The entries themselves live in ``hfpatch.mixers.families``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Tuple

__all__ = ["MixerFamily", "Recognised"]


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
