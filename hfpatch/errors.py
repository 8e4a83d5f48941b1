"""Every error hfpatch raises, in one module.

Each class subclasses the builtin a caller already catches (``TypeError`` for a signature that does not fit,
``ValueError`` for an argument ring attention cannot honour, ``RuntimeError`` for a failed patch), and carries
the facts as fields so that code can act on them without parsing the message. Messages say where, what was
expected, what was found, and the fix. ``AlreadyRemoved`` and ``RemovalFailed`` are the failures of the undo
protocol (``hfpatch.undo``).
"""
from __future__ import annotations

from typing import Any

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
    a causal convolution), positions derived from the input's length, a loss computed per rank, experts sharded by
    transformers' expert parallelism (``.kind == "expert-parallel"``), weights split by its tensor parallelism
    (``.kind == "tensor-parallel"``), ... Raised before anything is installed (or,
    with ``on_unsupported="fallback"``, turned into an inactive ``Patch``).

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
