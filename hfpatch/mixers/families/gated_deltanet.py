"""Gated DeltaNet: a causal convolution and the chunked gated delta rule (Qwen3-Next, Qwen3.5, OLMo hybrid)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily

FAMILIES = (
    MixerFamily(
        name="gated-deltanet", mixer="Gated DeltaNet (causal conv + gated delta rule)",
        classes=("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                 "OlmoHybridGatedDeltaNet"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")),
        forwards={"052c77b2f14ce8aa": "5.23.0: qwen3_next", "93cc9bac2962265d": "5.23.0: qwen3_5, qwen3_5_moe",
                  "945ac3c988a3b01c": "5.23.0: olmo_hybrid (beta x 2 with allow_neg_eigval: still affine)",
                  # 5.19: q and k repeated to the value heads before the kernel call; the cache read otherwise
                  "63135e43b6c96306": "5.19.0: qwen3_next", "6a7fb7096a1c1fa1": "5.19.0: qwen3_5, qwen3_5_moe",
                  "0c93520dfed77227": "5.19.0: olmo_hybrid"},
    ),
)
