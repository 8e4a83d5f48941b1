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
``set_switch``) under a per-thread override stack (``with switch(mode):``). A change takes effect at the next
attention call; a ``with switch(...)`` block in one thread never changes what another thread runs (like wrapt's
per-call ``enabled`` predicate, not a global flag).

``switch`` is the one ``Switch``: called, the per-thread override; its methods, the rest (``set_switch``,
``current_mode``, ``thread_mode``, ``mode_from_env``), also bound here as functions. The package exports it as
``hfpatch.switch``, and ``patch.switch`` is the same object. Each thread's mode is one ``ThreadMode`` whose ``mode``
attribute the switch keeps current, so that the dispatcher reads it with one attribute access per call
(``thread_mode()``, the public per-thread accessor).
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Iterator

__all__ = ["ENV_VAR", "MODES", "Switch", "ThreadMode", "switch", "set_switch", "current_mode", "thread_mode",
           "mode_from_env"]

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


class ThreadMode:
    """The switch as one thread sees it.

    mode:       the mode a call this thread makes now runs: its innermost override, else the process-wide
                default. ``Switch`` keeps it current (under its lock); a reader needs no lock.
    overrides:  the thread's ``with switch(...)`` modes, innermost last.
    """

    __slots__ = ("mode", "overrides", "__weakref__")

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.overrides: list[str] = []

    def __repr__(self) -> str:
        return f"<ThreadMode {self.mode!r} overrides={self.overrides}>"


class _PerThread(threading.local):
    """``.state``: this thread's ``ThreadMode``, registered with the switch on the thread's first read."""

    def __init__(self, owner: "Switch") -> None:
        self.state = owner._register()


class Switch:
    """Which attention the installed wrappers run. ``with switch(mode):`` runs the block with ``mode`` for this
    thread only (nests; restored on exit, exceptions included); ``set_switch(mode)`` sets the process-wide default.
    ``mode``: ``"ring"``/``"1"``, ``"original"``/``"0"``, ``"reference"`` or ``"local"``."""

    ENV_VAR = ENV_VAR
    MODES = MODES
    mode_from_env = staticmethod(mode_from_env)

    def __init__(self, default: str = "ring") -> None:
        self._default = _normalise(default, argument="default")
        self._lock = threading.Lock()  # the default and every thread's ``mode`` change together under it
        self._threads: "weakref.WeakSet[ThreadMode]" = weakref.WeakSet()  # a thread's state goes with the thread
        self._local = _PerThread(self)

    def _register(self) -> ThreadMode:
        with self._lock:
            state = ThreadMode(self._default)
            self._threads.add(state)
        return state

    @contextlib.contextmanager
    def __call__(self, mode: str) -> Iterator[str]:
        """Run the block with ``mode`` for this thread only (see the class docstring); yields the mode."""
        new = _normalise(mode, argument="mode")
        state = self._local.state
        with self._lock:
            state.overrides.append(new)
            state.mode = new
        try:
            yield new
        finally:
            with self._lock:
                state.overrides.pop()
                state.mode = state.overrides[-1] if state.overrides else self._default

    def set_switch(self, mode: str) -> str:
        """Set the process-wide default mode (every thread without a ``with switch(...)`` override); returns the
        previous default."""
        new = _normalise(mode, argument="mode")
        with self._lock:
            previous, self._default = self._default, new
            for state in self._threads:
                if not state.overrides:
                    state.mode = new
        return previous

    def current_mode(self) -> str:
        """The mode for a call made now by this thread: its innermost override, else the process-wide default."""
        return self._local.state.mode

    def thread_mode(self) -> ThreadMode:
        """This thread's ``ThreadMode`` (the same object for the thread's life): its ``mode`` is
        ``current_mode()``, kept current by this switch, for a reader that holds it (the dispatcher, per call)."""
        return self._local.state

    def __repr__(self) -> str:
        return f"<hfpatch.switch: default {self._default!r}, this thread {self.current_mode()!r}>"


switch = Switch()
set_switch = switch.set_switch
current_mode = switch.current_mode
thread_mode = switch.thread_mode
