"""How everything hfpatch installs is taken out again: one protocol, one undo stack, one wrapper marker.

Every installer returns one object with ``remove()`` (a ``Removable``):

=============================================  ============================================================
``attention.patcher.install``                  ``patcher.Installation`` (every binding site, the import hook)
``model.routing.route_model``                  ``routing.ModelRouting`` (configs, classes, injected names)
``model.positions.install``                    ``UndoStack`` of the position modules' hooks
``mixers.install_mixers``                      ``mixers.MixerInstallation`` (rebound kernels, replaced methods)
``attention.dispatch.Dispatcher.track``        ``UndoStack`` of the model's forward hooks
``model.labels.install_labels_hook``           ``UndoStack`` of the model's forward hooks
``model.inputs_guard.install_inputs_guard``    ``UndoStack`` of the model's forward pre-hook
=============================================  ============================================================

``UndoStack`` is ``contextlib.ExitStack``'s idea for installations: ``push`` records what was installed (and
returns it, typed, for the caller to keep), ``callback`` records a function that undoes something, and ``remove()``
undoes them newest first. Removal is all-or-nothing in the one way it can be: every part is removed even when
another part's ``remove()`` raises; then ``RemovalFailed`` names each failure (its cause is the one exception, or
an ``ExceptionGroup`` of them). Removing restores exactly what was there; a second ``remove()`` raises
``AlreadyRemoved`` (a no-op would hide a double-remove bug). ``Patch`` holds its parts in one ``UndoStack``.

``AllOrNothing`` is an ``UndoStack`` for the install itself, used as a context manager::

    with AllOrNothing("hfpatch") as undo:
        undo.push(install_one(), "the first part")
        undo.push(install_two(), "the second part")   # raises: the first part is undone, the error propagates
        patch.undo = undo.pop_all()                   # installed: the owner now holds both parts

Leaving the block undoes every step still recorded, newest first: all of them when the block raised, none after
``pop_all()``, which hands them to the object that owns them from then on. That rollback is quiet: a step that
fails to undo is logged on the ``hfpatch`` logger, never raised, so that the error the caller sees is the one that
made the install fail (a ``KeyboardInterrupt`` or ``SystemExit`` from a step still propagates, after every step
ran). The error that left the block propagates unchanged.

Functions hfpatch installs in place of someone else's (the attention wrapper, the mixer kernels' wrappers and
method replacements, routing's ``get_target_dtype`` guard) carry one marker, ``mark_wrapper``; ``is_wrapper``
lets an install recognise a wrapper left behind by a patch that was not removed cleanly.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Protocol, TypeVar, runtime_checkable

from hfpatch.errors import AlreadyRemoved, RemovalFailed

__all__ = ["Removable", "UndoStack", "AllOrNothing", "WRAPPER_MARK", "mark_wrapper", "is_wrapper"]

logger = logging.getLogger("hfpatch")


@runtime_checkable
class Removable(Protocol):
    """What an installer returns: ``remove()`` restores exactly what was there; a second call raises."""

    def remove(self) -> None: ...


R = TypeVar("R", bound=Removable)
F = TypeVar("F", bound=Callable[..., Any])


class _Callback:
    """A function that undoes one change, as a ``Removable``."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self.function = function

    def remove(self) -> None:
        self.function()


class UndoStack:
    """Installed parts, in the order they were installed; ``remove()`` undoes them newest first (module
    docstring). ``what`` names the whole in error messages ("hfpatch", "the labels hook of LlamaForCausalLM")."""

    def __init__(self, what: str, *parts: Removable) -> None:
        self.what = what
        self.removed = False
        self._parts: list[tuple[str, Removable]] = []
        for part in parts:
            self.push(part)

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self._parts)} parts"
        return f"<hfpatch.{type(self).__name__} {self.what}: {state}>"

    def __len__(self) -> int:
        return len(self._parts)

    def push(self, part: R, label: Optional[str] = None) -> R:
        """Record ``part`` (removed before everything pushed earlier); returns it. ``label`` names it in errors."""
        if self.removed:
            raise AlreadyRemoved(f"{self.what} was already removed; {label or _label(part)} was installed after that "
                                 "and would never be removed. Fix: install it before removing, or apply again.",
                                 what=self.what)
        self._parts.append((label or _label(part), part))
        return part

    def callback(self, function: Callable[[], Any], label: Optional[str] = None) -> None:
        """Record ``function()`` as the undo of a change made just before."""
        self.push(_Callback(function), label or getattr(function, "__qualname__", repr(function)))

    def remove(self) -> None:
        """Remove every part, newest first, each even if another raised; then raise ``RemovalFailed`` naming every
        failure. A second call raises ``AlreadyRemoved``."""
        if self.removed:
            raise AlreadyRemoved(f"{self.what} was already removed; remove() is not idempotent (a second call would "
                                 "hide a double-remove bug). Fix: remove it once.", what=self.what)
        self.removed = True
        failures: list[tuple[str, BaseException]] = []
        while self._parts:
            label, part = self._parts.pop()
            try:
                part.remove()
            except BaseException as exc:  # every part is removed; the failures are raised together below
                failures.append((label, exc))
        if failures:
            _raise_failures(self.what, failures)


class AllOrNothing(UndoStack):
    """An install as a context manager (module docstring): the steps recorded inside the ``with`` block are undone,
    newest first and quietly, when the block is left before ``pop_all()`` hands them over; the block's error
    propagates unchanged."""

    def __enter__(self) -> "AllOrNothing":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.removed or not self._parts:
            return
        try:
            self.remove()
        except Exception:  # logged, not raised: the error the caller sees is the one that made the install fail
            logger.exception("hfpatch: undoing a failed install of %s also failed", self.what)

    def pop_all(self) -> UndoStack:
        """Every step recorded so far, in install order, as a new ``UndoStack`` of the same name for the object that
        owns them to ``remove()``; this one is left empty, so leaving the block undoes nothing of them."""
        if self.removed:
            raise AlreadyRemoved(f"{self.what} was already undone; there is nothing left to hand over. Fix: call "
                                 "pop_all() before the install is undone.", what=self.what)
        kept = UndoStack(self.what)
        kept._parts, self._parts = self._parts, []
        return kept


def _label(part: Any) -> str:
    return type(part).__name__


def _raise_failures(what: str, failures: list[tuple[str, BaseException]]) -> None:
    interrupt = next((exc for _, exc in failures if not isinstance(exc, Exception)), None)
    if interrupt is not None:  # KeyboardInterrupt, SystemExit: still what the caller must see, once all ran
        raise interrupt
    listed = "; ".join(f"{label}: {type(exc).__name__}: {exc}" for label, exc in failures)
    error = RemovalFailed(f"{what} was removed, but not cleanly (every other part was removed): {listed}",
                          what=what, failures=failures)
    if len(failures) == 1:
        raise error from failures[0][1]
    raise error from ExceptionGroup(f"{len(failures)} parts of {what} failed to remove", [exc for _, exc in failures])


# --------------------------------------------------------------------------------------------- the marker

WRAPPER_MARK = "__hfpatch_wrapper__"


def mark_wrapper(function: F) -> F:
    """Mark ``function`` as installed by hfpatch in place of another; returns it."""
    setattr(function, WRAPPER_MARK, True)
    return function


def is_wrapper(value: Any) -> bool:
    """Whether ``value`` (a function, or a method bound from one) was marked by ``mark_wrapper``."""
    return getattr(value, WRAPPER_MARK, False) is True
