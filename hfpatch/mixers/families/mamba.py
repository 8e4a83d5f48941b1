"""Mamba: a causal convolution and the selective scan (Jamba, Zamba)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily

FAMILIES = (
    MixerFamily(
        name="mamba", mixer="Mamba (causal conv + selective scan)",
        classes=("JambaMambaMixer", "ZambaMambaMixer"),
        bindings=(("causal_conv1d_fn", "causal_conv1d"), ("mamba_selective_scan", "selective_scan"),
                  ("causal_conv1d_update", "causal_conv1d_update"),
                  ("mamba_selective_state_update", "selective_state_update")),
        forwards={"87d4a4c321593491": "5.23.0: jamba", "e57915bae9b46411": "5.23.0: zamba"},
    ),
)
