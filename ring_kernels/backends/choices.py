"""Which block backend computes which blocks, and why: a process-wide record, logged once per new choice.

Every resolution of a backend (``get_backend``, ``varlen_kernel_for``) and every fallback a backend takes inside
itself (``torch_cuda``'s repeated K/V heads when an op refuses grouped-query attention) is noted here under its
*shape class* (device type, dtype, head dim, block mask kind, softcap on/off) and its reason:

- ``choices()`` lists them (``BackendChoice``: backend, requested, reason, shape class, calls), in the order
  they were first made; ``reset_choices()`` clears the record (and the "already logged" memory);
- ``recording()`` collects the choices made inside a ``with`` block (a benchmark row's backends);
- the first time a (requested, backend, shape class, reason) is seen it is logged on the ``ring_kernels.backends``
  logger: INFO for a choice, WARNING for a fallback (with the exception text that caused it).

Noting a choice already seen costs one dict lookup and a counter increment, so it is done on every call.
A mask kind ``general`` means the blocks need a mask tensor: a sliding window, document (varlen) masks or
causal blocks whose query and key positions are offset.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["BackendChoice", "ChoiceRecorder", "choices", "reset_choices", "recording", "note", "shape_class"]

logger = logging.getLogger("ring_kernels.backends")


@dataclass(frozen=True)
class BackendChoice:
    """One choice: ``backend`` computes blocks of ``shape_class`` because of ``reason``.

    ``requested``: what the caller asked for (``"auto"`` or a backend name); ``calls``: how many calls made this
    choice since it was first noted (or since ``reset_choices``); ``fallback``: True when the backend changed
    how it computes after an error (logged at WARNING).
    """

    backend: str
    requested: str
    reason: str
    shape_class: str
    calls: int = 0
    fallback: bool = False

    def as_dict(self) -> dict:
        return {"backend": self.backend, "requested": self.requested, "reason": self.reason,
                "shape_class": self.shape_class, "calls": self.calls, "fallback": self.fallback}


def shape_class(device_type: str, dtype: torch.dtype, head_dim: int, mask_kind: str, softcap: bool) -> str:
    """A readable shape class, e.g. ``"cuda bfloat16 head_dim=128 mask=causal softcap"``."""
    name = str(dtype).replace("torch.", "")
    return f"{device_type} {name} head_dim={head_dim} mask={mask_kind}" + (" softcap" if softcap else "")


class _Entry:
    __slots__ = ("backend", "requested", "reason", "shape_class", "fallback", "calls")

    def __init__(self, backend, requested, reason, shape, fallback):
        self.backend, self.requested, self.reason, self.shape_class = backend, requested, reason, shape
        self.fallback, self.calls = fallback, 0

    def snapshot(self, calls: Optional[int] = None) -> BackendChoice:
        return BackendChoice(self.backend, self.requested, self.reason, self.shape_class,
                             self.calls if calls is None else calls, self.fallback)


class ChoiceRecorder:
    """The choices noted while a ``recording()`` block was open, with the calls made inside it."""

    def __init__(self) -> None:
        self._calls: Dict[_Entry, int] = {}

    def _add(self, entry: _Entry) -> None:
        self._calls[entry] = self._calls.get(entry, 0) + 1

    def choices(self) -> List[BackendChoice]:
        return [entry.snapshot(calls) for entry, calls in self._calls.items()]

    def backends(self) -> List[str]:
        """The distinct backends that were chosen inside the block, in first-seen order."""
        return list(dict.fromkeys(entry.backend for entry in self._calls))


_ENTRIES: Dict[tuple, _Entry] = {}     # key (hashable, cheap to build) -> entry; insertion order = first seen
_RECORDERS: List[ChoiceRecorder] = []
_LOCK = threading.Lock()


def note(key: tuple, describe: Callable[[], Tuple[str, str, str, str]], *, fallback: bool = False) -> None:
    """Count one call of the choice identified by ``key``; the first time, ``describe()`` gives its
    ``(backend, requested, reason, shape class)`` and the choice is logged.

    ``key`` must determine the description (callers build it from the inputs of the decision), so the
    strings are formatted once per choice, not once per call.
    """
    entry = _ENTRIES.get(key)
    if entry is None:
        entry = _new_entry(key, describe, fallback)
    entry.calls += 1
    if _RECORDERS:
        for recorder in _RECORDERS:
            recorder._add(entry)


def _new_entry(key: tuple, describe, fallback: bool) -> _Entry:
    with _LOCK:
        entry = _ENTRIES.get(key)
        if entry is not None:
            return entry
        backend, requested, reason, shape = describe()
        entry = _ENTRIES[key] = _Entry(backend, requested, reason, shape, fallback)
    if fallback:
        logger.warning("ring_kernels: backend %s falls back for %s: %s", backend, shape, reason)
    else:
        logger.info("ring_kernels: backend=%r -> %s for %s: %s", requested, backend, shape, reason)
    return entry


def choices() -> List[BackendChoice]:
    """Every choice noted in this process (since the start or ``reset_choices()``), first seen first."""
    with _LOCK:
        return [entry.snapshot() for entry in _ENTRIES.values()]


def reset_choices() -> None:
    """Forget every choice (each is logged again when next made). Open ``recording()`` blocks keep theirs."""
    with _LOCK:
        _ENTRIES.clear()


@contextlib.contextmanager
def recording() -> Iterator[ChoiceRecorder]:
    """``with recording() as rec: ...``: ``rec.choices()`` / ``rec.backends()`` are the choices made inside."""
    recorder = ChoiceRecorder()
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.remove(recorder)
