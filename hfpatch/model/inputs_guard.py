"""Inputs of another modality (images, video, audio) refused under context parallelism, by name.

A multimodal model encodes pixels or audio features with its own tower and writes the result over placeholder
tokens of the text sequence. Under CP each rank holds a shard of the tokens: the placeholders are spread over the
ranks while every rank would encode every image or clip, so the model's placeholder bookkeeping (one feature row
per placeholder, in order) no longer holds on any rank. ``apply(model=)`` hooks the model's forward: while the
patch is active (a CP group of more than one rank, switch mode other than ``"local"``) a call that passes such an
input raises ``UnsupportedArgument`` naming it. Text-only calls to the same model (its text stack is what the model
sweep proves exact) are untouched, and so is every call without CP.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from hfpatch.modes import current_mode
from hfpatch.errors import UnsupportedArgument
from hfpatch.undo import UndoStack

__all__ = ["MODALITY_INPUT_PREFIXES", "is_modality_input", "install_inputs_guard"]

# Keyword names of image / video / audio inputs across transformers' multimodal models (pixel_values,
# pixel_values_videos, image_embeds, input_image_embeds, input_features, input_audio_embeds, audio_values, ...).
MODALITY_INPUT_PREFIXES = ("pixel_", "image_", "video_", "audio_", "input_image", "input_audio",
                           "input_features", "input_values", "image_embeds")


def is_modality_input(name: str, value: Any) -> bool:
    """True for a given (not None) image, video or audio input, by its keyword name."""
    return value is not None and isinstance(value, (torch.Tensor, list, tuple)) and name.startswith(
        MODALITY_INPUT_PREFIXES)


def install_inputs_guard(model: torch.nn.Module, ctx_of: Callable[[], Any]) -> UndoStack:
    """Hook ``model``'s forward as the module docstring says; returns the hook as an ``UndoStack`` (``remove()``
    takes it off).
    ``ctx_of()``: the ``RingContext`` of the step (None when the patch is inactive or removed)."""

    def before(module, args, kwargs):
        ctx = ctx_of()
        if ctx is None or ctx.world_size <= 1 or current_mode() == "local":
            return None
        for name, value in kwargs.items():
            if is_modality_input(name, value):
                raise UnsupportedArgument(
                    name, value,
                    f"{type(module).__name__} writes the encoded {name} over placeholder tokens of the text, which "
                    "context parallelism spreads over the ranks (each rank holds a shard of the sequence), so the "
                    "placeholders and the encoded features no longer pair up on any rank.",
                    "train this model on text only under CP, or train its multimodal batches without context "
                    "parallelism (hfpatch.switch('local') or a separate non-CP run).",
                )
        return None

    return UndoStack(f"the inputs guard of {type(model).__name__}",
                     model.register_forward_pre_hook(before, with_kwargs=True))
