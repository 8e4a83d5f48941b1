"""ZAYA's convolutional q/k projection (causal q/k convolution, delayed values)."""
from __future__ import annotations

from hfpatch.mixers.cca import zaya_cca_forward
from hfpatch.mixers.family import MixerFamily

FAMILIES = (
    MixerFamily(
        name="zaya-cca", mixer="ZAYA's convolutional q/k projection (causal q/k convolution, delayed values)",
        classes=("ZayaCCAProjection",),
        bindings=(("cca_projection", "cca_projection"),),
        forwards={"0f26620ced6ade2f": "5.23.0: zaya"},
        replaces=(("forward", zaya_cca_forward),),
    ),
)
