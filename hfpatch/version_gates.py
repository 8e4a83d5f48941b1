"""Version gates: every transformers release boundary hfpatch's code branches on, as a named ``packaging`` constant.

Compare with these constants, never with strings (``"4.100" >= "4.43"`` is False). Each constant names the
first release *series* where the behaviour holds (``X.Y.0``); the release that was read to establish it is in
the comment (read from the wheel of the latest patch of every minor release). A gate exists for code that
behaves differently across a boundary; a change of ``_flash_attention_forward``'s signature alone needs none (the
signature registry, ``hfpatch.signatures``, matches the live function itself).
"""
from __future__ import annotations

from importlib import metadata

from packaging.version import InvalidVersion, Version

from hfpatch.errors import InvalidReleaseSpec

__all__ = [
    "TRANSFORMERS_MIN_SUPPORTED",
    "parse_version",
    "installed_transformers_version",
    "is_supported_release",
]

# 4.43.4: `_flash_attention_forward` first exists as one module-level function in
# transformers/modeling_flash_attention_utils.py. Before (4.36-4.42) each model class has its own method.
TRANSFORMERS_MIN_SUPPORTED = Version("4.43.0")

# 4.44.2: `position_ids` inserted at index 7 (shifts softmax_scale..deterministic); `deterministic` default
# becomes None (was an import-time environment read).
TRANSFORMERS_POSITION_IDS = Version("4.44.0")

# 4.47.1: cu_seq_lens_q/k, max_length_q/k, target_dtype added (packed sequences from HF's own metadata).
TRANSFORMERS_CU_SEQ_LENS = Version("4.47.0")

# 4.48.3: integrations/flash_attention.py exists (from-imports the function); ALL_ATTENTION_FUNCTIONS is a
# plain dict; `**kwargs` appears in the signature; models dispatch through ALL_ATTENTION_FUNCTIONS.
TRANSFORMERS_ATTENTION_FUNCTIONS = Version("4.48.0")

# 4.49.0: `fa_peft_integration_check` casts q, k and v to `target_dtype` when the QUERY is fp32 (4.49.0 - 5.23:
# `query.dtype`, from 4.54 `q.dtype`). 4.47.1 - 4.48.3 decide by the VALUE's dtype; before 4.47 the function has no
# `target_dtype` (each attention class casts before the call).
TRANSFORMERS_TARGET_DTYPE_BY_QUERY = Version("4.49.0")

# 4.56.2: `_process_flash_attention_kwargs` converts `sliding_window` to flash-attn's window_size as
# (sliding_window - 1, sliding_window - 1) (a window of `sliding_window` tokens including the current one, the
# same as the eager/sdpa masks). 4.43.4 - 4.55.4 pass (sliding_window, sliding_window): one more key to the left.
TRANSFORMERS_SLIDING_WINDOW_INCLUSIVE = Version("4.56.0")

# The first release whose vision-language models hfpatch.model.multimodal scatters images for under CP: the image
# worlds (tests/model/test_vlm_images.py) run on 5.0.0, 5.19.0 and the CI pin; before it images stay refused.
TRANSFORMERS_IMAGES_UNDER_CP = Version("5.0.0")

# 5.3.0: Qwen3-VL's text model takes text positions from its multimodal rotary positions only in their packed
# (4, B, S) form, as Qwen2-VL's does; 5.0.0 - 5.2.0 (read from the wheels of 5.2.0 and 5.3.0) take the temporal row
# of the (3, B, S) ones, which transformers' mask reads as a document start at every image placeholder (on 5.0.0
# the model's loss without an attention mask differs from the one with an all-ones mask: 3.5e-4, 0 on 5.19.0) and
# which are not the step's positions under CP. hfpatch.model.multimodal scatters Qwen3-VL images from this release.
TRANSFORMERS_QWEN3_VL_IMAGES_UNDER_CP = Version("5.3.0")


def parse_version(text: str, *, argument: str = "transformers version") -> Version:
    """Parse a release string into a ``Version``; bad input raises ``InvalidReleaseSpec`` naming it."""
    if not isinstance(text, str):
        raise InvalidReleaseSpec(
            f"{argument} must be a string like '4.53.3', got {type(text).__name__} {text!r}", value=repr(text)
        )
    try:
        return Version(text.strip())
    except InvalidVersion as exc:
        raise InvalidReleaseSpec(
            f"{argument} {text!r} is not a valid version; expected a PEP 440 release such as '4.53.3' or '5.23.0'",
            value=text,
        ) from exc


def installed_transformers_version() -> Version | None:
    """The installed transformers distribution's version, read from its metadata (transformers is not
    imported); None when it is not installed."""
    try:
        return Version(metadata.version("transformers"))
    except metadata.PackageNotFoundError:
        return None


def is_supported_release(version: Version) -> bool:
    """True for releases that have the module-level ``_flash_attention_forward`` hfpatch patches."""
    # Compare the base version so that pre-releases of 4.43 (4.43.0rc1 < 4.43.0) count as 4.43.
    return Version(version.base_version) >= TRANSFORMERS_MIN_SUPPORTED
