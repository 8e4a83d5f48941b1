"""The per-call switch: which attention an installed wrapper runs -- the ring, HF's original function, or the
all-gathered reference.

Modes
-----
``"ring"``       ring attention over the CP group (``RING_ATTN_SWITCH=1`` or unset).
``"original"``   the original transformers function on this rank's local tensors (``RING_ATTN_SWITCH=0``).
``"reference"``  all-gather the sequence, run plain (non-CP) attention on all of it, return this rank's slice
                 (``RING_ATTN_SWITCH=reference``): an A/B against the ring on identical inputs.
``"local"``      no CP at all: plain attention on the tensors this call was given, as if they were the whole
                 sequence -- what transformers' flash path computes without a CP group, without needing
                 flash-attn. The whole-model probe and the model sweep run a model's non-CP forward in it (on the
                 whole, unsharded sequence); under sharded inputs it is wrong by design, like ``"original"``.

The state is a process-wide default (set from ``RING_ATTN_SWITCH`` by ``hfpatch.apply``, or by
``set_switch``) under a per-thread override stack (``with switch(mode):``). The dispatcher reads
``current_mode()`` on every call, so a change takes effect at the next attention call; a ``with switch(...)``
block in one thread never changes what another thread runs (like wrapt's per-call ``enabled`` predicate, not a
global flag).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

__all__ = ["ENV_VAR", "MODES", "set_switch", "switch", "current_mode", "mode_from_env"]

ENV_VAR = "RING_ATTN_SWITCH"
MODES = ("ring", "original", "reference", "local")

# What the environment variable (and set_switch/switch, for convenience) accept, mapped to a mode.
_SPELLINGS = {
    "1": "ring",
    "ring": "ring",
    "0": "original",
    "original": "original",
    "reference": "reference",
    "local": "local",
}


class _SwitchState(threading.local):
    """Per-thread override stack (empty: use the process-wide default)."""

    def __init__(self) -> None:
        self.stack: list[str] = []


_default_mode = "ring"
_default_lock = threading.Lock()
_local = _SwitchState()


def _normalise(mode: object, *, argument: str) -> str:
    """``mode`` as one of ``MODES``; anything else raises ``ValueError`` naming ``argument``."""
    key = mode.strip().lower() if isinstance(mode, str) else mode
    if isinstance(key, str) and key in _SPELLINGS:
        return _SPELLINGS[key]
    if isinstance(key, int) and not isinstance(key, bool) and key in (0, 1):
        return "ring" if key == 1 else "original"
    raise ValueError(
        f"{argument}={mode!r} is not a valid switch value; allowed: '1' or 'ring' (ring attention), "
        f"'0' or 'original' (the original transformers function), 'reference' (all-gathered plain attention), 'local' (plain attention on this rank's tensors, no CP). "
        f"Fix: use one of {sorted(_SPELLINGS)}."
    )


def mode_from_env(environ: dict | None = None) -> str:
    """The mode ``RING_ATTN_SWITCH`` asks for (``"ring"`` when unset or empty); a bad value raises
    ``ValueError`` naming the variable, the value and the allowed values."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return "ring"
    return _normalise(raw, argument=ENV_VAR)


def set_switch(mode: str) -> str:
    """Set the process-wide default mode (every thread without a ``with switch(...)`` override); returns the
    previous default. ``mode``: ``"ring"``/``"1"``, ``"original"``/``"0"``, ``"reference"`` or ``"local"``."""
    global _default_mode
    new = _normalise(mode, argument="mode")
    with _default_lock:
        previous, _default_mode = _default_mode, new
    return previous


@contextlib.contextmanager
def switch(mode: str) -> Iterator[str]:
    """Run the block with ``mode`` for this thread only (nests; restored on exit, exceptions included)."""
    new = _normalise(mode, argument="mode")
    _local.stack.append(new)
    try:
        yield new
    finally:
        _local.stack.pop()


def current_mode() -> str:
    """The mode for a call made now by this thread: its innermost override, else the process-wide default."""
    stack = _local.stack
    if stack:
        return stack[-1]
    return _default_mode


class _CallableModule(type(os)):
    """This module's class: calling the module is ``switch(mode)``, so ``with hfpatch.switch("reference"):``
    works while ``hfpatch.switch`` stays this module (a function of the same name in the package namespace would
    shadow the submodule and break ``import hfpatch.switch``)."""

    def __call__(self, mode: str):
        return switch(mode)


import sys as _sys  # noqa: E402  (only for the class swap below)

_sys.modules[__name__].__class__ = _CallableModule
