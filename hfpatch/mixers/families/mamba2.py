"""Mamba2: a causal convolution and the SSD chunked scan (Bamba, Falcon-H1, Nemotron-H, Zamba2, Granite 4 hybrid)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily

FAMILIES = (
    MixerFamily(
        name="mamba2", mixer="Mamba2 (causal conv + SSD scan)",
        classes=("BambaMixer", "FalconH1Mixer", "NemotronHMamba2Mixer", "Zamba2MambaMixer",
                 "GraniteMoeHybridMambaLayer"),
        bindings=(("mamba2_split_conv1d_scan_combined", "mamba2_split_conv1d_scan"),
                  ("causal_conv1d_fn", "causal_conv1d"), ("mamba2_chunk_scan", "ssd_chunk_scan"),
                  ("causal_conv1d_update", "causal_conv1d_update"),
                  ("mamba2_selective_state_update", "mamba2_state_update")),
        forwards={"0b88953ce0c266d5": "5.23.0: bamba, nemotron_h, zamba2, granitemoehybrid",
                  "d26f69c65020a12a": "5.23.0: falcon_h1"},
    ),
)
