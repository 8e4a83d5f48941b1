"""Every error hfpatch raises, in one module, and the undo protocol whose failures they report.

Each class subclasses the builtin a caller already catches (``TypeError`` for a signature that does not fit,
``ValueError`` for an argument ring attention cannot honour, ``RuntimeError`` for a failed patch), and carries
the facts as fields so that code can act on them without parsing the message. Messages say where, what was
expected, what was found, and the fix.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, TypeVar, runtime_checkable

__all__ = [
    "HfpatchError",
    "SignatureMismatch",
    "UnsupportedArgument",
    "PatchError",
    "VerificationError",
    "RingNotReached",
    "AlreadyRemoved",
    "RemovalFailed",
    "SitesRebound",
    "UnsupportedRelease",
    "UnsupportedModel",
    "ModelDivergence",
    "InvalidReleaseSpec",
    "ScanError",
    "WheelFetchError",
    "ModuleNameTaken",
    "Removable", "UndoStack", "WRAPPER_MARK", "mark_wrapper", "is_wrapper",
]


def _short_repr(value: Any, limit: int = 80) -> str:
    """A one-line description of ``value``: tensors by shape and dtype (never their data), others by repr, or by
    class name where the repr itself fails (some cache objects cannot print themselves)."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__}(shape={tuple(shape)}, dtype={dtype})"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 -- an error message must not fail on the value it describes
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HfpatchError(Exception):
    """Base class of every hfpatch error."""


class SignatureMismatch(HfpatchError, TypeError):
    """The live ``_flash_attention_forward`` matches no registry entry (not even as a compatible extension).

    Fields: ``transformers_version`` (str or None), ``expected`` (id of the nearest registry entry),
    ``found`` (the live signature as text), ``diff`` (readable: both definitions and what differs).
    """

    def __init__(
        self,
        message: str,
        *,
        transformers_version: str | None = None,
        expected: str | None = None,
        found: str | None = None,
        diff: str | None = None,
    ) -> None:
        super().__init__(message)
        self.transformers_version = transformers_version
        self.expected = expected
        self.found = found
        self.diff = diff


class UnsupportedArgument(HfpatchError, ValueError):
    """A caller passed a value that ring attention cannot honour (a padding mask, a KV cache, an unknown
    parameter set to a non-default value, ...). It is refused loudly rather than dropped.

    Fields: ``parameter`` (the parameter name as the caller spelled it), ``value``, ``reason``, ``fix``.
    """

    def __init__(self, parameter: str, value: Any, reason: str, fix: str | None = None) -> None:
        self.parameter = parameter
        self.value = value
        self.reason = reason
        self.fix = fix
        message = f"{parameter}={_short_repr(value)}: {reason}"
        if fix:
            message += f" Fix: {fix}"
        super().__init__(message)


class PatchError(HfpatchError, RuntimeError):
    """Installing or removing the patch failed (nothing is left half-installed when this is raised by apply)."""


class VerificationError(PatchError):
    """The patch was installed but a check (identity at every site, numeric probe, layer count) failed."""


class AlreadyRemoved(PatchError):
    """``remove()`` of something hfpatch installed, called a second time: an error, not a no-op, because a second
    call hides a double-remove bug. Field: ``what`` (what had been removed)."""

    def __init__(self, message: str, *, what: str) -> None:
        super().__init__(message)
        self.what = what


class RemovalFailed(PatchError):
    """Removing an installation failed at one or more of its parts; every other part was still removed.

    Fields: ``what`` (the installation), ``failures`` (list of (part, exception), in the order they were removed:
    newest first). Its cause is the one exception, or an ``ExceptionGroup`` of them all.
    """

    def __init__(self, message: str, *, what: str, failures: list) -> None:
        super().__init__(message)
        self.what = what
        self.failures = failures


class SitesRebound(PatchError):
    """Removing the attention patch found binding sites that someone else rebound after apply; they were left as
    they are (every other site holds the original again). Field: ``sites`` (their labels, "module.attr")."""

    def __init__(self, message: str, *, sites: list[str]) -> None:
        super().__init__(message)
        self.sites = sites


class UnsupportedModel(HfpatchError, ValueError):
    """``apply(model=)`` found parts of the model that context parallelism cannot make exact: a module that mixes
    tokens along the sequence outside the patched attention (a state-space scan, linear attention, a recurrence,
    a causal convolution), positions derived from the input's length, a loss computed per rank, ... Raised before
    anything is installed (or, with ``on_unsupported="fallback"``, turned into an inactive ``Patch``).

    Fields: ``findings`` (every ``model_audit.Finding``: ``.path``, ``.module_class``, ``.kind``, ``.reason``,
    ``.fix``); ``module_path``, ``module_class``, ``kind``, ``reason``, ``fix`` of the first one.
    """

    def __init__(self, message: str, *, findings: list) -> None:
        super().__init__(message)
        self.findings = list(findings)
        first = self.findings[0] if self.findings else None
        self.module_path = getattr(first, "path", None)
        self.module_class = getattr(first, "module_class", None)
        self.kind = getattr(first, "kind", None)
        self.reason = getattr(first, "reason", None)
        self.fix = getattr(first, "fix", None)


