"""The static verdict for a transformers release that is not installed: ``hfpatch check --transformers X.Y.Z``.

``static_check(version)`` reads the release's wheel (fetched with pip into the wheel cache, never installed or
imported) and matches its ``_flash_attention_forward`` against the registry. The live ``hfpatch check``
command calls it and turns ``result["supported"]`` into its exit code.
"""
from __future__ import annotations

import os

from hfpatch.version_gates import TRANSFORMERS_MIN_SUPPORTED, is_supported_release, parse_version
from hfpatch.release.scan import MFAU_MODULE, ReleaseScan, scan_version
from hfpatch.signatures.registry import entry_for_version

__all__ = ["static_check"]

_TARGET = "_flash_attention_forward"


def static_check(version: str, *, cache_dir: str | os.PathLike | None = None) -> dict:
    """The static verdict for ``transformers==version``, JSON-ready.

    Keys: ``version``, ``supported`` (bool), ``verdict`` ("exact" | "compatible" | "unsupported"),
    ``signature_id`` (e.g. "S5-4.53.3", "S5-4.53.3+compatible"; None before 4.43), ``expected_id`` (the entry
    whose recorded releases cover ``version``, or None), ``binding_sites`` (``module.attribute`` of the definition
    and of every from-import of it, the form ``hfpatch check`` reports for the installed release),
    ``binding_modules`` (dotted names of the modules binding the function by from-import),
    ``attention_interface`` (``kind``, ``keys``, ``flash_keys``), ``diff`` (what differs from the nearest entry;
    "" when exact), ``notes``, ``message`` (one line).

    Raises ``InvalidReleaseSpec`` for a malformed version and ``WheelFetchError`` when the wheel cannot be
    fetched (unknown release, no network): the caller reports them as usage/environment errors (exit 2).
    """
    parsed = parse_version(version, argument="--transformers")
    if not is_supported_release(parsed):
        # Before 4.43 every model class has its own _flash_attention_forward method: no single function to
        # patch, so there is nothing to fetch or scan.
        return {
            "version": str(parsed),
            "supported": False,
            "verdict": "unsupported",
            "signature_id": None,
            "expected_id": None,
            "binding_sites": [],
            "binding_modules": [],
            "attention_interface": {"kind": "none", "keys": [], "flash_keys": []},
            "diff": "",
            "notes": [],
            "message": f"transformers {parsed}: not supported; upgrade to >= {TRANSFORMERS_MIN_SUPPORTED} "
            "(earlier releases have a per-class _flash_attention_forward method in every model, not one function)",
        }
    scan = scan_version(str(parsed), cache_dir=cache_dir)
    found = scan.match()
    expected = entry_for_version(parsed)
    notes = list(found.notes) if found is not None else []
    if found is None:
        verdict, signature_id, diff = "unsupported", None, ""
        message = f"transformers {parsed}: the wheel has no module-level _flash_attention_forward; not supported"
    else:
        verdict, signature_id, diff = found.verdict, found.id, found.diff
        message = {
            "exact": f"transformers {parsed}: supported (signature {found.id})",
            "compatible": f"transformers {parsed}: supported as {found.id} (new optional parameters "
            f"{list(found.added)} are refused at run time if given a non-default value)",
            "unsupported": f"transformers {parsed}: not supported; its signature differs from {found.entry.id} "
            "(see diff); pin a supported release or open an issue with `hfpatch signatures scan` output",
        }[verdict]
        if expected is not None and found.entry.id != expected.id:
            notes.append(f"the registry records {parsed} under {expected.id}, but its wheel reads as {found.id}")
    interface = scan.attention_interface
    return {
        "version": str(parsed),
        "supported": verdict in ("exact", "compatible"),
        "verdict": verdict,
        "signature_id": signature_id,
        "expected_id": expected.id if expected is not None else None,
        "binding_sites": _binding_sites(scan),
        "binding_modules": list(scan.binding_modules),
        "attention_interface": {
            "kind": interface.kind,
            "keys": list(interface.keys),
            "flash_keys": list(interface.flash_keys),
        },
        "diff": diff,
        "notes": notes,
        "message": message,
    }


def _binding_sites(scan: ReleaseScan) -> list[str]:
    """``module.attribute`` of every name bound to the function, its definition and each from-import, sorted."""
    definition = {f"{MFAU_MODULE}.{_TARGET}"} if scan.has_module_function else set()
    return sorted(definition | {f"{site.module}.{site.bound_as}" for site in scan.binding_sites})
