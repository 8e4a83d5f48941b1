"""Kimi delta attention: a causal convolution and the gated delta rule with per-channel gates (Kimi-Linear,
Bailing hybrid)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily

FAMILIES = (
    MixerFamily(
        name="kimi-delta-attention", mixer="Kimi delta attention (causal conv + gated delta rule, per-channel gates)",
        classes=("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("chunk_kimi_delta_attention", "chunk_gated_delta_rule")),
        forwards={"558dac8b8535e46d": "5.23.0: kimi_linear", "fb5e5fc426e864bd": "5.23.0: bailing_hybrid",
                  "1b2e69b52af800d3": "5.19.0: kimi_linear (the cache read otherwise)"},
    ),
)
