"""The CP forms of ZAYA's convolutional q/k projection (``ZayaCCAProjection.forward``), one per way the releases
write it: each calls ``cca_projection`` (``hfpatch.mixers.kinds.cca``: HF's own forward) read from this module's
globals, which ``install_mixers`` rebinds to the ``cca_projection`` kind's CP wrapper.

- ``zaya_cca_forward``: 5.19 and 5.23, the cache argument named ``past_key_values``;
- ``zaya_cca_forward_cache``: 5.24, the cache argument named ``cache``.
"""
from __future__ import annotations

from typing import Optional

import torch

from hfpatch.mixers.kinds.cca import cca_projection

__all__ = ["cca_projection", "zaya_cca_forward", "zaya_cca_forward_cache"]


def zaya_cca_forward(module, hidden_states: torch.Tensor, past_key_values=None,
                     conv_mask: Optional[torch.Tensor] = None):
    """``ZayaCCAProjection.forward`` (transformers 5.19 and 5.23) routed through ``cca_projection`` (its CP wrapper).
    The two releases differ only in how the forward reads a cache, which the kind's stand-in cache answers both
    ways."""
    # Read from this module's globals at call time: install_mixers rebinds the name to its CP wrapper.
    return cca_projection(module, hidden_states, past_key_values, conv_mask)


def zaya_cca_forward_cache(module, hidden_states: torch.Tensor, cache=None, conv_mask: Optional[torch.Tensor] = None,
                           past_key_values=None):
    """``ZayaCCAProjection.forward`` as transformers 5.24 writes it (5.23's, the cache argument renamed ``cache``;
    ``past_key_values``, the name its decorator still maps to it, taken as the cache) routed through
    ``cca_projection``, which refuses a cache under CP."""
    return cca_projection(module, hidden_states, cache if cache is not None else past_key_values, conv_mask)
