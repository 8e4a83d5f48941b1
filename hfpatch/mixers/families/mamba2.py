"""Mamba2: a causal convolution and the SSD chunked scan (Bamba, Falcon-H1, Nemotron-H, Zamba2, Granite 4 hybrid)."""
from __future__ import annotations

from hfpatch.mixers.family import MixerFamily
from hfpatch.mixers.forms.mamba2 import bamba_forward, bamba_forward_tiled_groups

FAMILIES = (
    MixerFamily(
        name="mamba2", mixer="Mamba2 (causal conv + SSD scan)",
        classes=("BambaMixer", "FalconH1Mixer", "NemotronHMamba2Mixer", "Zamba2MambaMixer",
                 "GraniteMoeHybridMambaLayer"),
        bindings=(("mamba2_split_conv1d_scan_combined", "mamba2_split_conv1d_scan"),
                  ("causal_conv1d_fn", "causal_conv1d"), ("mamba2_chunk_scan", "ssd_chunk_scan"),
                  ("causal_conv1d_update", "causal_conv1d_update"),
                  ("mamba2_selective_state_update", "mamba2_state_update")),
        # 5.24: 5.23's forwards with the cache argument named cache (cache_params before).
        forwards={"7cbee89fa881a759": "5.24.0: bamba, nemotron_h, zamba2, granitemoehybrid",
                  "57ec26e4ecb797e5": "5.24.0: falcon_h1",
                  "0b88953ce0c266d5": "5.23.0: bamba, nemotron_h, zamba2, granitemoehybrid",
                  "d26f69c65020a12a": "5.23.0: falcon_h1"},
    ),
    # Releases whose forward dispatches to torch_forward (the conv and the chunked scan inline) or
    # cuda_kernels_forward (imported CUDA kernels): forward replaced by a CP form (hfpatch.mixers.forms.mamba2)
    # whose conv and scan go through the names below; it checks the dispatched methods' fingerprints. 4.48's
    # torch_forward tiles the B/C groups over the heads, later ones repeat each group for its heads: one entry each.
    MixerFamily(
        name="mamba2-inline", mixer="Mamba2 (causal conv + SSD scan), computed inline",
        classes=("BambaMixer",),
        bindings=(("causal_conv1d", "causal_conv1d"), ("mamba2_chunk_scan", "ssd_chunk_scan")),
        forwards={"73d3c19e9d4ef0cd": "4.53.3, 4.54.1: bamba", "712ee18432297060": "5.0.0: bamba"},
        replaces=(("forward", bamba_forward),),
    ),
    MixerFamily(
        name="mamba2-inline-tiled-groups", mixer="Mamba2 (causal conv + SSD scan), computed inline",
        classes=("BambaMixer",),
        bindings=(("causal_conv1d", "causal_conv1d"), ("mamba2_chunk_scan", "ssd_chunk_scan")),
        forwards={"280cf43b9694b0b1": "4.48.3: bamba"},
        replaces=(("forward", bamba_forward_tiled_groups),),
    ),
)

KERNEL_PARAMETERS = {
    # hfpatch.mixers.forms.mamba2.mamba2_chunk_scan (the chunked scan of the releases that compute it inline)
    "ssd_chunk_scan": (("hidden_states", "dt", "A", "B", "C", "chunk_size", "D=None", "dt_bias=None",
                        "initial_states=None", "dt_softplus=False", "dt_limit=(0.0, inf)",
                        "return_final_states=False"),),
}
