"""ZAYA's convolutional q/k projection (causal q/k convolution, delayed values)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily
from hfpatch.mixers.forms.zaya import zaya_cca_forward, zaya_cca_forward_cache

FAMILIES = (
    # 5.24: 5.23's forward with the cache argument named cache (past_key_values before).
    MixerFamily(
        name="zaya-cca", mixer="ZAYA's convolutional q/k projection (causal q/k convolution, delayed values)",
        classes=("ZayaCCAProjection",),
        bindings=(("cca_projection", "cca_projection"),),
        forwards={"a5fdff2c2160ec45": "5.24.0: zaya"},
        replaces=(("forward", zaya_cca_forward_cache),),
    ),
    MixerFamily(
        name="zaya-cca", mixer="ZAYA's convolutional q/k projection (causal q/k convolution, delayed values)",
        classes=("ZayaCCAProjection",),
        bindings=(("cca_projection", "cca_projection"),),
        forwards={"0f26620ced6ade2f": "5.23.0: zaya",
                  # 5.19: the same computation; a cache is read by has_previous_state / layers[i].conv_states[0]
                  # (the cca_projection kind's stand-in cache answers that interface too)
                  "101a119d76b00402": "5.19.0: zaya"},
        replaces=(("forward", zaya_cca_forward),),
    ),
)
