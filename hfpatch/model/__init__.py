"""Hooks on the user's model that make the whole model exact under CP, beside the attention patch.

``audit`` finds what the model computes outside attention that CP would change (and refuses it by name);
``routing`` switches the model onto the flash-attention path the patch replaces; ``positions`` gives position
ids and rotary tables the global numbering; ``labels`` aligns shifted labels across shard boundaries;
``inputs_guard`` refuses unsharded inputs; ``probe`` compares the patched model with the unpatched one on a
small input; ``keep_attention`` keeps each ring call's output through activation checkpointing.
"""
from __future__ import annotations

# The public entry ``hfpatch.model.keep_attention(model, budget=...)`` is the function, not its module of the same
# name (importing the submodule binds the module here first; this rebinds the name to the function).
from hfpatch.model.keep_attention import KeptAttention, keep_attention

__all__ = ["KeptAttention", "keep_attention"]
