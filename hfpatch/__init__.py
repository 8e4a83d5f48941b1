"""hfpatch: a compatibility guard and patch manager giving HuggingFace transformers context parallelism.

    patch = hfpatch.apply(cp_group, model=model)     # ring attention on every flash-attention call
    with hfpatch.switch("reference"): ...            # per-thread A/B against all-gathered plain attention
    patch.remove()                                   # transformers exactly as before
    kept = hfpatch.keep_attention(model, budget="auto")   # checkpointing's recomputation skips the ring forward

``hfpatch.switch`` is the switch (``hfpatch.modes.switch``): called, its per-thread context manager.

The public names are imported on first use (PEP 562 ``__getattr__``): ``import hfpatch`` loads neither torch nor
transformers, so the command line (``hfpatch --help``, ``--version``) starts at once; ``hfpatch.apply`` and the
others import their module, and torch with it, the first time they are read.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "apply": "hfpatch.api",
    "Patch": "hfpatch.api",
    "active_patch": "hfpatch.api",
    "keep_attention": "hfpatch.model.checkpointing",
    "KeptAttention": "hfpatch.model.checkpointing",
    "switch": "hfpatch.modes",
    "set_switch": "hfpatch.modes",
    "current_mode": "hfpatch.modes",
    "HfpatchError": "hfpatch.errors",
    "SignatureMismatch": "hfpatch.errors",
    "UnsupportedArgument": "hfpatch.errors",
    "PatchError": "hfpatch.errors",
    "VerificationError": "hfpatch.errors",
    "UnsupportedRelease": "hfpatch.errors",
    "UnsupportedModel": "hfpatch.errors",
    "ModelDivergence": "hfpatch.errors",
    "KeepAttentionError": "hfpatch.errors",
    "RingNotReached": "hfpatch.errors",
}

__all__ = ["apply", "Patch", "active_patch", "keep_attention", "KeptAttention", "switch", "set_switch",
           "current_mode", "HfpatchError", "SignatureMismatch", "UnsupportedArgument", "PatchError",
           "VerificationError", "UnsupportedRelease", "UnsupportedModel", "ModelDivergence", "KeepAttentionError",
           "RingNotReached"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hfpatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value                   # later reads skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