class ModelDivergence(VerificationError):
    """The whole-model probe of ``apply(model=)``: the model's CP forward differs from its non-CP forward on the
    same whole sequence. Fields: ``module_path`` (the module of the first diverging check, in execution order;
    "" for the model itself), ``module_class``, ``check`` ("output of <path>" -- the module's own computation
    diverges -- or "input <argument> of <path>" -- the caller's code that computed that argument does), ``error``
    (largest difference relative to the largest non-CP value of that tensor), ``tolerance``, ``dtype``."""

    def __init__(self, message: str, *, module_path: str, module_class: str, error: float, tolerance: float,
                 dtype: Any = None, check: str = "") -> None:
        super().__init__(message)
        self.module_path = module_path
        self.module_class = module_class
        self.check = check
        self.error = error
        self.tolerance = tolerance
        self.dtype = dtype


class RingNotReached(PatchError):
    """A model's forward under an active patch computed its attention without the ring: its attention never
    reached the patched flash path (an SDPA or eager model not given to ``apply(model=)``), so it attended within
    this rank's shard only. Raised at the next step boundary (``hfpatch.model.reach``); ``model_class`` names it."""

    def __init__(self, message: str, *, model_class: str, attn_implementation) -> None:
        super().__init__(message)
        self.model_class = model_class
        self.attn_implementation = attn_implementation


class MissingEnable(HfpatchError, RuntimeError):
    """accelerate is about to run PyTorch's own context parallelism on a model whose attention it cannot shard (not
    SDPA): a trainer with ``cp_size > 1`` that ``hfpatch.integrations.enable`` was not called on."""


class KeepAttentionError(HfpatchError, ValueError):
    """``keep_attention`` cannot keep attention outputs as asked: a budget it cannot read, or a model trained with
    no checkpointed layer (there is no recomputation to skip)."""


class UnsupportedRelease(HfpatchError, RuntimeError):
    """The transformers release cannot be patched at all (e.g. before 4.43, where every model class has its
    own ``_flash_attention_forward`` method). Fields: ``transformers_version``, ``requirement``."""

    def __init__(self, message: str, *, transformers_version: str | None = None, requirement: str | None = None):
        super().__init__(message)
        self.transformers_version = transformers_version
        self.requirement = requirement


class InvalidReleaseSpec(HfpatchError, ValueError):
    """A transformers version string (or specifier) given by the user cannot be parsed. Field: ``value``."""

    def __init__(self, message: str, *, value: str | None = None) -> None:
        super().__init__(message)
        self.value = value


class ScanError(HfpatchError, ValueError):
    """A wheel or source tree given to the static scanner is not a readable transformers release.
    Field: ``path``."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class WheelFetchError(HfpatchError, RuntimeError):
    """``pip download`` could not fetch a transformers wheel (unknown version, no network, ...).
    Fields: ``version``, ``pip_output`` (the tail of pip's output)."""

    def __init__(self, message: str, *, version: str | None = None, pip_output: str = "") -> None:
        super().__init__(message)
        self.version = version
        self.pip_output = pip_output


class ModuleNameTaken(HfpatchError, ImportError):
    """``hfpatch.dropin.provide_ring_flash_attn`` was asked to answer an import name that another module holds: one
    already imported, or a package installed under it. Nothing was changed. Fields (``ImportError``'s own): ``name``
    (the import name), ``path`` (where the other module is)."""

    def __init__(self, message: str, *, name: str, path: str | None = None) -> None:
        super().__init__(message, name=name, path=path)


# ---------------------------------------------------------------------------------------------- undo
# How everything hfpatch installs is taken out again: one protocol, one undo stack, one wrapper marker.
#
# Every installer returns one object with ``remove()`` (a ``Removable``):
#
# =============================================  ============================================================
# ``attention.patcher.install``                  ``patcher.Installation`` (every binding site, the import hook)
# ``model.routing.route_model``                  ``routing.ModelRouting`` (configs, classes, injected names)
# ``model.positions.install``                    ``UndoStack`` of the position modules' hooks
# ``mixers.install_mixers``                      ``mixers.MixerInstallation`` (rebound kernels, replaced methods)
# ``attention.dispatch.Dispatcher.track``        ``UndoStack`` of the model's forward hooks
# ``model.labels.install_labels_hook``           ``UndoStack`` of the model's forward hooks
# ``model.inputs_guard.install_inputs_guard``    ``UndoStack`` of the model's forward pre-hook
# =============================================  ============================================================
#
# ``UndoStack`` is ``contextlib.ExitStack``'s idea for installations: ``push`` records what was installed (and
# returns it, typed, for the caller to keep), ``callback`` records a function that undoes something, and ``remove()``
# undoes them newest first. Removal is all-or-nothing in the one way it can be: every part is removed even when
# another part's ``remove()`` raises; then ``RemovalFailed`` names each failure (its cause is the one exception, or
# an ``ExceptionGroup`` of them). Removing restores exactly what was there; a second ``remove()`` raises
# ``AlreadyRemoved`` (a no-op would hide a double-remove bug). ``Patch`` holds its parts in one ``UndoStack``.
#
# Functions hfpatch installs in place of someone else's (the attention wrapper, the mixer kernels' wrappers and
# method replacements, routing's ``get_target_dtype`` guard) carry one marker, ``mark_wrapper``; ``is_wrapper``
# lets an install recognise a wrapper left behind by a patch that was not removed cleanly.

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
        return f"<hfpatch.UndoStack {self.what}: {state}>"

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
