"""Gated short causal convolution (LFM2 and its relatives)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily

FAMILIES = (
    MixerFamily(
        name="short-conv", mixer="gated short causal convolution (LFM2)",
        classes=("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"),),
        forwards={"9d25f6f80e2dfb9d": "5.23.0: lfm2, lfm2_moe, lfm3"},
    ),
)
