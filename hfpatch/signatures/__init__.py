"""The signature registry: every generation of ``_flash_attention_forward`` since transformers 4.43.

``ROLES`` is the canonical vocabulary every parameter maps to; ``registry`` loads the JSON entries (one file per
generation, in this folder) and matches a live signature against them (``match``/``require``). The JSON files
are written by ``hfpatch signatures scan --write`` from the releases' wheels: see ``REGENERATE.md``.
"""
from hfpatch.signatures.roles import EXTRA_KWARGS_ROLE, ROLES, UNKNOWN_ROLE, role_for_name
from hfpatch.signatures.registry import Match, SignatureEntry, load_registry, match, require

__all__ = [
    "ROLES",
    "UNKNOWN_ROLE",
    "EXTRA_KWARGS_ROLE",
    "role_for_name",
    "SignatureEntry",
    "Match",
    "load_registry",
    "match",
    "require",
]
