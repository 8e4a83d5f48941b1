"""hfpatch: a compatibility guard and patch manager giving HuggingFace transformers context parallelism.

    patch = hfpatch.apply(cp_group, model=model)     # ring attention on every flash-attention call
    with hfpatch.switch("reference"): ...            # per-thread A/B against all-gathered plain attention
    patch.remove()                                   # transformers exactly as before
    kept = hfpatch.keep_attention(model, budget="auto")   # checkpointing's recomputation skips the ring forward

``hfpatch.switch`` is both the switch module and, called, its per-thread context manager.
"""

__version__ = "0.1.0"

from hfpatch import switch  # noqa: E402  (the callable module: `with hfpatch.switch(mode):`)
from hfpatch.api import Patch, active_patch, apply  # noqa: E402
from hfpatch.errors import (  # noqa: E402
    HfpatchError,
    KeepAttentionError,
    ModelDivergence,
    PatchError,
    SignatureMismatch,
    UnsupportedArgument,
    UnsupportedModel,
    UnsupportedRelease,
    VerificationError,
)
from hfpatch.keep_attention import KeptAttention, keep_attention  # noqa: E402
from hfpatch.switch import current_mode, set_switch  # noqa: E402

__all__ = [
    "apply",
    "Patch",
    "active_patch",
    "keep_attention",
    "KeptAttention",
    "switch",
    "set_switch",
    "current_mode",
    "HfpatchError",
    "SignatureMismatch",
    "UnsupportedArgument",
    "PatchError",
    "VerificationError",
    "UnsupportedRelease",
    "UnsupportedModel",
    "ModelDivergence",
    "KeepAttentionError",
]
