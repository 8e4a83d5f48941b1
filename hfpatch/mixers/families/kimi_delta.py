"""Kimi delta attention: a causal convolution and the gated delta rule with per-channel gates (Kimi-Linear,
Bailing hybrid)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily

FAMILIES = (
    MixerFamily(
        name="kimi-delta-attention", mixer="Kimi delta attention (causal conv + gated delta rule, per-channel gates)",
        classes=("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("chunk_kimi_delta_attention", "chunk_gated_delta_rule")),
        # 5.24: 5.23's forwards with the cache argument named cache (cache_params before).
        forwards={"4f796b5b1f00dbae": "5.24.0: kimi_linear", "bbf20df0e655f9fd": "5.24.0: bailing_hybrid",
                  "558dac8b8535e46d": "5.23.0: kimi_linear", "fb5e5fc426e864bd": "5.23.0: bailing_hybrid",
                  "1b2e69b52af800d3": "5.19.0: kimi_linear (the cache read otherwise)"},
    ),
)
