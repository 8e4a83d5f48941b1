"""The model sweep — every causal-LM class of the installed transformers that declares a flash-attention path,
built tiny, run under CP against non-CP; this module tree is release tooling, not runtime.

Flow: ``catalog`` (which classes: transformers' own auto mapping, filtered by the flash flag) → ``tiny`` (each
class built from its own config class at a tiny size with random weights; no downloads). Nothing under
``hfpatch.release.sweep`` is imported by ``hfpatch`` itself.
"""
from __future__ import annotations

from hfpatch.release.sweep.catalog import CatalogEntry, flash_causal_lm_classes, flash_head_classes
from hfpatch.release.sweep.tiny import NotBuilt, build_tiny, tiny_config

__all__ = ["CatalogEntry", "flash_causal_lm_classes", "flash_head_classes", "NotBuilt", "build_tiny", "tiny_config"]
