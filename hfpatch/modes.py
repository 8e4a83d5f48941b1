"""The per-call switch: which attention an installed wrapper runs -- the ring, HF's original function, or the
all-gathered reference.

Modes
-----
``"ring"``       ring attention over the CP group (``RING_ATTN_SWITCH=1`` or unset).
``"original"``   no CP: what the model's own attention computes on this rank's local tensors
                 (``RING_ATTN_SWITCH=0``): transformers' original flash function where it can run (flash-attn
                 installed, a non-CPU query), else the same plain attention as ``"local"`` (the model's SDPA/eager
                 result on those tensors). Counted under ``"original"`` either way.
``"reference"``  all-gather the sequence, run plain (non-CP) attention on all of it, return this rank's slice
                 (``RING_ATTN_SWITCH=reference``): an A/B against the ring on identical inputs.
``"local"``      no CP at all: plain attention on the tensors this call was given, as if they were the whole
                 sequence -- what transformers' flash path computes without a CP group, without needing
                 flash-attn. For whole, unsharded sequences: the whole-model probe and the model sweep run a
                 model's non-CP forward in it. On this rank's shard of a ``shard_inputs`` step (a query of the
                 step's local length, shorter than the global one) it attends within the shard only -- not the
                 non-CP computation -- and the dispatcher logs a warning on the ``hfpatch`` logger, once per patch.

The state is a process-wide default under a per-thread override stack (``with switch(mode):``). The default is
set by ``set_switch`` and follows ``RING_ATTN_SWITCH``: ``hfpatch.apply`` reads it (``follow_env``), and every step
boundary reads it again (``refresh_from_env``: ``patch.shard_inputs``, the drop-ins' ``update_*_params`` and each
forward start of the model given to ``apply(model=)``), so that flipping ``os.environ["RING_ATTN_SWITCH"]`` between
steps A/Bs a suspicious loss curve. A step boundary changes the default only when the variable's mode changed since
it was last read, so a ``set_switch`` made after that stands until the variable changes. The variable is never read
per attention call: an ``os.environ`` read is a measurable share of hfpatch's per-call time
(``benchmarks/results/patched_call_overhead_cpu_switch_env_read_aa11d93.txt``). A change takes effect at the next
attention call; a ``with switch(...)`` block in one thread never changes what another thread runs (like wrapt's
per-call ``enabled`` predicate, not a global flag).

``switch`` is the one ``Switch``: called, the per-thread override; its methods, the rest (``set_switch``,
``current_mode``, ``thread_mode``, ``mode_from_env``, ``refresh_from_env``, ``follow_env``), also bound here as
functions. The package exports it as ``hfpatch.switch``, and ``patch.switch`` is the same object. Each thread's
mode is one ``ThreadMode`` whose ``mode`` attribute the switch keeps current, so that the dispatcher reads it with
one attribute access per call (``thread_mode()``, the public per-thread accessor).
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Callable, Iterator, Mapping, Optional

__all__ = ["ENV_VAR", "MODES", "Switch", "ThreadMode", "switch", "set_switch", "current_mode", "thread_mode",
           "mode_from_env", "refresh_from_env", "follow_env"]

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
        f"'0' or 'original' (the model's own attention on this rank's tensors), 'reference' (all-gathered plain "
        f"attention), 'local' (plain attention on the tensors given, as a whole sequence, no CP). "
        f"Fix: use one of {sorted(_SPELLINGS)}."
    )


def mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The mode ``RING_ATTN_SWITCH`` asks for (``"ring"`` when unset or empty); a bad value raises
    ``ValueError`` naming the variable, the value and the allowed values."""
    env = os.environ if environ is None else environ
    return _mode_of(env.get(ENV_VAR))


def _mode_of(raw: Optional[str]) -> str:
    if raw is None or raw.strip() == "":
        return "ring"
    return _normalise(raw, argument=ENV_VAR)


_UNREAD = object()  # the raw value of a variable not read yet (never equal to a string or None)


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
        # (raw value, mode) of RING_ATTN_SWITCH as the default last followed it: one tuple, replaced whole.
        self._env: tuple = (_UNREAD, self._default)
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
            return self._set_default(new)

    def _set_default(self, new: str) -> str:
        """Under the lock: make ``new`` the default of every thread without an override; the previous default."""
        previous, self._default = self._default, new
        for state in self._threads:
            if not state.overrides:
                state.mode = new
        return previous

    def refresh_from_env(self, environ: Mapping[str, str] | None = None) -> Optional[str]:
        """A step boundary: read ``RING_ATTN_SWITCH`` (from ``environ``, default ``os.environ``) and, when its mode
        differs from the mode it had when last read (by ``follow_env`` or here), make it the process-wide default.
        Returns the new default, or None when nothing changed. A bad value raises ``ValueError`` (naming the
        variable, the value and the allowed values) and changes nothing, so every later boundary raises it again
        until the variable is fixed. Unchanged, it costs one ``os.environ`` read and one comparison."""
        raw = (os.environ if environ is None else environ).get(ENV_VAR)
        seen = self._env
        if raw == seen[0]:
            return None
        new = _mode_of(raw)
        with self._lock:
            changed = new != self._env[1]
            self._env = (raw, new)
            if changed:
                self._set_default(new)
        return new if changed else None

    def follow_env(self, mode: str) -> Callable[[], None]:
        """Make ``mode`` -- what ``mode_from_env()`` read, at ``hfpatch.apply`` -- the process-wide default and the
        mode step boundaries compare ``RING_ATTN_SWITCH`` with (``refresh_from_env``). Returns the undo: it restores
        the previous default and the previous reading."""
        new = _normalise(mode, argument="mode")
        with self._lock:
            before = (self._default, self._env)
            self._env = (_UNREAD, new)  # the next boundary parses the variable again, and follows it if it moved
            self._set_default(new)

        def restore() -> None:
            with self._lock:
                self._env = before[1]
                self._set_default(before[0])

        return restore

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
refresh_from_env = switch.refresh_from_env
follow_env = switch.follow_env
